"""apply_async_in writes the message apply_async would have sent, through the caller's connection.

Each comparison publishes the same call twice with the same task id (task ids are not unique in
the table): once with Celery's ``apply_async`` through the broker, once with ``apply_async_in``
in a transaction. Apart from the delivery tag (a fresh UUID per publish) the stored rows must be
equal field by field.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, chord, group
from celery.result import AsyncResult, GroupResult
from celery.signals import after_task_publish, before_task_publish
from kombu import Exchange, Queue

from kombu_pgskip import UnsupportedCanvas, apply_async_in, send_task_in
from kombu_pgskip.store import notify_channel
from tests.publish_support import Job, client_backends, jobs, make_app


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = make_app(
        db_url,
        task_queues=[
            Queue("celery"),
            Queue("invoices", max_priority=9),
            Queue("topicq", Exchange("orders", type="topic"), routing_key="orders.#"),
        ],
    )
    yield app
    app.close()


def _comparable(job: Job) -> dict[str, Any]:
    payload = copy.deepcopy(job.payload)
    tag = payload["properties"].pop("delivery_tag")
    assert tag  # present on both, different on each publish
    # A TTL in milliseconds counted from the publish: a timestamp, compared apart.
    expiration = payload["properties"].pop("expiration", None)
    return {
        "payload": payload,
        "queue": job.queue,
        "priority": job.priority,
        "status": job.status,
        "task_name": job.task_name,
        "task_id": job.task_id,
        "delayed": job.delayed,
        "has_ttl": job.ttl_seconds is not None,
        "has_expiration": expiration is not None,
    }


def _soon(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


def _option_sets(app: Celery) -> dict[str, dict[str, Any]]:
    add = app.tasks["txn.add"]
    return {
        "defaults": {},
        "queue-priority-headers": {
            "queue": "invoices",
            "priority": 7,
            "headers": {"tenant": "acme", "trace": [1, 2]},
        },
        "eta-expires-link-limits": {
            "eta": _soon(3600),
            "expires": _soon(7200),
            "link": add.s(10),
            "link_error": add.si(0, 0),
            "time_limit": 30,
            "soft_time_limit": 20,
            "shadow": "add-shadowed",
            "serializer": "json",
        },
        "topic-routing": {"queue": "topicq", "routing_key": "orders.created"},
        "short-eta": {"eta": _soon(1), "ignore_result": True},
    }


@pytest.mark.parametrize(
    ("case", "queue"),
    [
        ("defaults", "celery"),
        ("queue-priority-headers", "invoices"),
        ("eta-expires-link-limits", "celery"),
        ("topic-routing", "topicq"),
        ("short-eta", "celery"),
    ],
)
def test_row_equals_the_one_apply_async_writes(
    app: Celery, db_url: str, case: str, queue: str
) -> None:
    add = app.tasks["txn.add"]
    options = _option_sets(app)[case]
    tid = str(uuid.uuid4())
    plain = add.apply_async((2, 3), task_id=tid, **options)
    with psycopg.connect(db_url) as conn, conn.transaction():
        mine = apply_async_in(conn, add, args=(2, 3), task_id=tid, **options)
    assert plain.id == mine.id == tid
    rows = jobs(db_url, tid)
    assert [r.queue for r in rows] == [queue, queue]
    assert _comparable(rows[1]) == _comparable(rows[0])
    if rows[0].ttl_seconds is not None:
        assert rows[1].ttl_seconds == pytest.approx(rows[0].ttl_seconds, abs=2.0)
    expirations = [r.payload["properties"].get("expiration") for r in rows]
    if expirations[0] is not None:
        assert int(expirations[1]) == pytest.approx(int(expirations[0]), abs=2000)


def test_send_task_in_row_equals_the_one_send_task_writes(app: Celery, db_url: str) -> None:
    tid = str(uuid.uuid4())
    options: dict[str, Any] = {"queue": "invoices", "priority": 3, "kwargs": {"order": 12}}
    app.send_task("billing.send_invoice", args=(12,), task_id=tid, **options)
    with psycopg.connect(db_url) as conn, conn.transaction():
        result = send_task_in(
            conn, "billing.send_invoice", args=(12,), app=app, task_id=tid, **options
        )
    assert isinstance(result, AsyncResult)
    rows = jobs(db_url, tid)
    assert [r.task_name for r in rows] == ["billing.send_invoice", "billing.send_invoice"]
    assert _comparable(rows[1]) == _comparable(rows[0])


def test_publish_signals_fire_with_the_same_arguments_while_still_uncommitted(
    app: Celery, db_url: str
) -> None:
    add = app.tasks["txn.add"]
    seen: list[tuple[str, dict[str, Any], int]] = []
    tid = str(uuid.uuid4())

    def on_before(sender: str, **kwargs: Any) -> None:
        seen.append(("before", kwargs, len(jobs(db_url, tid))))

    def on_after(sender: str, **kwargs: Any) -> None:
        seen.append(("after", kwargs, len(jobs(db_url, tid))))

    before_task_publish.connect(on_before, weak=False)
    after_task_publish.connect(on_after, weak=False)
    try:
        add.apply_async((1, 1), task_id=tid, queue="invoices", headers={"k": "v"})
        with psycopg.connect(db_url) as conn, conn.transaction():
            apply_async_in(
                conn, add, args=(1, 1), task_id=tid, queue="invoices", headers={"k": "v"}
            )
    finally:
        before_task_publish.disconnect(on_before)
        after_task_publish.disconnect(on_after)
    assert [s[0] for s in seen] == ["before", "after", "before", "after"]
    (_, plain_before, _), (_, plain_after, _), (_, mine_before, _), (_, mine_after, visible) = seen
    assert mine_before == plain_before
    assert mine_after == plain_after
    # after_task_publish means "written in your transaction": nobody else sees it yet.
    assert visible == 1  # only the plain apply_async row


def test_returns_the_async_result_apply_async_returns(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    with psycopg.connect(db_url) as conn, conn.transaction():
        result = apply_async_in(conn, add, args=(1, 2))
    assert type(result) is type(add.AsyncResult(result.id))
    assert result.app is app
    assert [j.task_id for j in jobs(db_url)] == [result.id]


def test_signature_chain_writes_first_step_with_the_rest_in_its_message(
    app: Celery, db_url: str
) -> None:
    add = app.tasks["txn.add"]
    with psycopg.connect(db_url) as conn, conn.transaction():
        result = apply_async_in(conn, chain(add.s(1, 2), add.s(3), add.s(4)), queue="invoices")
    rows = jobs(db_url)
    assert len(rows) == 1
    first = rows[0]
    assert first.queue == "invoices"
    args, _kwargs, embed = json.loads(base64.b64decode(first.payload["body"]))
    assert args == [1, 2]
    assert [step["task"] for step in embed["chain"]] == ["txn.add", "txn.add"]
    # The result is the chain's last step; its parents lead back to the written message.
    assert result.parent is not None and result.parent.parent is not None
    assert result.parent.parent.id == first.task_id


def test_group_writes_every_member_and_rollback_removes_them_all(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            result = apply_async_in(conn, group(add.s(i, i) for i in range(3)))
        with pytest.raises(ZeroDivisionError), conn.transaction():
            apply_async_in(conn, group(add.s(i, i) for i in range(5)))
            _ = 1 / 0
    assert isinstance(result, GroupResult)
    rows = jobs(db_url)
    assert sorted(r.task_id or "" for r in rows) == sorted(r.id for r in result.results)
    assert {r.payload["headers"]["group"] for r in rows} == {result.id}


@pytest.mark.parametrize("shape", ["chord", "chain-starting-with-group"])
def test_chord_is_refused_before_anything_is_written(app: Celery, db_url: str, shape: str) -> None:
    add = app.tasks["txn.add"]
    header = [add.s(1, 1), add.s(2, 2)]
    canvas = chord(header, add.s()) if shape == "chord" else chain(group(header), add.s())
    with psycopg.connect(db_url) as conn, conn.transaction():
        with pytest.raises(UnsupportedCanvas):
            apply_async_in(conn, canvas)
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the transaction is intact
    assert jobs(db_url) == []


def test_opens_no_connection_of_its_own(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    with psycopg.connect(db_url) as conn, conn.transaction():
        apply_async_in(conn, add, args=(1, 2), countdown=30)
        apply_async_in(conn, chain(add.s(1, 2), add.s(3)))
        apply_async_in(conn, group(add.s(1, 1), add.s(2, 2)))
        send_task_in(conn, "billing.send_invoice", app=app)
        assert client_backends(db_url) == {conn.info.backend_pid}
    assert len(jobs(db_url)) == 5


def test_workers_are_notified_at_commit_and_never_on_rollback(app: Celery, db_url: str) -> None:
    add = app.tasks["txn.add"]
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{notify_channel("pgskip")}"')
        with psycopg.connect(db_url) as conn:
            with pytest.raises(ZeroDivisionError), conn.transaction():
                apply_async_in(conn, add, args=(1, 2), queue="invoices")
                _ = 1 / 0
            assert list(listener.notifies(timeout=0.3)) == []
            with conn.transaction():
                apply_async_in(conn, add, args=(1, 2), queue="invoices")
                assert list(listener.notifies(timeout=0.2)) == []  # not before commit
            notes = list(listener.notifies(timeout=2.0, stop_after=2))
        row_id, slot = listener.execute("SELECT id, slot FROM pgskip.jobs").fetchone() or (0, 0)
    # the message named (queue, id and slot), then the queue alone
    named = ["invoices", str(row_id), str(slot)]
    assert [n.payload.split("\x1f") for n in notes] == [named, ["invoices"]]


def test_after_the_commit_a_queue_s_one_job_is_named_and_several_are_not(
    app: Celery, db_url: str
) -> None:
    """``kombu_pgskip.transaction``: the NOTIFYs after the commit name the job of a queue that
    got one (queue, id and slot, then the queue alone), and only the queue of one that got
    two."""
    import kombu_pgskip

    add = app.tasks["txn.add"]
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{notify_channel("pgskip")}"')
        with psycopg.connect(db_url) as conn, kombu_pgskip.transaction(conn):
            apply_async_in(conn, add, args=(1, 2), queue="one")
            apply_async_in(conn, add, args=(1, 2), queue="two")
            apply_async_in(conn, add, args=(1, 2), queue="two")
        notes = list(listener.notifies(timeout=2.0, stop_after=3))
        assert list(listener.notifies(timeout=0.3)) == []
        row = listener.execute("SELECT id, slot FROM pgskip.jobs WHERE queue = 'one'").fetchone()
    assert row is not None
    assert [n.payload for n in notes] == [f"one\x1f{row[0]}\x1f{row[1]}", "one", "two"]


def test_concurrent_transactions_enqueuing_to_one_queue_do_not_wait_for_each_other(
    app: Celery, db_url: str
) -> None:
    add = app.tasks["txn.add"]
    add.apply_async((0, 0), queue="invoices")  # the broker path declares the queue's row
    with (
        psycopg.connect(db_url) as first,
        psycopg.connect(db_url) as second,
        first.transaction(),
    ):
        apply_async_in(first, add, args=(1, 1), queue="invoices")
        with second.transaction():
            # Were a row lock involved, this would fail after 1 s instead of waiting forever.
            second.execute("SET LOCAL lock_timeout = '1s'")
            apply_async_in(second, add, args=(2, 2), queue="invoices")
    assert len(jobs(db_url)) == 3
