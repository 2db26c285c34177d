"""Acks inside an event loop are batched; fetches and acks commit asynchronously on their own
connection, publishes stay durable."""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from tests.helpers import seq_scanned_rows


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _statuses(db_url: str) -> list[str]:
    with psycopg.connect(db_url) as conn:
        return [r[0] for r in conn.execute("SELECT status::text FROM pgskip.jobs ORDER BY id")]


def _stop_heartbeat(conn: Connection) -> None:
    """Stop the heartbeat thread, which writes acks left waiting at each beat (and beats as
    soon as a consumer registers): from here on only the consumer's own statements write."""
    background = conn.transport._background
    assert background is not None
    background.stop()
    background.join(10)
    assert not background.is_alive()


def test_consumer_connection_commits_asynchronously_and_publisher_durably(db_url: str) -> None:
    with Connection(_broker(db_url)) as conn:
        conn.connect()
        transport = conn.transport
        assert transport.store.conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        consumer_conn = transport.consumer_store.conn
        assert consumer_conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        assert consumer_conn is not transport.store.conn


def test_durable_publish_false_is_an_opt_in_asynchronous_publisher(db_url: str) -> None:
    with Connection(_broker(db_url), transport_options={"durable_publish": False}) as conn:
        conn.connect()
        store = conn.transport.store
        assert store.conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
    with Connection(_broker(db_url), transport_options={"durable_publish": "false"}) as conn:
        conn.connect()
        assert conn.transport.options.durable_publish is False


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
            _stop_heartbeat(conn)
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


def _publish(conn: Connection, queue: Queue, n: int) -> None:
    producer = Producer(conn.channel())
    for i in range(n):
        producer.publish(
            {"i": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
        )


def _consuming(
    conn: Connection, queue: Queue, prefetch_count: int, *, ack: bool = False
) -> tuple[Any, list[Any]]:
    """A consumer of ``queue`` on a new channel, outside any event loop: (the channel, the
    messages received; with ``ack``, their bodies, each message acked on arrival)."""
    received: list[Any] = []

    def take(body: Any, message: Any) -> None:
        if ack:
            received.append(body)
            message.ack()
        else:
            received.append(message)

    channel = conn.channel()
    Consumer(channel, [queue], callbacks=[take], prefetch_count=prefetch_count).consume()
    return channel, received


@contextlib.contextmanager
def _listening(
    db_url: str, queue: Queue, options: dict[str, Any]
) -> Iterator[tuple[Connection, Connection, list[Any]]]:
    """A blocking consumer of ``queue`` (prefetch 10, each body acked on arrival) whose LISTEN
    is open and whose queue was found empty, its heartbeat thread stopped (only the consumer's
    own statements write); a second connection to publish from; the bodies received."""
    with (
        Connection(_broker(db_url), transport_options=options) as conn,
        Connection(_broker(db_url)) as other,
    ):
        _publish(other, queue, 0)
        _channel, received = _consuming(conn, queue, 10, ack=True)
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
        _stop_heartbeat(conn)
        yield conn, other, received


def _announced_while_waiting(
    conn: Connection, other: Connection, queue: Queue, after: float
) -> float:
    """One message published from ``other`` ``after`` seconds into a ``drain_events`` call of
    ``conn``, which delivers it; returns when the call began."""
    publisher = threading.Timer(after, _publish, (other, queue, 1))
    publisher.start()
    started = time.monotonic()
    conn.drain_events(timeout=5)
    publisher.join()
    return started


def test_blocking_consumer_acks_ride_along_with_the_next_fetch(db_url: str) -> None:
    queue = Queue("blocking", Exchange("blocking"), "blocking")
    with Connection(_broker(db_url)) as conn:
        _publish(conn, queue, 3)
        _channel, received = _consuming(conn, queue, 2)
        conn.drain_events(timeout=5)
        assert len(received) == 2
        _stop_heartbeat(conn)
        for message in received:
            message.ack()  # type: ignore[attr-defined]
        assert _statuses(db_url) == ["running", "running", "pending"], "acks wait"
        conn.drain_events(timeout=5)  # one statement: the two acks, and the third message
        assert len(received) == 3
        assert _statuses(db_url) == ["completed", "completed", "running"]
        received[2].ack()  # type: ignore[attr-defined]
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)  # nothing left: the ack is written within 5 ms
        assert _statuses(db_url) == ["completed"] * 3


def test_a_blocking_consumer_in_a_stream_fetches_once_per_notification_with_the_acks(
    db_url: str, monkeypatch: pytest.MonkeyPatch, fetch_sends: list[tuple[float, int]]
) -> None:
    """Once a fetch drained the queue, the next ``drain_events`` waits for a notification
    instead of fetching at once; the acks of the batch just delivered ride along with the
    notification's fetch: a message at a time costs one statement, not two."""
    from kombu_pgskip import policy as policy_module

    monkeypatch.setattr(policy_module, "ACK_FLUSH_DELAY", 1.0)  # longer than the gaps
    queue = Queue("stream", Exchange("stream"), "stream")
    options = {"polling_interval": 30, "fetch_cooldown": 0}
    with _listening(db_url, queue, options) as (conn, other, received):
        _stop_heartbeat(conn)
        fetch_sends.clear()
        for i in range(10):
            _announced_while_waiting(conn, other, queue, 0.1)
            assert len(received) == i + 1
        assert [acks for _, acks in fetch_sends] == [0] + [1] * 9, "one fetch per message"
        assert _statuses(db_url) == ["completed"] * 9 + ["running"]


