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
from kombu.exceptions import EncodeError

import kombu_pgskip.store
from kombu_pgskip import (
    ConfigurationError,
    MessageTooLarge,
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


def _consume_all(url: str, queue: Queue, n: int, accept: list[str] | None = None) -> list[Any]:
    got: list[Any] = []
    with (
        Connection(url) as conn,
        Consumer(
            conn, [queue], callbacks=[lambda body, m: (got.append(body), m.ack())], accept=accept
        ),
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


def _count_publishes(producer: Any) -> dict[str, int]:
    """Count the calls of ``producer.publish`` from now on."""
    calls = {"n": 0}
    real = producer.publish

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    producer.publish = counting
    return calls


_PUBLISH_OPTION_SETS: dict[str, dict[str, Any]] = {
    "default exchange": {"routing_key": "alike"},
    "direct exchange": {"exchange": "alike-x", "routing_key": "alike"},
    "headers, priority, expiration, a property": {
        "exchange": "alike-x",
        "routing_key": "alike",
        "headers": {"tenant": "acme", "n": 1},
        "priority": 3,
        "expiration": 60,
        "correlation_id": "c-1",
    },
    "compressed": {"routing_key": "alike", "compression": "zlib"},
    "pickle": {"routing_key": "alike", "serializer": "pickle"},
    "raw text": {"routing_key": "alike", "content_type": "text/plain"},
}


@pytest.mark.parametrize("options", _PUBLISH_OPTION_SETS.values(), ids=_PUBLISH_OPTION_SETS)
def test_publish_many_rows_equal_those_of_publish_one_by_one(
    db_url: str, options: dict[str, Any]
) -> None:
    text = options.get("content_type") == "text/plain"
    bodies: list[Any] = (
        [f"line {i} ünïcode \x1e" for i in range(5)]
        if text
        else [{"i": i, "text": f"message {i} — ' \" ; \x1e"} for i in range(5)]
    )
    queue = Queue("alike", Exchange("alike-x"), "alike")
    with Connection(broker_url(db_url)) as conn:
        queue(conn.default_channel).declare()
        producer = conn.Producer()
        for body in bodies:
            producer.publish(body, **options)
        calls = _count_publishes(producer)
        publish_many(producer, bodies, **options)
    assert calls["n"] == 1  # the later bodies were spliced, not published one by one
    rows = jobs(db_url)
    assert len(rows) == 2 * len(bodies)
    one_by_one, many = rows[: len(bodies)], rows[len(bodies) :]
    assert [_comparable(r) for r in many] == [_comparable(r) for r in one_by_one]
    tags = [r.payload["properties"]["delivery_tag"] for r in rows]
    assert len(set(tags)) == len(tags)  # each message its own tag, as kombu gives it
    accept = ["json", "pickle", "text/plain"]
    assert _consume_all(broker_url(db_url), queue, 2 * len(bodies), accept) == bodies + bodies


def test_publish_many_splices_later_bodies_instead_of_publishing_each(db_url: str) -> None:
    queue = Queue("splice", Exchange("splice"), "splice")
    with Connection(broker_url(db_url)) as conn:
        producer = conn.Producer()
        calls = _count_publishes(producer)
        bodies = [{"n": n} for n in range(100)]
        ids = publish_many(
            producer, bodies, exchange=queue.exchange, routing_key="splice", declare=[queue]
        )
    assert len(ids) == 100
    assert calls["n"] == 1  # the first body only: the other 99 are spliced into its row
    assert _consume_all(broker_url(db_url), queue, 100) == [{"n": n} for n in range(100)]


def test_publish_many_publishes_a_body_of_another_content_type_in_full(db_url: str) -> None:
    queue = Queue("mixed", Exchange("mixed"), "mixed")
    bodies: list[Any] = ["text", b"\x00\xffbinary", "more text"]
    with Connection(broker_url(db_url)) as conn:
        queue(conn.default_channel).declare()
        producer = conn.Producer()
        publish_many(producer, bodies, routing_key="mixed", content_type="application/x-thing")
    got: list[Any] = []
    with (
        Connection(broker_url(db_url)) as conn,
        Consumer(
            conn,
            [queue],
            callbacks=[lambda b, m: (got.append(m), m.ack())],
            accept=["application/x-thing"],
        ),  # fmt: skip
    ):
        while len(got) < 3:
            conn.drain_events(timeout=5)
    assert [m.body for m in got] == [b"text", b"\x00\xffbinary", b"more text"]
    assert [m.content_encoding for m in got] == ["utf-8", "binary", "utf-8"]


def test_publish_many_refuses_a_later_body_over_max_message_size(db_url: str) -> None:
    queue = Queue("big", Exchange("big"), "big")
    bodies = [{"pad": "x" * 10}, {"pad": "y" * 10}, {"pad": "z" * 8000}]
    with Connection(broker_url(db_url), transport_options={"max_message_size": 4096}) as conn:
        queue(conn.default_channel).declare()
        producer = conn.Producer()
        with pytest.raises(MessageTooLarge, match=r"exchange 'big'.*max_message_size"):
            publish_many(producer, bodies, exchange=queue.exchange, routing_key="big")
    assert jobs(db_url) == []  # nothing half-written


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


def _publish_in_a_batch(producer: Any, bodies: Any, **options: Any) -> list[int]:
    with batch(producer) as ids:
        for body in bodies:
            producer.publish(body, **options)
    return ids


@pytest.mark.parametrize(
    ("write", "chunk_setting"),
    [(publish_many, "PUBLISH_STREAM_CHUNK"), (_publish_in_a_batch, "PUBLISH_MANY_CHUNK")],
    ids=["publish_many streamed", "batch"],
)
def test_many_chunks_are_still_all_or_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch, write: Any, chunk_setting: str
) -> None:
    monkeypatch.setattr(kombu_pgskip.store, chunk_setting, 7)
    queue = Queue("chunks", Exchange("chunks"), "chunks")
    with Connection(broker_url(db_url)) as conn:
        producer = conn.Producer()
        ids = write(producer, range(30), exchange=queue.exchange, routing_key="chunks",
                    declare=[queue])  # fmt: skip
        assert len(ids) == 30 and ids == sorted(ids)
        assert _transactions_of_jobs(db_url) == 1  # five statements, one transaction

        # The fifth statement fails in the server (its rows are not valid JSON), after four
        # chunks were written in the same transaction: the four are rolled back with it.
        calls = {"n": 0}
        real = kombu_pgskip.store._many_params

        def failing(messages: Any) -> dict[str, str]:
            calls["n"] += 1
            params = real(messages)
            return {**params, "rows": "[{not json"} if calls["n"] == 5 else params

        monkeypatch.setattr(kombu_pgskip.store, "_many_params", failing)
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            write(producer, range(30), exchange=queue.exchange, routing_key="chunks")
        assert calls["n"] == 5
        # The connection is usable afterwards.
        monkeypatch.setattr(kombu_pgskip.store, "_many_params", real)
        assert len(write(producer, range(3), exchange=queue.exchange, routing_key="chunks")) == 3
    assert len(jobs(db_url)) == 33  # only the first call's and the last call's


def test_publish_many_writes_nothing_when_a_body_fails_midway(db_url: str) -> None:
    queue = Queue("midway", Exchange("midway"), "midway")

    class Unserializable:
        pass

    def bodies() -> Iterator[Any]:
        yield from ({"n": n} for n in range(250))  # two chunks sent before the failure
        yield Unserializable()

    with Connection(broker_url(db_url)) as conn:
        producer = conn.Producer()
        with pytest.raises(EncodeError):
            publish_many(producer, bodies(), exchange=queue.exchange, routing_key="midway",
                         declare=[queue])  # fmt: skip
        assert jobs(db_url) == []
        ids = publish_many(producer, [{"n": 1}], exchange=queue.exchange, routing_key="midway")
    assert [j.id for j in jobs(db_url)] == ids


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
