"""Acks survive the failure of the statement that carried them.

A queued ack rides on the consumer's next fetch (``ack_fetch``). When that fetch fails (its
statement cancelled, its connection terminated) the acks it carried are queued again and
written by the next statement; none is lost unreported, which would leave a finished task
``running`` until its lease ran out and then run it again. Each path is tested here: the
event loop's fetch, whose reply arrives later, and the blocking ``drain_events`` fetch. (A
fetch that fails when it is sent, and an ack flush that fails, keep their acks too:
``AckBatcher.writing``, tested in test_ack_batching.py through the background thread.)
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _statuses(db_url: str, queue: str) -> list[str]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT status::text FROM pgskip.jobs WHERE queue = %s ORDER BY id", (queue,)
        )
        return [r[0] for r in rows]


def _publish(conn: Connection, queue: Queue) -> None:
    Producer(conn.channel()).publish(
        {"i": 0}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
    )


@contextmanager
def _jobs_locked(db_url: str) -> Iterator[None]:
    """``jobs`` locked by another session: a fetch sent meanwhile waits for the lock."""
    with psycopg.connect(db_url) as locker:
        locker.execute("LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            locker.rollback()


def _end_backend(db_url: str, pid: int, how: str) -> None:
    """Cancel or terminate backend ``pid`` once it waits for a lock: a cancel that reaches a
    backend before it began the statement is lost."""
    with psycopg.connect(db_url, autocommit=True) as admin:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = admin.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row and row[0] == "Lock":
                break
            time.sleep(0.01)
        admin.execute(f"SELECT pg_{how}_backend(%s)", (pid,))


@pytest.mark.parametrize("how", ["cancel", "terminate"])
def test_acks_of_an_event_loop_fetch_that_fails_are_written_by_the_next_statement(
    db_url: str, how: str
) -> None:
    name = f"ackfail-loop-{how}"
    queue = Queue(name, Exchange(name), name)
    with Connection(_broker(db_url)) as conn:
        _publish(conn, queue)
        received: list[Any] = []
        hub = Hub()
        channel = conn.channel()
        Consumer(
            channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=10
        ).consume()
        transport = conn.transport
        dispatcher = transport.dispatcher
        transport.register_with_event_loop(conn.connection, hub)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (
                received and channel.fetcher is not None and not channel.fetcher.in_flight
            ):
                hub.run_once()
            assert len(received) == 1
            with _jobs_locked(db_url):
                received[0].ack()  # queued, to ride on the next fetch
                dispatcher.loop_drain()
                fetcher = channel.fetcher
                assert fetcher is not None and fetcher.in_flight, "the fetch waits for the lock"
                assert len(channel.acks) == 0, "the ack went with it"
                fd = fetcher.fileno()
                _end_backend(db_url, fetcher._conn.info.backend_pid, how)
                assert select.select([fd], [], [], 10)[0], "the fetch's reply (an error)"
                with pytest.raises(psycopg.Error):
                    dispatcher._on_fetch_readable(channel)
            assert len(channel.acks) == 1, "queued again"
            assert _statuses(db_url, name) == ["running"]
            channel.flush_acks()
            assert _statuses(db_url, name) == ["completed"]
        finally:
            transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()


def test_acks_of_a_blocking_fetch_that_fails_are_written_by_the_next_statement(
    db_url: str,
) -> None:
    name = "ackfail-blocking"
    queue = Queue(name, Exchange(name), name)
    with Connection(_broker(db_url)) as conn:
        _publish(conn, queue)
        received: list[Any] = []
        channel = conn.channel()
        Consumer(
            channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=10
        ).consume()
        conn.drain_events(timeout=5)
        assert len(received) == 1
        fetcher = channel.fetcher
        assert fetcher is not None and fetcher._conn is not None
        pid = fetcher._conn.info.backend_pid
        with _jobs_locked(db_url):
            received[0].ack()
            # The next drain_events sends the ack with a fetch, which waits for the lock
            # until it is cancelled.
            cancel = threading.Timer(0.5, _end_backend, (db_url, pid, "cancel"))
            cancel.start()
            try:
                with pytest.raises(psycopg.Error):
                    conn.drain_events(timeout=5)
            finally:
                cancel.join()
        assert len(channel.acks) == 1, "queued again"
        assert _statuses(db_url, name) == ["running"]
        channel.flush_acks()
        assert _statuses(db_url, name) == ["completed"]


def test_a_close_waits_for_the_background_flush_of_its_acks(db_url: str) -> None:
    """The background thread took the channel's acks and waits for a lock on ``jobs`` when
    the channel closes: the close waits for that flush to end (here it gives up on the lock and
    queues the acks again) and writes them itself before it returns what the consumer still
    holds to the queue. Without the wait, the close would find no ack to write and return the
    acked messages to ``pending``, to run a second time."""
    name = "ackfail-close"
    queue = Queue(name, Exchange(name), name)
    with Connection(_broker(db_url), transport_options={"lease_seconds": 3}) as conn:
        Producer(conn.channel()).publish(
            {"i": 0}, exchange=queue.exchange, routing_key=name, declare=[queue]
        )
        received: list[Any] = []
        channel = conn.channel()
        Consumer(
            channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=10
        ).consume()
        conn.drain_events(timeout=5)
        assert len(received) == 1
        locker = psycopg.connect(db_url)
        try:
            locker.execute("LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE")
            received[0].ack()
            deadline = time.monotonic() + 5
            while len(channel.acks) and time.monotonic() < deadline:
                time.sleep(0.01)  # the background thread's flush takes it, then waits
            assert len(channel.acks) == 0, "taken by the background flush"
            threading.Timer(1.5, locker.rollback).start()  # the close's own flush then runs
            channel.close()
        finally:
            locker.rollback()
            locker.close()
    assert _statuses(db_url, name) == ["completed"]