def test_a_blocking_consumer_writes_its_acks_within_the_flush_delay_when_nothing_arrives(
    db_url: str, fetch_sends: list[tuple[float, int]]
) -> None:
    """With nothing announced, the acks of the last batch wait ``ACK_FLUSH_DELAY`` for a
    notification's fetch to carry them, then go with a fetch of their own."""
    from kombu_pgskip.policy import ACK_FLUSH_DELAY

    queue = Queue("quiet", Exchange("quiet"), "quiet")
    with Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn:
        _channel, received = _consuming(conn, queue, 10, ack=True)
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)  # LISTEN opened, the queue found empty
        _stop_heartbeat(conn)
        _publish(conn, queue, 1)
        conn.drain_events(timeout=5)
        assert len(received) == 1
        assert _statuses(db_url) == ["running"]
        sent = len(fetch_sends)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=1.0)
        assert time.monotonic() - started >= 0.95
        assert _statuses(db_url) == ["completed"]
        assert len(fetch_sends) == sent + 1, "one fetch, for the ack, in a second"
        at, acks = fetch_sends[-1]
        assert acks == 1 and ACK_FLUSH_DELAY <= at - started < 0.5


def test_a_blocking_consumer_stops_holding_acks_back_while_messages_come_seldom(
    db_url: str, monkeypatch: pytest.MonkeyPatch, fetch_sends: list[tuple[float, int]]
) -> None:
    """Holding the acks back for ``ACK_FLUSH_DELAY`` pays only if a notification comes
    meanwhile. Once one did not, the next calls send them at once with a fetch (no wake-up
    spent on a timer); once one comes within the delay again, they wait to ride along."""
    from kombu_pgskip import policy as policy_module

    monkeypatch.setattr(policy_module, "ACK_FLUSH_DELAY", 0.05)
    queue = Queue("seldom", Exchange("seldom"), "seldom")
    options = {"polling_interval": 30, "fetch_cooldown": 0}
    with _listening(db_url, queue, options) as (conn, other, received):

        def step(after: float) -> tuple[float, list[tuple[float, int]]]:
            sent = len(fetch_sends)
            started = _announced_while_waiting(conn, other, queue, after)
            return started, fetch_sends[sent:]

        step(0.3)  # the first message: no acks yet
        started, sends = step(0.3)
        assert [acks for _, acks in sends] == [1, 0]
        assert sends[0][0] - started >= 0.05, "held back for the delay, then sent alone"
        for _ in range(3):
            started, sends = step(0.3)
            assert [acks for _, acks in sends] == [1, 0]
            assert sends[0][0] - started < 0.05, "sent at once: waiting has not paid lately"
        started, sends = step(0.01)  # a notification within the delay: waiting pays again
        assert [acks for _, acks in sends] == [1, 0]
        for _ in range(3):
            started, sends = step(0.01)
            assert [acks for _, acks in sends] == [1], "the ack rides with the message's fetch"
        assert len(received) == 9


def test_a_drained_blocking_consumer_still_polls_for_messages_nothing_announced(
    db_url: str,
) -> None:
    """A message that arrives without a notification (written by SQL of one's own here) is
    fetched by the poll, ``polling_interval`` after the last fetch, across calls."""
    queue = Queue("unannounced", Exchange("unannounced"), "unannounced")
    with Connection(_broker(db_url), transport_options={"polling_interval": 0.5}) as conn:
        _channel, received = _consuming(conn, queue, 10)
        _publish(conn, queue, 1)
        conn.drain_events(timeout=5)
        assert len(received) == 1
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute(
                "INSERT INTO pgskip.jobs (queue, payload)"
                " SELECT queue, payload FROM pgskip.jobs LIMIT 1"
            )
        started = time.monotonic()
        while len(received) < 2 and time.monotonic() - started < 5:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.1)  # shorter than the poll: calls come and go
        assert len(received) == 2
        assert time.monotonic() - started < 1.5


def test_a_notification_read_by_a_call_that_times_out_is_fetched_by_the_next(
    db_url: str,
) -> None:
    """``drain_events(timeout=0)`` within the cooldown reads the notification but may not
    fetch yet; the fetch is owed, and the next call sends it at once instead of waiting for
    the poll."""
    queue = Queue("owed", Exchange("owed"), "owed")
    options = {"polling_interval": 30, "fetch_cooldown": 0.5, "fetch_cooldown_max": 0.5}
    with (
        Connection(_broker(db_url), transport_options=options) as conn,
        Connection(_broker(db_url)) as other,
    ):
        _publish(other, queue, 0)
        _channel, received = _consuming(conn, queue, 10)
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.7)  # LISTEN opened, the queue found empty
        listener = conn.transport.dispatcher.poller.listener
        assert listener is not None
        _publish(other, queue, 1)
        conn.drain_events(timeout=5)  # a fetch just now: the next waits 0.5 s
        assert len(received) == 1
        _publish(other, queue, 1)
        select.select([listener.pgconn.socket], [], [], 5)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0)
        assert len(received) == 1
        started = time.monotonic()
        conn.drain_events(timeout=5)
        assert len(received) == 2
        assert time.monotonic() - started < 0.3, "at once: neither the poll nor the cooldown"


