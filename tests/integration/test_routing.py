"""Exchanges, bindings and queue expiry shared by every process, through kombu's own API.

Each kombu ``Connection`` has a transport of its own with its own in-memory ``BrokerState``, as
two processes would: what one connection declares or binds, the other knows only through the
database.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

import kombu_pgskip  # noqa: F401  (registers pgskip://)
from kombu_pgskip.transport import Transport


def _jobs(db_url: str) -> list[tuple[str, str]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT queue, status::text FROM pgskip.jobs ORDER BY queue, id")
        return [(r[0], r[1]) for r in rows]


def _queues(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM pgskip.queues")}


def _drain(conn: Connection, queue: Queue, n: int, *, no_ack: bool = True) -> list[Any]:
    got: list[Any] = []
    with Consumer(conn, [queue], no_ack=no_ack, accept=["json"]) as consumer:
        consumer.register_callback(lambda body, message: got.append((body, message)))
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
    return got


def test_the_transport_says_it_supports_fanout() -> None:
    assert "fanout" in Transport.implements.exchange_type


def test_fanout_from_another_process_writes_one_row_per_bound_queue(
    connections: Any, db_url: str
) -> None:
    workers = connections()
    caller = connections()
    bus = Exchange("bus", type="fanout", durable=False)
    for name in ("w1.bus", "w2.bus"):
        Queue(name, bus, auto_delete=True, expires=30).bind(workers.default_channel).declare()
    Producer(caller.default_channel).publish({"hello": 1}, exchange=bus, declare=[bus])
    assert _jobs(db_url) == [("w1.bus", "pending"), ("w2.bus", "pending")]
    assert caller.default_channel._lookup("bus", "") == ["w1.bus", "w2.bus"]


def test_topic_routing_uses_the_bindings_of_other_processes(connections: Any, db_url: str) -> None:
    receiver = connections()
    sender = connections()
    events = Exchange("ev", type="topic", durable=False)
    Queue("all", events, routing_key="#").bind(receiver.default_channel).declare()
    Queue("workers", events, routing_key="worker.#").bind(receiver.default_channel).declare()
    Queue("one", events, routing_key="task.*").bind(receiver.default_channel).declare()
    producer = Producer(sender.default_channel, exchange=events)
    producer.publish({"e": 1}, routing_key="worker.heartbeat", declare=[events])
    producer.publish({"e": 2}, routing_key="task.succeeded")
    producer.publish({"e": 3}, routing_key="task.multi.x")
    assert sorted(_jobs(db_url)) == sorted(
        [("all", "pending")] * 3 + [("workers", "pending"), ("one", "pending")]
    )


def test_reply_reaches_a_queue_only_the_caller_declared(connections: Any, db_url: str) -> None:
    caller = connections()
    worker = connections()
    replies = Exchange("reply.x", type="direct", durable=False)
    reply_queue = Queue("oid1.reply.x", replies, routing_key="oid1", auto_delete=True)
    reply_queue.bind(caller.default_channel).declare()
    # The worker never declared the queue nor bound it: routing must find it in the database.
    Producer(worker.default_channel).publish(
        {"pong": True}, exchange=replies, routing_key="oid1", declare=[replies]
    )
    Producer(worker.default_channel).publish(
        {"lost": True}, exchange=replies, routing_key="nobody", declare=[replies]
    )
    got = _drain(caller, reply_queue, 1)
    assert [body for body, _ in got] == [{"pong": True}]
    assert _jobs(db_url) == []  # no-ack consumption deleted the row; nothing was unroutable


def test_no_ack_consumption_deletes_rows_and_acked_consumption_completes_them(
    connections: Any, db_url: str
) -> None:
    conn = connections()
    fast = Queue("noack", Exchange("noack"), routing_key="noack")
    slow = Queue("acked", Exchange("acked"), routing_key="acked")
    producer = Producer(conn.default_channel)
    for q in (fast, slow):
        producer.publish({"q": q.name}, exchange=q.exchange, routing_key=q.routing_key, declare=[q])
    assert len(_drain(conn, fast, 1, no_ack=True)) == 1
    ((_, message),) = _drain(conn, slow, 1, no_ack=False)
    message.ack()
    assert _jobs(db_url) == [("acked", "completed")]


def test_a_queue_unused_for_its_x_expires_gets_no_broadcast_and_is_swept(
    connections: Any, db_url: str
) -> None:
    worker = connections()
    caller = connections()
    box = Exchange("box", type="fanout", durable=False)
    Queue("alive.box", box, expires=60).bind(worker.default_channel).declare()
    Queue("dead.box", box, expires=0.2).bind(worker.default_channel).declare()
    Queue("dead.box2", box, expires=0.2).bind(worker.default_channel).declare()
    producer = Producer(caller.default_channel)
    producer.publish({"n": 1}, exchange=box, declare=[box])
    assert [q for q, _ in _jobs(db_url)] == ["alive.box", "dead.box", "dead.box2"]
    time.sleep(0.4)  # nobody consumes the dead queues: their x-expires runs out
    producer.publish({"n": 2}, exchange=box)
    assert [q for q, _ in _jobs(db_url)] == ["alive.box", "alive.box", "dead.box", "dead.box2"]
    assert not worker.default_channel._has_queue("dead.box")
    queues, messages = worker.default_channel.store.expire_queues()
    assert (queues, messages) == (2, 2)
    assert _queues(db_url) == {"alive.box"}
    with psycopg.connect(db_url) as conn:
        bound = conn.execute("SELECT queue FROM pgskip.bindings WHERE exchange = 'box'").fetchall()
    assert bound == [("alive.box",)]


def test_a_consumed_queue_does_not_expire_while_its_consumer_lives(
    connections: Any, db_url: str
) -> None:
    conn = connections()
    box = Exchange("live", type="fanout", durable=False)
    queue = Queue("consumed.live", box, expires=0.2)
    with Consumer(conn, [queue], no_ack=True, accept=["json"]):
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)  # registers the consumer (its lease)
        time.sleep(0.4)
        assert conn.default_channel._has_queue("consumed.live")
        assert conn.default_channel.store.expire_queues() == (0, 0)
        Producer(conn.default_channel).publish({"x": 1}, exchange=box, declare=[box])
        assert _jobs(db_url) == [("consumed.live", "pending")]


def test_auto_delete_queue_goes_when_its_last_consumer_cancels(
    connections: Any, db_url: str
) -> None:
    conn = connections()
    ex = Exchange("ad", type="fanout", durable=False)
    queue = Queue("ad.q", ex, auto_delete=True)
    consumer = Consumer(conn, [queue], no_ack=True, accept=["json"])
    consumer.consume()
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.3)
    assert "ad.q" in _queues(db_url)
    consumer.cancel()
    assert "ad.q" not in _queues(db_url)
    Producer(conn.default_channel).publish({"x": 1}, exchange=ex, declare=[ex])
    assert _jobs(db_url) == []


def test_auto_delete_queue_stays_while_another_consumer_consumes_it(
    connections: Any, db_url: str
) -> None:
    first, second = connections(), connections()
    ex = Exchange("ad2", type="fanout", durable=False)
    queue = Queue("ad2.q", ex, auto_delete=True)
    consumers = [Consumer(c, [queue], no_ack=True, accept=["json"]) for c in (first, second)]
    for c, consumer in zip((first, second), consumers, strict=True):
        consumer.consume()
        with pytest.raises(TimeoutError):
            c.drain_events(timeout=0.3)
    consumers[0].cancel()
    assert "ad2.q" in _queues(db_url)
    consumers[1].cancel()
    assert "ad2.q" not in _queues(db_url)


def test_message_ttl_of_a_queue_and_of_a_message(connections: Any, db_url: str) -> None:
    conn = connections()
    ex = Exchange("ttl", type="direct")
    queue = Queue("ttl.q", ex, routing_key="k", message_ttl=0.2)
    other = Queue("ttl.r", ex, routing_key="r")
    producer = Producer(conn.default_channel, exchange=ex)
    producer.publish({"a": 1}, routing_key="k", declare=[queue, other])
    producer.publish({"b": 1}, routing_key="r", expiration=0.2)
    producer.publish({"c": 1}, routing_key="r")
    time.sleep(0.4)
    assert _drain(conn, queue, 1) == []
    assert [body for body, _ in _drain(conn, other, 1)] == [{"c": 1}]


def test_exchange_delete_and_queue_unbind_stop_routing(connections: Any, db_url: str) -> None:
    a = connections()
    b = connections()
    ex = Exchange("gone", type="fanout", durable=False)
    q1 = Queue("gone.1", ex).bind(a.default_channel)
    q2 = Queue("gone.2", ex).bind(a.default_channel)
    q1.declare()
    q2.declare()
    q2.unbind_from(ex)
    Producer(b.default_channel).publish({"x": 1}, exchange=ex, declare=[ex])
    assert [q for q, _ in _jobs(db_url)] == ["gone.1"]
    ex.bind(a.default_channel).delete()
    assert b.default_channel.store.exchange_type("gone") is None
    assert b.default_channel.store.route("gone", "") == []


def test_passive_exchange_declare_finds_exchanges_of_other_processes(connections: Any) -> None:
    a = connections()
    b = connections()
    Exchange("shared", type="topic").bind(a.default_channel).declare()
    Exchange("shared", type="topic").bind(b.default_channel).declare(passive=True)
    assert b.default_channel.typeof("shared").type == "topic"
    with pytest.raises(Exception, match="NOT_FOUND"):
        Exchange("missing", type="topic").bind(b.default_channel).declare(passive=True)
