"""Bulk publishing: ``batch``, ``publish_many``, ``apply_many`` and ``apply_many_in``.

Each writes exactly what the same calls write one by one, with one statement (or several in
one transaction), all or nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery, group
from kombu import Connection, Consumer, Exchange, Queue

import kombu_pgskip.store
from kombu_pgskip import (
    ConfigurationError,
    UnsupportedCanvas,
    apply_many,
    apply_many_in,
    batch,
    publish_many,
)
from tests.integration.test_publish_message import _comparable
from tests.publish_support import DRIVERS, Rollback, broker_url, jobs, make_app


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = make_app(db_url, task_queues=[Queue("celery"), Queue("bulkprio", max_priority=5)])
    yield app
    app.close()


def _transactions_of_jobs(db_url: str) -> int:
    """How many transactions wrote the jobs now in the table."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(DISTINCT xmin::text) FROM pgskip.jobs").fetchone()
    assert row is not None
    return int(row[0])


def _consume_all(url: str, queue: Queue, n: int) -> list[Any]:
    got: list[Any] = []
    with (
        Connection(url) as conn,
        Consumer(conn, [queue], callbacks=[lambda body, m: (got.append(body), m.ack())]),
    ):
        while len(got) < n:
            conn.drain_events(timeout=5)
    return got


def test_publish_many_writes_every_body_in_one_transaction_in_order(db_url: str) -> None:
    url = broker_url(db_url)
    queue = Queue("bulk", Exchange("bulk"), "bulk")
    bodies = [{"i": i, "text": f"message {i} — ünïcode ' \" ;"} for i in range(2000)]
    with Connection(url) as conn:
        producer = conn.Producer()
        ids = publish_many(producer, bodies, exchange=queue.exchange, routing_key="bulk",
                           declare=[queue])  # fmt: skip
    assert len(ids) == 2000 and ids == sorted(ids)
    assert _transactions_of_jobs(db_url) == 1
    assert _consume_all(url, queue, 2000) == bodies


