"""Acks inside an event loop are batched; fetches and acks commit asynchronously on their own
connection, publishes stay durable."""

from __future__ import annotations

import time

import psycopg
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _statuses(db_url: str) -> list[str]:
    with psycopg.connect(db_url) as conn:
        return [r[0] for r in conn.execute("SELECT status::text FROM pgskip.jobs ORDER BY id")]


def test_consumer_connection_commits_asynchronously_and_publisher_durably(db_url: str) -> None:
    with Connection(_broker(db_url)) as conn:
        conn.connect()
        transport = conn.transport
        assert transport.store.conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        consumer_conn = transport.consumer_store.conn
        assert consumer_conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        assert consumer_conn is not transport.store.conn


def test_synchronous_acks_option_keeps_every_commit_durable(db_url: str) -> None:
    with Connection(_broker(db_url), transport_options={"synchronous_acks": True}) as conn:
        conn.connect()
        store = conn.transport.consumer_store
        assert store.conn.execute("SHOW synchronous_commit").fetchone() == ("on",)


def test_acks_on_an_event_loop_are_written_together_on_the_next_turn(db_url: str) -> None:
    queue = Queue("batched", Exchange("batched"), "batched")
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        for i in range(5):
            producer.publish(
                {"i": i}, exchange=queue.exchange, routing_key="batched", declare=[queue]
            )
        received: list[object] = []
        hub = Hub()
        try:
            channel = conn.channel()
            consumer = Consumer(
                channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=10
            )
            consumer.consume()
            conn.transport.register_with_event_loop(conn.connection, hub)
            deadline = time.monotonic() + 10
            while len(received) < 5 and time.monotonic() < deadline:
                hub.run_once()
            assert len(received) == 5
            for message in received:
                message.ack()  # type: ignore[attr-defined]
            assert _statuses(db_url) == ["running"] * 5, "acks wait for the loop's next turn"
            deadline = time.monotonic() + 10
            while _statuses(db_url) != ["completed"] * 5 and time.monotonic() < deadline:
                hub.run_once()
            assert _statuses(db_url) == ["completed"] * 5
        finally:
            conn.transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()


def test_pending_acks_are_written_when_the_channel_closes(db_url: str) -> None:
    queue = Queue("closing", Exchange("closing"), "closing")
    with Connection(_broker(db_url)) as conn:
        Producer(conn.channel()).publish(
            {"x": 1}, exchange=queue.exchange, routing_key="closing", declare=[queue]
        )
        hub = Hub()
        received: list[object] = []
        channel = conn.channel()
        Consumer(channel, [queue], callbacks=[lambda body, m: received.append(m)]).consume()
        conn.transport.register_with_event_loop(conn.connection, hub)
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            hub.run_once()
        received[0].ack()  # type: ignore[attr-defined]
        conn.transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
        channel.close()
    assert _statuses(db_url) == ["completed"]
