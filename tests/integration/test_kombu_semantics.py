"""kombu-level behaviour Celery relies on, through kombu's own Producer and Consumer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue

import kombu_pgskip  # noqa: F401  (registers pgskip://)


@pytest.fixture
def conn(db_url: str) -> Iterator[Connection]:
    c = Connection(db_url.replace("postgresql://", "pgskip://", 1))
    c.connect()
    yield c
    c.release()


def take(
    conn: Connection, queue: Queue, n: int, *, accept: list[str] | None = None, wait: float = 10
) -> list[Any]:
    """Consume ``n`` messages (acks left to the caller), waiting at most ``wait`` seconds."""
    got: list[Any] = []
    consumer = Consumer(conn, [queue], accept=accept or ["json"], prefetch_count=n)
    consumer.register_callback(lambda body, message: got.append(message))
    with consumer:
        deadline = time.monotonic() + wait
        while len(got) < n and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
    return got


def test_redelivered_is_false_first_and_true_after_a_requeue(conn: Connection) -> None:
    q = Queue("redeliver", Exchange("redeliver"), routing_key="redeliver")
    Producer(conn).publish({"n": 1}, exchange=q.exchange, routing_key="redeliver", declare=[q])
    (first,) = take(conn, q, 1)
    assert first.delivery_info["redelivered"] is False
    first.requeue()
    (second,) = take(conn, q, 1)
    assert second.delivery_info["redelivered"] is True
    assert second.payload == {"n": 1}
    second.ack()


def test_publish_options_and_custom_properties_arrive_unchanged(conn: Connection) -> None:
    q = Queue("props", Exchange("props", type="topic"), routing_key="a.*")
    Producer(conn).publish(
        {"text": "é" * 100},
        exchange=q.exchange,
        routing_key="a.b",
        declare=[q],
        serializer="pickle",
        compression="zlib",
        headers={"x-custom": "h", "n": 3},
        priority=7,
        correlation_id="corr-1",
        reply_to="reply-q",
        app_id="my-app",
        message_id="mid-1",
        type="kind",
        delivery_mode=1,
    )
    (message,) = take(conn, q, 1, accept=["pickle"])
    assert message.payload == {"text": "é" * 100}
    assert message.content_type == "application/x-python-serialize"
    assert message.headers["x-custom"] == "h" and message.headers["n"] == 3
    assert message.headers["compression"] == "application/x-gzip"
    props = message.properties
    assert props["priority"] == 7
    assert props["correlation_id"] == "corr-1" and props["reply_to"] == "reply-q"
    assert props["app_id"] == "my-app" and props["message_id"] == "mid-1"
    assert props["type"] == "kind" and props["delivery_mode"] == 1
    assert message.delivery_info["exchange"] == "props"
    assert message.delivery_info["routing_key"] == "a.b"
    message.ack()


def test_a_custom_property_that_is_not_json_is_dropped_not_fatal(conn: Connection) -> None:
    # As an AMQP broker drops properties it does not know; Celery's own suite passes a
    # signal object along this way.
    q = Queue("odd", Exchange("odd"), routing_key="odd")
    Producer(conn).publish(
        {"n": 1}, exchange=q.exchange, routing_key="odd", declare=[q], odd=object(), fine="yes"
    )
    (message,) = take(conn, q, 1)
    assert message.payload == {"n": 1}
    assert message.properties["fine"] == "yes" and "odd" not in message.properties
    message.ack()


def test_priority_orders_delivery_highest_first(conn: Connection) -> None:
    q = Queue("prio", Exchange("prio"), routing_key="prio")
    producer = Producer(conn)
    for p in (0, 9, 3, 9, 5):
        producer.publish({"p": p}, exchange=q.exchange, routing_key="prio", priority=p, declare=[q])
    got = take(conn, q, 5)
    assert [m.payload["p"] for m in got] == [9, 9, 5, 3, 0]
    for m in got:
        m.ack()


def test_expiration_drops_a_plain_message_after_its_ttl(conn: Connection) -> None:
    q = Queue("exp", Exchange("exp"), routing_key="exp")
    producer = Producer(conn)
    producer.publish({"gone": 1}, exchange=q.exchange, routing_key="exp", expiration=0.2,
                     declare=[q])  # fmt: skip
    producer.publish({"kept": 1}, exchange=q.exchange, routing_key="exp", expiration=60)
    time.sleep(0.4)
    got = take(conn, q, 2, wait=1.5)
    assert [m.payload for m in got] == [{"kept": 1}]
    got[0].ack()


def test_an_expired_celery_task_is_still_delivered_so_the_worker_can_revoke_it(
    db_url: str, conn: Connection
) -> None:
    app = Celery("expiring", broker=conn.as_uri(include_password=True), set_as_current=False)
    app.conf.task_default_queue = "expiring"
    result = app.send_task("some.task", args=(1,), expires=0.2)
    app.close()
    time.sleep(0.5)
    (message,) = take(conn, Queue("expiring"), 1)
    assert message.headers["id"] == result.id
    assert message.headers["expires"] is not None  # the worker compares it and revokes
    message.ack()


def test_ack_after_the_channel_closed_is_logged_and_the_message_comes_back(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    # A task that outlives its connection (PostgreSQL restarted meanwhile) is acked through a
    # closed channel: Celery stops the worker on any exception other than a connection error.
    q = Queue("late-ack", Exchange("late-ack"), routing_key="late-ack")
    Producer(conn).publish({"n": 1}, exchange=q.exchange, routing_key="late-ack", declare=[q])
    channel = conn.channel()
    message = channel.basic_get("late-ack")
    assert message is not None
    channel.close()
    message.ack()
    assert "after its channel closed" in caplog.text
    (again,) = take(conn, q, 1)
    assert again.delivery_info["redelivered"] is True
    again.ack()