def test_rows_equal_those_the_same_calls_write_one_by_one(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    soon = datetime.now(timezone.utc) + timedelta(seconds=1)
    cases: list[dict[str, Any]] = [
        {},
        {"queue": "bulkprio", "priority": 9, "headers": {"tenant": "acme"}},
        {"eta": soon + timedelta(hours=1), "expires": soon + timedelta(hours=2)},
        {"eta": soon},
    ]
    for options in cases:
        tid = str(uuid.uuid4())
        add.apply_async((1, 2), task_id=tid, **options)
        (result,) = apply_many([add.s(1, 2).set(task_id=tid, **options)])
        assert result.id == tid
        rows = jobs(db_url, tid)
        assert len(rows) == 2
        assert _comparable(rows[1]) == _comparable(rows[0]), options
    prio = [r for r in jobs(db_url) if r.queue == "bulkprio"]
    assert [r.priority for r in prio] == [5, 5]  # clamped to x-max-priority either way


def test_apply_many_is_one_durable_commit_for_many_tasks(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    results = apply_many(add.s(i, i) for i in range(1500))
    assert len({r.id for r in results}) == 1500
    assert _transactions_of_jobs(db_url) == 1
    rows = jobs(db_url)
    assert [r.task_id for r in rows] == [r.id for r in results]
    assert {r.status for r in rows} == {"pending"}


def test_a_group_goes_out_as_one_batch(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    (result,) = apply_many([group(add.s(i, 1) for i in range(20))])
    assert len(result.results) == 20
    assert len(jobs(db_url)) == 20
    assert _transactions_of_jobs(db_url) == 1


def test_an_exception_in_the_block_writes_nothing(db_url: str) -> None:
    queue = Queue("nothing", Exchange("nothing"), "nothing")
    with Connection(broker_url(db_url)) as conn:
        producer = conn.Producer()
        producer.declare()
        with pytest.raises(RuntimeError), batch(producer):
            for i in range(10):
                producer.publish({"i": i}, exchange=queue.exchange, routing_key="nothing",
                                 declare=[queue])  # fmt: skip
            raise RuntimeError("changed my mind")
    assert jobs(db_url) == []


def test_many_chunks_are_still_all_or_nothing(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kombu_pgskip.store, "PUBLISH_MANY_CHUNK", 7)
    queue = Queue("chunks", Exchange("chunks"), "chunks")
    with Connection(broker_url(db_url)) as conn:
        producer = conn.Producer()
        ids = publish_many(producer, range(30), exchange=queue.exchange, routing_key="chunks",
                           declare=[queue])  # fmt: skip
        assert len(ids) == 30
        assert _transactions_of_jobs(db_url) == 1  # five statements, one transaction

        # A statement that fails after four chunks were written (a real error raised by the
        # server inside the same transaction, before the fifth chunk): the four are rolled
        # back with it.
        calls = {"n": 0}
        real = kombu_pgskip.store.Store._publish_chunk

        def failing(self: Any, chunk: Any) -> list[int]:
            calls["n"] += 1
            if calls["n"] == 5:
                self.conn.execute("SELECT 1/0")
            return real(self, chunk)

        monkeypatch.setattr(kombu_pgskip.store.Store, "_publish_chunk", failing)
        with pytest.raises(psycopg.errors.DivisionByZero):
            publish_many(producer, range(30), exchange=queue.exchange, routing_key="chunks")
    assert len(jobs(db_url)) == 30  # only the first batch


def test_fanout_routing_is_resolved_once_and_writes_a_row_per_queue(db_url: str) -> None:
    fan = Exchange("bulkfan", type="fanout")
    queues = [Queue(f"fan{i}", fan) for i in range(3)]
    with Connection(broker_url(db_url)) as conn:
        for q in queues:
            q(conn.default_channel).declare()
        producer = conn.Producer()
        ids = publish_many(producer, [{"n": n} for n in range(10)], exchange=fan)
    assert len(ids) == 30
    assert sorted({r.queue for r in jobs(db_url)}) == ["fan0", "fan1", "fan2"]


def test_batch_refuses_another_transport() -> None:
    with Connection("memory://") as conn:
        producer = conn.Producer()
        with pytest.raises(ConfigurationError, match="pgskip"), batch(producer):
            pass


@pytest.mark.parametrize(
    "driver_name", ["psycopg", "psycopg2", "sqlalchemy-psycopg2-connection", "django"]
)
def test_apply_many_in_commits_with_the_callers_transaction(
    app: Celery, db_url: str, driver_name: str
) -> None:
    driver = DRIVERS[driver_name](db_url)
    add = app.tasks["txn.add"]
    with driver.transaction() as conn:
        results = apply_many_in(conn, [add.s(i, 2) for i in range(50)])
        assert jobs(db_url) == []  # not visible before the commit
    assert [r.task_id for r in jobs(db_url)] == [r.id for r in results]

    with driver.transaction() as conn:
        apply_many_in(conn, [add.s(i, 3) for i in range(50)])
        raise Rollback()
    assert len(jobs(db_url)) == 50  # the rolled-back fifty never existed


def test_apply_many_in_refuses_chords_before_writing(app: Celery, db_url: str) -> None:
    from celery import chord

    add = app.tasks["txn.add"]
    with psycopg.connect(db_url) as conn, conn.transaction():
        with pytest.raises(UnsupportedCanvas):
            apply_many_in(conn, [add.s(1, 1), chord([add.s(1, 1)], add.s())])
        assert jobs(db_url) == []


def test_kombus_own_producer_batch_writes_max_size_at_a_time(db_url: str) -> None:
    queue = Queue("kbatch", Exchange("kbatch"), "kbatch")
    with Connection(broker_url(db_url)) as conn:
        producer = conn.Producer(exchange=queue.exchange, routing_key="kbatch")
        queue(conn.default_channel).declare()
        assert producer.supports_batch_publish
        with producer.batch(max_size=40):
            for i in range(100):
                producer.publish({"i": i})
            assert len(jobs(db_url)) == 80  # two automatic flushes of 40
        assert len(jobs(db_url)) == 100
        with pytest.raises(RuntimeError), producer.batch(max_size=40):
            for i in range(50):
                producer.publish({"i": i})
            raise RuntimeError("abort")
        assert len(jobs(db_url)) == 140  # the flushed 40 stay, the other 10 are discarded
    assert _transactions_of_jobs(db_url) == 4