def test_a_blocking_consumer_fetches_on_a_connection_of_its_own_with_the_generic_plan(
    db_url: str,
) -> None:
    """Outside an event loop (kombu's blocking ``drain_events``, ``ConsumerMixin``) the fetch
    runs as in Celery's worker: ``ack_fetch`` prepared once on the channel's fetch connection
    and its generic plan reused, not planned afresh for every batch. With
    ``async_fetch=False`` the consumer connection fetches, as before."""
    queue = Queue("blockingown", Exchange("blockingown"), "blockingown")
    for options, own in (({}, True), ({"async_fetch": False}, False)):
        with Connection(_broker(db_url), transport_options=options) as conn:
            _publish(conn, queue, 8)
            channel, received = _consuming(conn, queue, 1, ack=True)
            while len(received) < 8:
                conn.drain_events(timeout=5)
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)  # writes the last ack
            assert [b["i"] for b in received] == list(range(8))
            assert _statuses(db_url) == ["completed"] * 8
            fetcher = channel.fetcher
            if not own:
                assert fetcher is None
                continue
            assert fetcher is not None and fetcher._conn is not None
            row = fetcher._conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE name = 'pgskip_ack_fetch'"
            ).fetchone()
            assert row is not None and row[0] >= 8 and row[1] == 0, row
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("DELETE FROM pgskip.jobs")


def test_a_blocking_fetch_left_in_flight_is_delivered_by_the_next_drain(db_url: str) -> None:
    """A signal that interrupts the wait for a blocking fetch leaves the statement in flight;
    the next ``drain_events`` collects its rows instead of skipping the fetch for good."""
    queue = Queue("interrupted", Exchange("interrupted"), "interrupted")
    with Connection(_broker(db_url)) as conn:
        _publish(conn, queue, 3)
        channel, received = _consuming(conn, queue, 10)
        fetcher = channel.own_fetcher()
        assert fetcher is not None
        channel.ensure_registered([queue.name])
        # What a wait interrupted after the send leaves behind.
        fetcher.send([], [queue.name], 10, channel.consumer_id)
        conn.drain_events(timeout=5)
        assert [m.payload["i"] for m in received] == [0, 1, 2]
        assert not fetcher.in_flight


def test_a_small_refill_waits_for_more_credit_on_an_event_loop(db_url: str) -> None:
    queue = Queue("refill", Exchange("refill"), "refill")
    # Synchronous fetches, so that each loop_drain call below has done its fetch on return.
    with Connection(_broker(db_url), transport_options={"async_fetch": False}) as conn:
        _publish(conn, queue, 12)
        received: list[object] = []
        hub = Hub()
        try:
            channel = conn.channel()
            Consumer(
                channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=8
            ).consume()
            transport = conn.transport
            transport.register_with_event_loop(conn.connection, hub)
            deadline = time.monotonic() + 10
            while len(received) < 8 and time.monotonic() < deadline:
                hub.run_once()
            assert len(received) == 8
            received[0].ack()  # type: ignore[attr-defined]
            # One slot of eight free while seven are held: the fetch (and the ack with it)
            # is put off rather than sent for a single message.
            transport.dispatcher.loop_drain()
            assert len(received) == 8
            assert _statuses(db_url).count("running") == 8
            for message in received[1:4]:
                message.ack()  # type: ignore[attr-defined]
            transport.dispatcher.loop_drain()  # half the window free: fetch now, acks included
            assert len(received) == 12
            assert _statuses(db_url).count("completed") == 4
            received[4].ack()  # type: ignore[attr-defined]
            transport.dispatcher.refill()  # what the loop runs REFILL_DELAY after a deferral
            assert _statuses(db_url).count("completed") == 5
        finally:
            conn.transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()


def _one_received(conn: Connection, name: str) -> Any:
    """One message published to a new queue ``name`` and received by a consumer on ``conn``
    (not acked)."""
    queue = Queue(name, Exchange(name), name)
    _publish(conn, queue, 1)
    received: list[Any] = []
    Consumer(conn.channel(), [queue], callbacks=[lambda body, m: received.append(m)]).consume()
    conn.drain_events(timeout=5)
    assert len(received) == 1
    return received[0]


