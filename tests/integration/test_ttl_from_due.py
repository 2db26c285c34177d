"""A TTL counts from when the message becomes due, not from its publish.

A queue's ``x-message-ttl`` (or a message's ``expiration``) bounds how long a message may wait
for a consumer. A task sent with a countdown longer than that TTL is not waiting for a consumer
until it is due: dropping it before then would lose it unseen (no failed row, its result
PENDING forever). Each insert path is checked: a single publish to the default exchange, a
routed publish (Celery's ``apply_async``), and a batch.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue

from kombu_pgskip import batch
from kombu_pgskip.store import Store

TTL = 1.0  # seconds: the queue's x-message-ttl
COUNTDOWN = 3.0  # seconds: longer than the TTL, and than eta_threshold (stored as scheduled)


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _rows(db_url: str, queue: str) -> list[tuple[str, float]]:
    """(status, seconds from run_at to expires_at) of the queue's messages."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT status::text, extract(epoch FROM expires_at - run_at)::float8"
            " FROM pgskip.jobs WHERE queue = %s ORDER BY id",
            (queue,),
        )
        return [(r[0], r[1]) for r in rows]


def _received_after_due(db_url: str, queue: Queue, count: int) -> list[Any]:
    """Wait past the TTL, drop what expired as every worker's sweeper does, then consume."""
    time.sleep(TTL + 0.5)
    store = Store(db_url, schema="pgskip")
    try:
        assert store.drop_expired() == 0, "dropped before it was due"
    finally:
        store.close()
    received: list[Any] = []
    with Connection(_broker(db_url)) as conn:
        Consumer(
            conn.channel(), [queue], callbacks=[lambda body, m: (received.append(body), m.ack())]
        ).consume()
        deadline = time.monotonic() + COUNTDOWN + 10
        while len(received) < count and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
    return received


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name), name, message_ttl=TTL)


def _eta() -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=COUNTDOWN)


@pytest.mark.parametrize("routed", [False, True], ids=["default-exchange", "routed"])
def test_a_countdown_longer_than_the_queue_ttl_is_delivered_when_due(
    db_url: str, routed: bool
) -> None:
    name = f"ttl-due-{'routed' if routed else 'direct'}"
    queue = _queue(name)
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        queue(producer.channel).declare()
        exchange = queue.exchange if routed else ""
        producer.publish(
            {"n": 1}, exchange=exchange, routing_key=name, headers={"eta": _eta().isoformat()}
        )
    ((status, ttl),) = _rows(db_url, name)
    assert status == "scheduled"
    assert ttl == pytest.approx(TTL, abs=0.01), "the TTL starts at the due time"
    assert _received_after_due(db_url, queue, 1) == [{"n": 1}]


def test_a_batch_with_countdowns_keeps_them_until_due(db_url: str) -> None:
    name = "ttl-due-batch"
    queue = _queue(name)
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        queue(producer.channel).declare()
        with batch(producer):
            for n in range(3):
                producer.publish(
                    {"n": n}, exchange="", routing_key=name, headers={"eta": _eta().isoformat()}
                )
    rows = _rows(db_url, name)
    assert [s for s, _ in rows] == ["scheduled"] * 3
    assert all(ttl == pytest.approx(TTL, abs=0.01) for _, ttl in rows)
    assert sorted(b["n"] for b in _received_after_due(db_url, queue, 3)) == [0, 1, 2]


def test_a_celery_countdown_longer_than_the_queue_ttl_runs(db_url: str) -> None:
    """Celery's ``apply_async(countdown=)`` to a queue with ``message_ttl``: the message is
    there when it falls due."""
    name = "ttl-due-celery"
    queue = _queue(name)
    app = Celery("ttl", broker=_broker(db_url))
    app.conf.task_queues = [queue]
    with app.connection_for_write() as conn:
        queue(conn.default_channel).declare()
        app.send_task("ttl.noop", queue=name, countdown=COUNTDOWN, connection=conn)
    ((status, ttl),) = _rows(db_url, name)
    assert status == "scheduled" and ttl == pytest.approx(TTL, abs=0.01)
    received = _received_after_due(db_url, queue, 1)
    assert len(received) == 1


def test_a_message_that_is_due_at_once_still_expires_after_its_ttl(db_url: str) -> None:
    name = "ttl-due-now"
    queue = _queue(name)
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        queue(producer.channel).declare()
        producer.publish({"n": 1}, exchange="", routing_key=name)
    time.sleep(TTL + 0.3)
    store = Store(db_url, schema="pgskip")
    try:
        assert store.drop_expired() == 1
    finally:
        store.close()
    assert _rows(db_url, name) == []
