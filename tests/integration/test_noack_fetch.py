"""On an event loop, the no-ack queues (Celery's remote control and events) are fetched when a
message may wait in them, not with every task fetch; a control message committed before a task
is still delivered before it."""

from __future__ import annotations

import contextlib
import re
import select
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from tests.helpers import seq_scanned_rows

TASKS = Queue("tasks", Exchange("tasks"), "tasks")
CONTROL = Queue("control", Exchange("control"), "control")


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _publish(conn: Connection, queue: Queue, i: int) -> None:
    Producer(conn.channel()).publish(
        {"i": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
    )


def _run_until(hub: Hub, done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        hub.run_once()


def _consume(control_channel: Any, task_channel: Any) -> list[tuple[str, int]]:
    """Consumers of CONTROL without acks (as remote control) and of TASKS (each acked on
    arrival, prefetch 10) on the channels given; what they deliver, in order."""
    delivered: list[tuple[str, int]] = []

    def on_task(body: Any, message: Any) -> None:
        delivered.append(("task", body["i"]))
        message.ack()

    Consumer(
        control_channel,
        [CONTROL],
        callbacks=[lambda body, m: delivered.append(("control", body["i"]))],
        no_ack=True,
    ).consume()
    Consumer(task_channel, [TASKS], callbacks=[on_task], prefetch_count=10).consume()
    return delivered


@pytest.fixture
def noack_fetches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The queues of every no-ack fetch statement run (the real statement runs)."""
    from kombu_pgskip.store import Store

    fetches: list[list[str]] = []
    real_fetch = Store.fetch

    def recorded(self: Store, queues: Any, limit: int, consumer: Any, **kw: Any) -> Any:
        if kw.get("no_ack"):
            fetches.append(list(queues))
        return real_fetch(self, queues, limit, consumer, **kw)

    monkeypatch.setattr(Store, "fetch", recorded)
    return fetches


@contextlib.contextmanager
def _worker_like(db_url: str) -> Iterator[tuple[Connection, Any, list[tuple[str, int]], Hub]]:
    """A connection consuming CONTROL without acks (as remote control) on one channel and
    TASKS (acked on arrival) on another, registered with a kombu Hub and settled: (the
    connection, the task channel, what was delivered in order, the hub)."""
    options = {"polling_interval": 30}
    with Connection(_broker(db_url), transport_options=options) as conn:
        _publish(conn, CONTROL, -1)  # declares both queues; the first drain takes these
        _publish(conn, TASKS, -1)
        hub = Hub()
        try:
            tasks = conn.channel()
            delivered = _consume(conn.channel(), tasks)
            conn.transport.register_with_event_loop(conn.connection, hub)
            _run_until(hub, lambda: len(delivered) == 2)
            assert sorted(delivered) == [("control", -1), ("task", -1)]
            _run_until(hub, lambda: False, timeout=0.3)  # settled: nothing in flight
            yield conn, tasks, delivered, hub
        finally:
            conn.transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()


def test_task_fetches_on_an_event_loop_leave_the_no_ack_queues_alone(
    db_url: str, noack_fetches: list[list[str]]
) -> None:
    """A stream of tasks costs no fetch of the control queue; a control message is fetched on
    its notification."""
    with (
        _worker_like(db_url) as (_conn, _tasks, delivered, hub),
        Connection(_broker(db_url)) as other,
    ):
        before = len(noack_fetches)
        for i in range(20):
            _publish(other, TASKS, i)
            _run_until(hub, lambda i=i: ("task", i) in delivered)
        assert [i for kind, i in delivered if kind == "task"] == list(range(-1, 20))
        # The last task's ack is written by a fetch ACK_FLUSH_DELAY later, whose probe of the
        # no-ack queues would find a control message published meanwhile: let it go first.
        _run_until(hub, lambda: False, timeout=0.3)
        assert noack_fetches[before:] == [], "the control queue was not fetched for tasks"
        _publish(other, CONTROL, 0)
        _run_until(hub, lambda: ("control", 0) in delivered)
        assert ("control", 0) in delivered
        assert noack_fetches[before:] == [["control"]]


def test_a_control_message_committed_before_a_task_is_delivered_before_it(
    db_url: str, noack_fetches: list[list[str]]
) -> None:
    """The task fetch sees, in its own snapshot, that a control message waits: the control
    queue is fetched and delivered before the fetched tasks, even when the loop has not read
    the control message's notification yet (a revoke, then at once the task it names)."""
    with (
        _worker_like(db_url) as (conn, tasks, delivered, _hub),
        Connection(_broker(db_url)) as other,
    ):
        transport = conn.transport
        delivered.clear()
        before = len(noack_fetches)
        _publish(other, CONTROL, 1)
        _publish(other, TASKS, 1)
        # The task fetch, before any notification is read.
        transport.dispatcher.loop_drain({"tasks"})
        fetcher = tasks.fetcher
        assert fetcher is not None and fetcher.in_flight
        assert noack_fetches[before:] == [], "the drain itself left the control queue alone"
        deadline = time.monotonic() + 10
        while fetcher.in_flight and time.monotonic() < deadline:
            select.select([fetcher.fileno()], [], [], 1.0)
            transport.dispatcher._on_fetch_readable(tasks)
        assert fetcher.urgent, "the task fetch saw the control message waiting"
        assert delivered == [("control", 1), ("task", 1)]
        assert noack_fetches[before:] == [["control"]]


def test_outside_an_event_loop_each_fetch_takes_the_no_ack_queues_first(
    db_url: str, noack_fetches: list[list[str]]
) -> None:
    """kombu's blocking ``drain_events`` has no task fetch that would say a control message
    waits: each of its fetches takes the no-ack queues first, as before."""
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        Connection(_broker(db_url)) as other,
    ):
        _publish(other, CONTROL, -1)
        _publish(other, TASKS, -1)
        delivered = _consume(conn.channel(), conn.channel())
        for i in range(-1, 3):
            before = len(noack_fetches)
            if i >= 0:
                _publish(other, CONTROL, i)
                _publish(other, TASKS, i)
            deadline = time.monotonic() + 10
            while ("task", i) not in delivered and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1.0)
            assert len(noack_fetches) > before
            assert delivered[-2:] == [("control", i), ("task", i)]
        assert delivered == [
            ("control", -1),
            ("task", -1),
            ("control", 0),
            ("task", 0),
            ("control", 1),
            ("task", 1),
            ("control", 2),
            ("task", 2),
        ]