def test_the_heartbeat_writes_acks_of_a_consumer_that_stopped_draining(db_url: str) -> None:
    with Connection(_broker(db_url), transport_options={"lease_seconds": 3}) as conn:
        _one_received(conn, "idle").ack()
        assert _statuses(db_url) == ["running"]
        deadline = time.monotonic() + 5  # the heartbeat beats every lease_seconds / 3
        while _statuses(db_url) != ["completed"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _statuses(db_url) == ["completed"]


def test_acks_the_heartbeat_failed_to_write_are_written_by_its_next_beat(db_url: str) -> None:
    """The heartbeat's connection was lost (a network cut) while the consumer lives on: the
    beat that finds it dead does not drop the acks it took; the next beat writes them. This
    fits one CI failure: a row left ``running`` under a consumer whose lease kept being
    renewed."""
    from kombu_pgskip.background import Background

    with Connection(_broker(db_url), transport_options={"lease_seconds": 3}) as conn:
        message = _one_received(conn, "beat-lost")
        transport = conn.transport
        running = transport._background
        assert running is not None
        running.stop()  # beats from here on are this test's, one at a time
        running.join(10)
        heartbeat = Background(transport.url, transport.options, transport.consumer_channels)
        try:
            heartbeat.leases(heartbeat.store)  # connected
            with psycopg.connect(db_url, autocommit=True) as admin:
                pid = heartbeat.store.conn.info.backend_pid
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            message.ack()
            with pytest.raises(psycopg.OperationalError):
                heartbeat.leases(heartbeat.store)
            assert _statuses(db_url) == ["running"]
            heartbeat.store.close()  # as the heartbeat thread does after a failed beat
            heartbeat.leases(heartbeat.store)
            assert _statuses(db_url) == ["completed"]
        finally:
            heartbeat.store.close()


def test_on_an_event_loop_the_fetch_does_not_block_the_loop(db_url: str) -> None:
    queue = Queue("nonblocking", Exchange("nonblocking"), "nonblocking")
    with Connection(_broker(db_url)) as conn:
        _publish(conn, queue, 30)
        received: list[object] = []
        hub = Hub()
        try:
            channel = conn.channel()
            Consumer(
                channel, [queue], callbacks=[lambda body, m: received.append(m)], prefetch_count=10
            ).consume()
            transport = conn.transport
            transport.register_with_event_loop(conn.connection, hub)
            transport.dispatcher.loop_drain()
            assert received == [], "the fetch was sent; its rows arrive when the loop reads them"
            assert channel.fetcher is not None and channel.fetcher.in_flight
            deadline = time.monotonic() + 10
            while len(received) < 10 and time.monotonic() < deadline:
                hub.run_once()
            assert len(received) == 10  # the prefetch window, no more
            for message in received:
                message.ack()  # type: ignore[attr-defined]
            while len(received) < 30 and time.monotonic() < deadline:
                hub.run_once()
                for message in received[10:]:
                    if message.acknowledged is False:  # type: ignore[attr-defined]
                        message.ack()  # type: ignore[attr-defined]
            assert len(received) == 30
            deadline = time.monotonic() + 10
            while _statuses(db_url) != ["completed"] * 30 and time.monotonic() < deadline:
                hub.run_once()
            assert _statuses(db_url) == ["completed"] * 30
        finally:
            conn.transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()


def test_closing_with_a_fetch_in_flight_puts_its_rows_back(db_url: str) -> None:
    queue = Queue("inflight", Exchange("inflight"), "inflight")
    with Connection(_broker(db_url)) as conn:
        _publish(conn, queue, 5)
        hub = Hub()
        received: list[object] = []
        channel = conn.channel()
        Consumer(channel, [queue], callbacks=[lambda body, m: received.append(m)]).consume()
        conn.transport.register_with_event_loop(conn.connection, hub)
        conn.transport.dispatcher.loop_drain()
        assert channel.fetcher is not None and channel.fetcher.in_flight
        channel.close()  # before the loop read the reply
        conn.transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
    assert received == []
    assert _statuses(db_url) == ["pending"] * 5


def test_the_event_loop_fetch_is_planned_once_and_still_fences_acks(db_url: str) -> None:
    """The fetcher's connection runs ack_fetch with its generic plan (planning it for every
    fetch cost a few hundred microseconds of server CPU). That plan finds acked rows by id and
    checks the delivery count: an ack of an older delivery of a row changes nothing."""
    import uuid

    from kombu_pgskip.fetcher import AsyncFetcher
    from kombu_pgskip.store import NewMessage, Store

    store = Store(db_url)
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    try:
        for i in range(40):
            store.publish(
                NewMessage("planned", 0, "pending", None, f'{{"i": {i}}}', None, None, None)
            )
        me = uuid.uuid4()
        tags: list[tuple[int, int]] = []
        seen = 0
        for _ in range(12):
            fetcher.send(tags, ["planned"], 3, me)
            result = fetcher.wait()
            assert result is not None
            acked, rows, _limit = result
            assert acked == len(tags)
            seen += len(rows)
            tags = [r.tag for r in rows]
        assert seen == 36
        assert fetcher._conn is not None
        plans = fetcher._conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE name = 'pgskip_ack_fetch'"
        ).fetchone()
        assert plans == (12, 0)
        # The last three rows are ours; an ack naming another delivery of them is stale.
        fetcher.send([(row_id, delivery + 1) for row_id, delivery in tags], ["planned"], 0, me)
        result = fetcher.wait()
        assert result is not None and result[0] == 0
        assert _statuses(db_url).count("running") == 3
        fetcher.send(tags, ["planned"], 0, me)
        result = fetcher.wait()
        assert result is not None and result[0] == 3
        assert _statuses(db_url).count("completed") == 36
    finally:
        fetcher.close()
        store.close()


