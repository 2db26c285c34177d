"""``keep_completed=False``: an ack deletes its message instead of marking it ``completed``.

Every other transition stays as it is: a rejected message is kept as ``failed``, a requeued one
goes back to ``pending``, and an ack from a consumer that no longer holds the message deletes
nothing. The crash scenario runs with the option too (tests/chaos/test_crash.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from kombu_pgskip.store import NewMessage, Store

OFF = {"keep_completed": False}


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _counts(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _publish(conn: Connection, queue: Queue, n: int) -> None:
    producer = Producer(conn.channel())
    for i in range(n):
        producer.publish(
            {"i": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
        )


def _run_loop_until(hub: Hub, done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        hub.run_once()


def test_the_option_is_read_from_transport_options(db_url: str) -> None:
    with Connection(_broker(db_url), transport_options={"keep_completed": "false"}) as conn:
        conn.connect()
        assert conn.transport.options.keep_completed is False
    with Connection(_broker(db_url)) as conn:
        conn.connect()
        assert conn.transport.options.keep_completed is True


@pytest.mark.parametrize("keep", [True, False])
def test_acks_in_an_event_loop_delete_their_messages_only_when_asked(
    db_url: str, keep: bool
) -> None:
    """The worker's path: the acks ride on the event loop's next fetch (``ack_delete_fetch``
    on the fetcher's own connection)."""
    queue = Queue("kc_loop", Exchange("kc_loop"), "kc_loop")
    with Connection(_broker(db_url), transport_options={"keep_completed": keep}) as conn:
        _publish(conn, queue, 6)
        received: list[Any] = []
        hub = Hub()
        try:
            channel = conn.channel()
            Consumer(
                channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=3
            ).consume()
            conn.transport.register_with_event_loop(conn.connection, hub)
            _run_loop_until(hub, lambda: len(received) >= 3)
            for message in received[:3]:
                message.ack()
            # The next fetch carries the acks and takes the other three.
            _run_loop_until(hub, lambda: len(received) == 6)
            assert len(received) == 6
            for message in received[3:]:
                message.ack()
            expected = {"completed": 6} if keep else {}
            _run_loop_until(hub, lambda: _counts(db_url) == expected)
        finally:
            conn.transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()
    assert _counts(db_url) == expected


def test_blocking_consumers_acks_delete_their_messages(db_url: str) -> None:
    """kombu's blocking ``drain_events``: acks written with the next fetch, or on their own
    when the channel closes."""
    queue = Queue("kc_blocking", Exchange("kc_blocking"), "kc_blocking")
    with Connection(_broker(db_url), transport_options=OFF) as conn:
        _publish(conn, queue, 5)
        bodies: list[Any] = []

        def take(body: Any, message: Any) -> None:
            bodies.append(body)
            message.ack()

        with Consumer(conn.channel(), [queue], callbacks=[take], prefetch_count=2):
            deadline = time.monotonic() + 10
            while len(bodies) < 5 and time.monotonic() < deadline:
                conn.drain_events(timeout=1)
    assert sorted(b["i"] for b in bodies) == [0, 1, 2, 3, 4]
    assert _counts(db_url) == {}


def test_rejected_and_requeued_messages_are_kept(db_url: str) -> None:
    queue = Queue("kc_reject", Exchange("kc_reject"), "kc_reject")
    with Connection(_broker(db_url), transport_options=OFF) as conn:
        _publish(conn, queue, 3)
        channel = conn.channel()
        messages = []
        while len(messages) < 3:
            message = channel.basic_get(queue.name)
            assert message is not None
            messages.append(message)
        messages[0].ack()
        messages[1].reject(requeue=False)
        messages[2].requeue()
        channel.close()
    assert _counts(db_url) == {"failed": 1, "pending": 1}


def test_an_ack_from_a_consumer_that_lost_the_message_deletes_nothing(db_url: str) -> None:
    store = Store(db_url, keep_completed=False)
    try:
        store.declare_queue("kc_fenced")
        store.publish(NewMessage("kc_fenced", 0, "pending", None, "{}", None, None, None))
        me, other = uuid.uuid4(), uuid.uuid4()
        for who in (me, other):
            store.register_consumer(who, hostname="test", queues=["kc_fenced"], lease=30)
        (row,) = store.fetch(["kc_fenced"], 10, me)
        assert store.ack([row.tag], other) == 0
        assert store.ack([(row.id, row.delivery + 1)], me) == 0
        assert _counts(db_url) == {"running": 1}
        done, rows = store.ack_fetch([row.tag], ["kc_fenced"], 10, me)
        assert (done, rows) == (1, [])
        assert _counts(db_url) == {}
    finally:
        store.close()