def test_the_task_fetch_looks_into_the_no_ack_queues_by_index(db_url: str) -> None:
    """The look into the no-ack queues rides with every task fetch, so its generic plan must
    probe the dequeue index, not scan the table (which it did while it estimated that most rows
    match: about 2 ms per fetch with 20,000 rows waiting)."""
    import uuid

    import psycopg

    from kombu_pgskip.fetcher import AsyncFetcher
    from kombu_pgskip.store import NewMessage, Store

    store = Store(db_url)
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    try:
        store.publish_many([NewMessage("tasks", 0, "pending", None, "{}", None, None, None)] * 5000)
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("ANALYZE pgskip.jobs")
        me = uuid.uuid4()
        fetcher.send([], ["tasks"], 1, me, ["control"])
        result = fetcher.wait()
        assert result is not None and len(result[1]) == 1
        assert not fetcher.urgent
        store.publish(NewMessage("control", 0, "pending", None, "{}", None, None, None))
        fetcher.send([], ["tasks"], 1, me, ["control"])
        assert fetcher.wait() is not None
        assert fetcher.urgent
        values = {
            "ids": "'{}'",
            "deliveries": "'{}'",
            "consumer": f"'{me}'",
            "queues": "'{tasks}'",
            "limit": "100",
            "max_bytes": "16777216",
            "urgent": "'{control,events}'",
            "after_priority": "'{32767}'",
            "after_run_at": "'{-infinity}'",
            "after_id": "'{0}'",
        }
        args = ", ".join(values[name] for name in fetcher._order)
        assert fetcher._conn is not None
        plan = "\n".join(
            row[0] for row in fetcher._conn.execute(f"EXPLAIN EXECUTE pgskip_ack_fetch({args})")
        )
        with psycopg.connect(db_url, autocommit=True) as conn:
            assert not seq_scanned_rows(conn, plan), plan
        assert re.search(r"Index Scan using jobs_dequeue_1 on jobs_1 u", plan), plan
    finally:
        fetcher.close()
        store.close()


def test_a_channel_consuming_both_ways_fetches_its_no_ack_queues_every_time(
    db_url: str, noack_fetches: list[list[str]]
) -> None:
    """A channel with no-ack and acked consumers has no fetcher of its own to say that a
    no-ack queue has a message waiting: each of its fetches takes both, no-ack first."""
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        Connection(_broker(db_url)) as other,
    ):
        _publish(other, CONTROL, -1)
        _publish(other, TASKS, -1)
        channel = conn.channel()
        delivered = _consume(channel, channel)
        hub = Hub()
        try:
            conn.transport.register_with_event_loop(conn.connection, hub)
            _run_until(hub, lambda: len(delivered) == 2)
            assert delivered == [("control", -1), ("task", -1)]
            _run_until(hub, lambda: False, timeout=0.3)
            before = len(noack_fetches)
            _publish(other, CONTROL, 0)
            _publish(other, TASKS, 0)
            conn.transport.dispatcher.loop_drain({"tasks"})  # before any notification is read
            assert delivered[2:] == [("control", 0), ("task", 0)]
            assert noack_fetches[before:] == [["control"]]
        finally:
            conn.transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()