def test_the_event_loop_fetch_planned_while_a_slot_was_empty_reads_it_by_key_once_filled(
    db_url: str,
) -> None:
    """The fetcher's generic plan is made once, at its first fetch, and kept until something
    invalidates it (an ANALYZE, a TRUNCATE). A slot of the ring that was empty then, as
    rotate() leaves a slot it emptied, fills later: the plan still finds the rows it takes by
    primary key, not by reading the whole slot for each batch (a cost that grows with every
    message the slot holds, and with every dead version a held snapshot keeps in it)."""
    import uuid

    from kombu_pgskip.fetcher import AsyncFetcher

    with psycopg.connect(db_url, autocommit=True) as sql:
        slots = sql.execute(
            "SELECT string_agg(c.oid::regclass::text, ', ') FROM pg_inherits AS i"
            " JOIN pg_class AS c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'pgskip.jobs'::regclass AND c.relname <> 'jobs_kept'"
        ).fetchone()
        assert slots is not None and slots[0]
        # After a TRUNCATE the planner knows nothing of a slot's size and takes it for a
        # table of 10 pages; slot 1 holds the messages that ran, as the current slot does.
        sql.execute(f"TRUNCATE {slots[0]}")
        sql.execute(
            "INSERT INTO pgskip.jobs (queue, payload, status, finished_at, slot)"
            " SELECT 'filled', '{}', 'completed', now(), 1 FROM generate_series(1, 100000)"
        )
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    me = uuid.uuid4()
    try:
        fetcher.send([], ["filled"], 10, me)
        result = fetcher.wait()
        assert result is not None and result[1] == []  # planned, slot 2 empty
        with psycopg.connect(db_url, autocommit=True) as sql:
            sql.execute(
                "INSERT INTO pgskip.jobs (queue, payload, slot)"
                " SELECT 'filled', '{}', 2 FROM generate_series(1, 20000)"
            )
        conn = fetcher._conn
        assert conn is not None
        params = [p.decode() for p in fetcher.params([], ["filled"], 10, me)]
        marks = ", ".join(["%s"] * len(params))
        cur = psycopg.ClientCursor(conn)
        cur.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE pgskip_ack_fetch({marks})", params)
        plan = "\n".join(row[0] for row in cur.fetchall())
        plans = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE name = 'pgskip_ack_fetch'"
        ).fetchone()
        assert plans == (2, 0), plans  # the same generic plan
        assert "actual time" in plan and "rows=10 loops=1" in plan, plan
        assert not seq_scanned_rows(conn, plan), plan
    finally:
        fetcher.close()


def _run_until(hub: Hub, done: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        hub.run_once()


@contextlib.contextmanager
def _consuming_on_a_hub(
    conn: Connection, queue: Queue, prefetch_count: int
) -> Iterator[tuple[Any, list[Any], Hub]]:
    """A consumer of ``queue`` on a new channel, registered with a kombu Hub: (the channel,
    the messages received, the hub)."""
    received: list[Any] = []
    hub = Hub()
    try:
        channel = conn.channel()
        Consumer(
            channel,
            [queue],
            callbacks=[lambda body, m: received.append(m)],
            prefetch_count=prefetch_count,
        ).consume()
        conn.transport.register_with_event_loop(conn.connection, hub)
        yield channel, received, hub
    finally:
        conn.transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()


@pytest.fixture
def fetch_sends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """Every event-loop fetch sent, as (time.monotonic(), acks it carries)."""
    return _record(monkeypatch, "send")


@pytest.fixture
def ack_sends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """Every event-loop statement of acks alone sent, as (time.monotonic(), acks it writes)."""
    return _record(monkeypatch, "send_acks")


def _record(monkeypatch: pytest.MonkeyPatch, method: str) -> list[tuple[float, int]]:
    from kombu_pgskip.fetcher import AsyncFetcher

    sends: list[tuple[float, int]] = []
    real = getattr(AsyncFetcher, method)

    def recorded(self: AsyncFetcher, tags: Any, *args: Any, **kwargs: Any) -> None:
        sends.append((time.monotonic(), len(tags)))
        real(self, tags, *args, **kwargs)

    monkeypatch.setattr(AsyncFetcher, method, recorded)
    return sends


def test_on_an_event_loop_an_ack_rides_with_the_next_notifications_fetch(
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    fetch_sends: list[tuple[float, int]],
    ack_sends: list[tuple[float, int]],
) -> None:
    """An ack on an idle consumer (nothing left behind for lack of credit) does not cost a
    fetch of its own: the fetch a notification triggers writes it, or, if nothing arrives,
    the ``ack`` statement alone ``ACK_FLUSH_DELAY`` later (a fetch would find nothing)."""
    from kombu_pgskip import policy as policy_module

    monkeypatch.setattr(policy_module, "ACK_FLUSH_DELAY", 0.5)  # an order the test can see
    queue = Queue("carried", Exchange("carried"), "carried")
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        _consuming_on_a_hub(conn, queue, 4) as (channel, received, hub),
    ):
        _publish(conn, queue, 1)
        _run_until(hub, lambda: len(received) == 1)
        assert len(received) == 1
        _run_until(hub, lambda: False, timeout=0.2)  # settled: no fetch in flight or queued
        assert not channel.fetcher.in_flight
        _stop_heartbeat(conn)
        fetch_sends.clear()
        received[0].ack()
        hub.run_once()
        assert fetch_sends == [], "no fetch of its own for an ack while nothing waits"
        assert _statuses(db_url) == ["running"]
        _publish(conn, queue, 1)
        _run_until(hub, lambda: len(received) == 2)
        assert len(received) == 2
        assert [acks for _, acks in fetch_sends] == [1], "the notification's fetch carried it"
        assert _statuses(db_url) == ["completed", "running"]
        received[1].ack()
        started = time.monotonic()
        _run_until(hub, lambda: _statuses(db_url) == ["completed"] * 2)
        assert _statuses(db_url) == ["completed"] * 2, "a lone ack is written by a timer"
        assert time.monotonic() - started < 10
        assert [acks for _, acks in fetch_sends] == [1], "without a fetch"
        assert [acks for _, acks in ack_sends] == [1]


def test_an_ack_frees_credit_for_messages_left_behind_at_once(db_url: str) -> None:
    """When the last fetch filled the prefetch window, more may be waiting: an ack asks for a
    fetch at once (no ``ACK_FLUSH_DELAY``)."""
    queue = Queue("starved", Exchange("starved"), "starved")
    with Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn:
        _publish(conn, queue, 6)
        with _consuming_on_a_hub(conn, queue, 2) as (channel, received, hub):
            _run_until(hub, lambda: len(received) == 2)
            assert len(received) == 2 and channel.fetch_state.starved
            for message in received:
                message.ack()
            policy = conn.transport.dispatcher.policy
            assert policy.fetch_wanted, "the wake-up asks for a fetch, not a flush"
            _run_until(hub, lambda: len(received) == 4)
            assert len(received) == 4


def test_a_notification_during_a_fetch_in_flight_is_not_lost(db_url: str) -> None:
    """A message committed after an in-flight fetch took its snapshot is announced while that
    fetch runs; the loop fetches again after the reply instead of waiting for the next poll."""
    queue = Queue("overlap", Exchange("overlap"), "overlap")
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        _consuming_on_a_hub(conn, queue, 4) as (channel, received, hub),
    ):
        transport = conn.transport
        _run_until(hub, lambda: channel.fetcher is not None and not channel.fetcher.in_flight)
        transport.dispatcher.loop_drain()  # a fetch of the (empty) queue is in flight
        assert channel.fetcher is not None and channel.fetcher.in_flight
        _publish(conn, queue, 1)
        listener = transport.dispatcher.poller.listener
        assert listener is not None
        select.select([listener.pgconn.socket], [], [], 5)
        transport.dispatcher.on_notified()  # the notification, before the fetch's reply
        started = time.monotonic()
        _run_until(hub, lambda: len(received) == 1, timeout=5)
        assert len(received) == 1, "delivered without waiting for the 30 s poll"
        assert time.monotonic() - started < 5


def test_a_notification_while_acks_go_alone_is_fetched_after_their_reply(
    db_url: str, ack_sends: list[tuple[float, int]]
) -> None:
    """Acks sent alone (nothing was due) are in flight when a message is announced: once
    their reply is in, the loop fetches, as after a fetch in flight."""
    queue = Queue("alone", Exchange("alone"), "alone")
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        _consuming_on_a_hub(conn, queue, 4) as (channel, received, hub),
    ):
        transport = conn.transport
        _publish(conn, queue, 1)
        _run_until(hub, lambda: len(received) == 1)
        _run_until(hub, lambda: False, timeout=0.2)  # settled: no fetch in flight or queued
        _stop_heartbeat(conn)
        received[0].ack()
        transport.dispatcher._flush_tick()  # the flush: acks alone, in flight
        assert [acks for _, acks in ack_sends] == [1] and channel.fetcher.in_flight
        _publish(conn, queue, 1)
        listener = transport.dispatcher.poller.listener
        assert listener is not None
        select.select([listener.pgconn.socket], [], [], 5)
        transport.dispatcher.on_notified()  # the notification, before the acks' reply
        started = time.monotonic()
        _run_until(hub, lambda: len(received) == 2, timeout=5)
        assert len(received) == 2, "delivered without waiting for the 30 s poll"
        assert time.monotonic() - started < 5
        assert _statuses(db_url) == ["completed", "running"]


def test_a_message_due_elsewhere_announced_with_one_in_the_slot_is_not_left_to_the_poll(
    db_url: str,
) -> None:
    """The sweeper returns messages and promotes others with one notification per queue, so
    one notification that names no message can announce a message in the slot new messages go
    to and one in another slot: the idle consumer's fetch reads every slot and takes both,
    none is left to the poll."""
    queue = Queue("twoslots", Exchange("twoslots"), "twoslots")
    options = {"polling_interval": 30}
    with (
        Connection(_broker(db_url), transport_options=options) as conn,
        _consuming_on_a_hub(conn, queue, 4) as (_channel, received, hub),
    ):
        _publish(conn, queue, 1)
        _run_until(hub, lambda: len(received) == 1)
        received[0].ack()
        _run_until(hub, lambda: False, timeout=0.3)  # the ack written: the consumer is idle
        with psycopg.connect(db_url, autocommit=True) as admin:
            row = admin.execute("SELECT pgskip.current_slot(), payload::text FROM pgskip.jobs")
            slot, body = row.fetchone() or (0, "")
            with admin.transaction():
                for where in (slot % 8 + 1, slot):  # returned in another slot; promoted here
                    admin.execute(
                        "INSERT INTO pgskip.jobs (queue, payload, slot) "
                        "VALUES ('twoslots', %s::json, %s)",
                        (body, where),
                    )
                admin.execute("SELECT pg_notify('pgskip:pgskip', 'twoslots')")

        def acked_all() -> bool:
            for message in received:
                if not message.acknowledged:
                    message.ack()
            return len(received) == 3

        _run_until(hub, acked_all, timeout=5)
        assert len(received) == 3, "the message in the other slot waited for the poll"


def test_acks_alone_lost_with_their_connection_are_written_by_the_next_statement(
    db_url: str, ack_sends: list[tuple[float, int]], fetch_sends: list[tuple[float, int]]
) -> None:
    """The fetch connection dies while acks sent alone are in flight: the error reaches the
    loop (Celery reconnects), the acks are queued again, and the next statement writes them."""
    queue = Queue("alone_lost", Exchange("alone_lost"), "alone_lost")
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        _consuming_on_a_hub(conn, queue, 4) as (channel, received, hub),
    ):
        transport = conn.transport
        for n in (1, 2):  # the first ack prepares the statement, the second goes out on it
            _publish(conn, queue, 1)
            _run_until(hub, lambda n=n: len(received) == n)  # type: ignore[misc]
            _run_until(hub, lambda: False, timeout=0.2)
        _stop_heartbeat(conn)
        received[0].ack()
        _run_until(hub, lambda: _statuses(db_url) == ["completed", "running"])
        assert len(ack_sends) == 1
        received[1].ack()
        fetcher = channel.fetcher
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (fetcher._conn.info.backend_pid,))
        transport.dispatcher._flush_tick()
        assert len(ack_sends) == 2 and fetcher.in_flight
        with pytest.raises(psycopg.OperationalError):
            select.select([fetcher.fileno()], [], [], 5)
            transport.dispatcher._on_fetch_readable(channel)
        assert len(channel.acks) == 1, "queued again"
        assert _statuses(db_url) == ["completed", "running"]
        fetch_sends.clear()
        transport.register_with_event_loop(conn.connection, hub)  # as Celery, reconnected
        _run_until(hub, lambda: _statuses(db_url) == ["completed"] * 2, timeout=5)
        assert _statuses(db_url) == ["completed"] * 2
        assert channel.fetcher is not fetcher
        assert [acks for _, acks in fetch_sends] == [1]


def test_a_queue_consumed_while_a_fetch_is_in_flight_is_fetched_after_its_reply(
    db_url: str,
) -> None:
    """A consumer added while the channel's fetch is in flight (Celery's ``add_consumer``):
    that fetch was sent without the new queue, so once its reply is in the loop fetches
    again, rather than leaving a message already waiting there to the poll."""
    first = Queue("first", Exchange("first"), "first")
    second = Queue("second", Exchange("second"), "second")
    with (
        Connection(_broker(db_url), transport_options={"polling_interval": 30}) as conn,
        _consuming_on_a_hub(conn, first, 4) as (channel, received, hub),
    ):
        transport = conn.transport
        _publish(conn, second, 1)  # announced before anyone consumes it
        _run_until(hub, lambda: channel.fetcher is not None and not channel.fetcher.in_flight)
        _run_until(hub, lambda: False, timeout=0.2)
        transport.dispatcher.loop_drain()  # a fetch of the (empty) first queue is in flight
        assert channel.fetcher.in_flight
        Consumer(
            channel, [second], callbacks=[lambda body, m: received.append(m)], prefetch_count=4
        ).consume()
        assert channel.fetcher.in_flight
        transport.dispatcher._on_wake()  # the wake-up it asked for, before the reply
        started = time.monotonic()
        _run_until(hub, lambda: len(received) == 1, timeout=5)
        assert len(received) == 1, "delivered without waiting for the 30 s poll"
        assert time.monotonic() - started < 5


def test_notifications_within_the_fetch_cooldown_share_one_fetch(
    db_url: str, fetch_sends: list[tuple[float, int]]
) -> None:
    """While messages stream in, a notification's fetch waits until ``fetch_cooldown`` after
    the previous fetch was sent; the messages announced meanwhile come in that one fetch."""
    queue = Queue("cooldown", Exchange("cooldown"), "cooldown")
    options = {"polling_interval": 30, "fetch_cooldown": 1.0}
    with (
        Connection(_broker(db_url), transport_options=options) as conn,
        _consuming_on_a_hub(conn, queue, 10) as (_channel, received, hub),
    ):
        _run_until(hub, lambda: False, timeout=1.2)  # past the cooldown of the first fetch
        fetch_sends.clear()
        _publish(conn, queue, 1)
        _run_until(hub, lambda: len(received) == 1)
        assert len(fetch_sends) == 1, "the first notification after a quiet second fetches"
        _publish(conn, queue, 3)
        _run_until(hub, lambda: len(received) == 4)
        assert len(received) == 4
        assert len(fetch_sends) == 2, "three notifications within the cooldown: one fetch"
        assert fetch_sends[1][0] - fetch_sends[0][0] >= 0.95


def test_the_cooldown_grows_while_notified_fetches_find_nothing_and_shrinks_back(
    db_url: str, fetch_sends: list[tuple[float, int]]
) -> None:
    """Another consumer takes each announced message first: this consumer's notified fetches
    come back empty and its cooldown doubles up to ``fetch_cooldown_max``; once its fetches
    take rows again it shrinks back to ``fetch_cooldown``. An empty fetch that no notification
    asked for (a poll, an ack flush) leaves it alone."""
    queue = Queue("adaptive", Exchange("adaptive"), "adaptive")
    options = {"polling_interval": 30, "fetch_cooldown": 0.01, "fetch_cooldown_max": 0.08}
    with (
        Connection(_broker(db_url), transport_options=options) as conn,
        Connection(_broker(db_url)) as other,
        _consuming_on_a_hub(conn, queue, 10) as (channel, received, hub),
    ):
        cooldown = conn.transport.dispatcher.policy.cooldown

        def settled() -> bool:
            return channel.fetcher is not None and not channel.fetcher.in_flight

        _run_until(hub, settled)
        _publish(other, queue, 0)  # declares the queue on the other connection
        values = []
        for _ in range(4):
            sent = len(fetch_sends)
            _publish(other, queue, 1)
            taken = other.default_channel.basic_get(queue.name)  # before this loop reads
            assert taken is not None
            taken.ack()
            _run_until(hub, lambda sent=sent: len(fetch_sends) > sent and settled())
            values.append(cooldown.value)
        assert received == []
        assert values == [0.02, 0.04, 0.08, 0.08], "doubled per empty notified fetch, capped"

        conn.transport.dispatcher.loop_drain()  # a fetch no notification asked for, finding nothing
        _run_until(hub, settled)
        assert cooldown.value == 0.08

        _publish(other, queue, 2)  # two notifications within the grown cooldown: one fetch
        _run_until(hub, lambda: len(received) == 2)
        assert len(received) == 2
        for message in received:
            message.ack()
        sends = [t for t, _ in fetch_sends]
        assert sends[-1] - sends[-2] >= 0.075, "the second waited out the grown cooldown"
        shrinking = [cooldown.value]
        for i in range(25):
            time.sleep(0.09)  # past the cooldown: each notification fetches at once
            _publish(other, queue, 1)
            _run_until(hub, lambda i=i: len(received) == 3 + i)
            received[-1].ack()  # within the prefetch window
            shrinking.append(cooldown.value)
        assert len(received) == 27
        assert shrinking == sorted(shrinking, reverse=True) and shrinking[0] < 0.08
        assert shrinking[-1] == 0.01, "back to fetch_cooldown while fetches take rows"


def test_a_blocking_consumer_adapts_its_cooldown_as_the_event_loop_does(
    db_url: str, fetch_sends: list[tuple[float, int]]
) -> None:
    """Outside an event loop (``drain_events``, as a ``ConsumerMixin`` runs): a notification
    read while waiting fetches only once the cooldown after the previous fetch has passed; if
    that fetch finds the message taken by another consumer, the cooldown doubles, up to
    ``fetch_cooldown_max``; notified fetches that take rows shrink it back."""
    queue = Queue("adaptive-blocking", Exchange("adaptive-blocking"), "adaptive-blocking")
    options = {"polling_interval": 30, "fetch_cooldown": 0.01, "fetch_cooldown_max": 0.08}
    with (
        Connection(_broker(db_url), transport_options=options) as conn,
        Connection(_broker(db_url)) as other,
    ):
        transport = conn.transport
        cooldown = transport.dispatcher.policy.cooldown
        _channel, received = _consuming(conn, queue, 10)
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)  # LISTEN opened, the queue found empty
        listener = transport.dispatcher.poller.listener
        assert listener is not None
        _publish(other, queue, 0)  # declares the queue on the other connection

        def announced_and_taken() -> None:
            _publish(other, queue, 1)
            taken = other.default_channel.basic_get(queue.name)
            assert taken is not None
            taken.ack()
            select.select([listener.pgconn.socket], [], [], 5)  # the notification is here

        values = []
        for _ in range(4):
            announced_and_taken()
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
            values.append(cooldown.value)
        assert received == []
        assert values == [0.02, 0.04, 0.08, 0.08], "doubled per empty notified fetch, capped"

        fetch_sends.clear()
        _publish(other, queue, 1)
        conn.drain_events(timeout=5)  # fetched for it: a fetch just now
        assert len(received) == 1
        assert cooldown.value == pytest.approx(0.072), (
            "a notified fetch that took a row shortens it"
        )
        publisher = threading.Timer(0.02, _publish, (other, queue, 1))
        publisher.start()  # announced while this consumer waits, within its cooldown
        conn.drain_events(timeout=5)
        publisher.join()
        assert len(received) == 2
        sends = [t for t, _ in fetch_sends]
        assert len(sends) == 2 and sends[1] - sends[0] >= 0.07, "waited out the cooldown"

        shrinking = [cooldown.value]
        for i in range(25):
            publisher = threading.Timer(0.01, _publish, (other, queue, 1))
            publisher.start()  # announced while this consumer waits
            conn.drain_events(timeout=5)
            publisher.join()
            assert len(received) == 3 + i
            received[-1].ack()
            shrinking.append(cooldown.value)
        assert shrinking == sorted(shrinking, reverse=True)
        assert shrinking[-1] == 0.01, "back to fetch_cooldown while fetches take rows"
