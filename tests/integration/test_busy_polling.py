"""Busy polling (migration 0008): a worker whose queue streams in faster than its
``fetch_cooldown`` fetches every cooldown without waiting for notifications and marks its
consumers polling. A publish to a queue whose consumers all poll sends no NOTIFY, and the next
one to that queue is quiet: one transaction instead of two. A consumer that stops polling
clears its flag and waits for the quiet publishes that may have read it before (their shared
advisory lock), so its next fetch sees their messages; every later publish notifies.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

import kombu_pgskip
import kombu_pgskip.store as store_module
from kombu_pgskip.envelope import to_row
from kombu_pgskip.publish import apply_async_in
from kombu_pgskip.store import Store, notify_channel, scheduled_channel
from tests.publish_support import jobs, make_app

CHANNEL = notify_channel("pgskip")


def _message(queue: str, countdown: float | None = None) -> Any:
    headers: dict[str, Any] = {"task": "t", "id": str(uuid.uuid4())}
    if countdown is not None:
        headers["eta"] = time.strftime(
            "%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() + countdown)
        )
    message = {
        "body": json.dumps({"x": 1}),
        "headers": headers,
        "properties": {"priority": 0, "delivery_info": {}},
    }
    return to_row(queue, message, eta_threshold=2, max_message_size=10**6)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


@pytest.fixture
def listener(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(db_url, autocommit=True)
    conn.execute(f'LISTEN "{CHANNEL}"')
    conn.execute(f'LISTEN "{scheduled_channel("pgskip")}"')
    yield conn
    conn.close()


@pytest.fixture(autouse=True)
def check_every_announcement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every announcement reads the consumers' flags (not one in ``QUIET_CHECK_EVERY``), so
    that a test sees the effect of a flag at the next publish."""
    monkeypatch.setattr(store_module, "QUIET_CHECK_EVERY", 1)


@pytest.fixture
def quiet_publishes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the publishes that ran as one transaction (``run_together``)."""
    calls: list[int] = []
    real = store_module.run_together

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, "run_together", counted)
    return calls


def _notes(listener: psycopg.Connection[Any], timeout: float = 0.3) -> list[tuple[str, str]]:
    """(channel, payload) of the notifications that arrive within ``timeout``."""
    return [(n.channel, n.payload) for n in listener.notifies(timeout=timeout)]


def _consumer(store: Store, queues: list[str]) -> uuid.UUID:
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="test", queues=queues, lease=60)
    return cid


def _polling(db_url: str, cid: uuid.UUID) -> bool:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT polling FROM pgskip.consumers WHERE id = %s", (cid,)).fetchone()
    assert row is not None
    return bool(row[0])


def _job_count(db_url: str, queue: str) -> int:
    return sum(1 for job in jobs(db_url) if job.queue == queue)


def test_a_queue_whose_consumers_all_poll_is_not_announced(
    store: Store, listener: psycopg.Connection[Any], db_url: str, quiet_publishes: list[int]
) -> None:
    woken = [(CHANNEL, "bp")]
    first, second = _consumer(store, ["bp"]), _consumer(store, ["bp", "other"])
    store.publish(_message("bp"))
    assert _notes(listener) == woken, "nobody polls: notified"
    store.start_polling([first])
    store.publish(_message("bp"))
    assert _notes(listener) == woken, "one consumer of the queue still waits: notified"
    assert quiet_publishes == []

    store.start_polling([second])
    store.publish(_message("bp"))
    assert _notes(listener) == [], "every consumer polls: no NOTIFY"
    assert quiet_publishes == [], "that one found out in its announcement"
    store.publish(_message("bp"))
    store.publish(_message("bp"))
    assert _notes(listener) == []
    assert len(quiet_publishes) == 2, "the next ones are quiet: one transaction each"

    scheduled = store.publish(_message("bp", countdown=3600))
    notes = _notes(listener)
    assert [c for c, _ in notes] == [scheduled_channel("pgskip")], "due times still announced"
    assert scheduled > 0
    store.publish(_message("nobody-consumes"))
    assert _notes(listener) == [(CHANNEL, "nobody-consumes")], "a queue without consumers"

    store.stop_polling([first])
    store.publish(_message("bp"))
    assert _notes(listener) == woken, "a quiet publish reads the cleared flag and notifies"
    assert len(quiet_publishes) == 3
    store.publish(_message("bp"))
    assert _notes(listener) == woken
    assert len(quiet_publishes) == 3, "after notifying, back to two transactions"
    assert _job_count(db_url, "bp") == 8


def test_an_announcement_reads_the_flags_once_every_few_publishes(
    store: Store, listener: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the flags costs the server about 10 us, so a queue's announcement reads them on
    its first publish and one in ``QUIET_CHECK_EVERY`` after; the others notify."""
    monkeypatch.setattr(store_module, "QUIET_CHECK_EVERY", 3)
    store.start_polling([_consumer(store, ["bp"])])
    woken = []
    for _ in range(4):
        store._quiet.discard("bp")  # keep it from going quiet: only the announcement here
        store.publish(_message("bp"))
        woken.append(len(_notes(listener)))
    assert woken == [0, 1, 1, 0], "the 1st and 4th read the flags; the 2nd and 3rd notify"


def test_jobs_of_a_callers_transaction_wake_only_the_queues_not_all_polled(
    store: Store, listener: psycopg.Connection[Any], db_url: str
) -> None:
    """The NOTIFYs sent after a caller's commit (``announce_many``: Django, a SQLAlchemy
    ``Session``, ``kombu_pgskip.transaction``) skip a queue whose consumers all poll."""
    app = make_app(db_url)
    task = app.tasks["txn.add"]
    store.start_polling([_consumer(store, ["bp"])])
    try:
        with psycopg.connect(db_url) as conn, kombu_pgskip.transaction(conn):
            apply_async_in(conn, task, (1, 1), queue="bp")
            apply_async_in(conn, task, (1, 2), queue="waited-for")
        assert _notes(listener) == [(CHANNEL, "waited-for")]
    finally:
        app.close()
    assert _job_count(db_url, "bp") == 1


def test_a_remembered_route_publishes_quietly_too(
    db_url: str, listener: psycopg.Connection[Any], quiet_publishes: list[int]
) -> None:
    """Celery publishes through an exchange: the remembered route's insert is quiet as well."""
    queue = Queue("routed-bp", Exchange("routed-bp"), "rk")
    with Connection(db_url.replace("postgresql://", "pgskip://", 1)) as conn:
        producer = Producer(conn.channel())
        producer.publish({"i": 0}, exchange=queue.exchange, routing_key="rk", declare=[queue])
        store = conn.default_channel.store
        cid = _consumer(store, ["routed-bp"])
        store.start_polling([cid])
        _notes(listener)
        for i in range(3):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="rk")
        assert _notes(listener) == []
        assert len(quiet_publishes) == 2
        store.stop_polling([cid])
        producer.publish({"i": 9}, exchange=queue.exchange, routing_key="rk")
        assert _notes(listener) == [(CHANNEL, "routed-bp")]
    assert _job_count(db_url, "routed-bp") == 5


def _advisory_waiters(db_url: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ).fetchone()
    return int(row[0]) if row else 0


def _wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert check()


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[float]]:
    """Run ``fn`` in a thread; the list gets the monotonic time it returned at."""
    done: list[float] = []

    def run() -> None:
        fn()
        done.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def _hold_quiet_lock(db_url: str, queue: str) -> psycopg.Connection[Any]:
    """A transaction holding the queue's lock as a quiet publish does until its commit."""
    holder = psycopg.connect(db_url)
    holder.execute(
        "SELECT pg_advisory_xact_lock_shared(hashtext(%s), hashtext(%s))", (CHANNEL, queue)
    )
    return holder


def test_a_consumer_that_stops_polling_waits_for_the_quiet_publishes_in_flight(
    store: Store, listener: psycopg.Connection[Any], db_url: str
) -> None:
    cid = _consumer(store, ["bp"])
    store.start_polling([cid])
    holder = _hold_quiet_lock(db_url, "bp")  # a quiet publish that read the flag set
    stopper = Store(db_url)
    try:
        thread, done = _in_thread(lambda: stopper.stop_polling([cid]))
        _wait_for(lambda: _advisory_waiters(db_url) == 1)
        time.sleep(0.3)
        assert done == [], "it waits for the publish to commit"
        assert _polling(db_url, cid), "and its cleared flag is not committed yet"
        committed = time.monotonic()
        holder.commit()
        thread.join(5)
        assert done and done[0] >= committed
        assert not _polling(db_url, cid)
    finally:
        holder.close()
        stopper.close()


def test_a_publish_holding_the_lock_too_long_does_not_stall_a_consumer_that_stops(
    store: Store, listener: psycopg.Connection[Any], db_url: str
) -> None:
    """A quiet publish stuck inside its transaction (its client gone halfway through the
    pipeline, say) must not stall a worker's event loop: after ``lock_timeout`` the flags are
    cleared without waiting, and publishes from then on notify."""
    cid = _consumer(store, ["bp"])
    store.start_polling([cid])
    store.publish(_message("bp"))  # learns that the queue is polled
    holder = _hold_quiet_lock(db_url, "bp")
    stopper = Store(db_url)
    try:
        started = time.monotonic()
        assert stopper.stop_polling([cid], lock_timeout=0.3) is False
        assert 0.25 < time.monotonic() - started < 5
        assert not _polling(db_url, cid), "cleared all the same"
        store.publish(_message("bp"))
        assert _notes(listener, timeout=2) == [(CHANNEL, "bp")], "later publishes notify"
    finally:
        holder.close()
        stopper.close()
    assert store.stop_polling([cid]) is True, "with nobody holding the lock it waits for none"


def test_a_quiet_publish_behind_a_stopping_consumer_reads_the_cleared_flag(
    store: Store, listener: psycopg.Connection[Any], db_url: str
) -> None:
    """A quiet publish that asks for the queue's lock while a consumer that stops polling
    waits for it comes after that consumer's commit: it sees the flag cleared and notifies."""
    cid = _consumer(store, ["bp"])
    store.start_polling([cid])
    store.publish(_message("bp"))  # learns that the queue is polled: the next one is quiet
    assert _notes(listener) == []
    holder = _hold_quiet_lock(db_url, "bp")
    stopper = Store(db_url)
    try:
        stopping, stopped = _in_thread(lambda: stopper.stop_polling([cid]))
        _wait_for(lambda: _advisory_waiters(db_url) == 1)
        publishing, published = _in_thread(lambda: store.publish(_message("bp")))
        _wait_for(lambda: _advisory_waiters(db_url) == 2)
        assert published == [], "queued behind the consumer's exclusive request"
        holder.commit()
        stopping.join(5)
        publishing.join(5)
        # Both returned (which thread noted it first says nothing of the server's order:
        # that the publish read the flag cleared shows in its NOTIFY below).
        assert stopped and published
    finally:
        holder.close()
        stopper.close()
    assert _notes(listener, timeout=2) == [(CHANNEL, "bp")], "it notified"
    assert _job_count(db_url, "bp") == 2


def test_a_renewal_clears_polling_flags_but_never_sets_them(store: Store, db_url: str) -> None:
    cid = _consumer(store, ["bp"])
    store.start_polling([cid])
    assert store.renew_consumers([cid], 60, polling=True) == {cid}
    assert _polling(db_url, cid), "the transport polls: kept"
    store.renew_consumers([cid], 60, polling=False)
    assert not _polling(db_url, cid), "the transport does not poll: cleared"
    store.renew_consumers([cid], 60, polling=True)
    assert not _polling(db_url, cid), "never set by a renewal"
    store.start_polling([cid])
    store.register_consumer(cid, hostname="test", queues=["bp"], lease=60)
    assert not _polling(db_url, cid), "registering again starts from not polling"


def _stream(url: str, queue: Queue, n: int, gap: float) -> None:
    with Connection(url) as conn:
        producer = Producer(conn.channel())
        for i in range(n):
            producer.publish(
                {"i": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
            )
            time.sleep(gap)


@pytest.mark.parametrize("busy_polling", [True, False])
def test_an_event_loop_polls_a_streaming_queue_and_its_publishers_stop_notifying(
    db_url: str, listener: psycopg.Connection[Any], busy_polling: bool
) -> None:
    """Messages every ~2 ms against a 10 ms cooldown: the loop starts polling, the publishes
    stop notifying, every message arrives once. When the stream ends the loop stops polling,
    and a message published afterwards wakes it by notification (the poll is 30 s away)."""
    url = db_url.replace("postgresql://", "pgskip://", 1)
    queue = Queue("stream", Exchange("stream"), "stream")
    n = 300
    options = {"polling_interval": 30, "fetch_cooldown": 0.01, "busy_polling": busy_polling}
    received: list[int] = []
    hub = Hub()
    with Connection(url, transport_options=options) as conn:
        transport = conn.transport
        try:

            def take(body: Any, message: Any) -> None:
                received.append(body["i"])
                message.ack()

            Consumer(conn.channel(), [queue], callbacks=[take], prefetch_count=50).consume()
            transport.register_with_event_loop(conn.connection, hub)
            _notes(listener)
            publisher, _ = _in_thread(lambda: _stream(url, queue, n, 0.002))
            polled_in_db = False
            deadline = time.monotonic() + 60
            while len(received) < n and time.monotonic() < deadline:
                hub.run_once()
                if transport._polling and not polled_in_db:
                    with psycopg.connect(db_url) as check:
                        row = check.execute("SELECT bool_and(polling) FROM pgskip.consumers")
                        polled_in_db = bool(row.fetchone()[0])  # type: ignore[index]
            publisher.join(10)
            notified = [p for c, p in _notes(listener, timeout=0.2) if c == CHANNEL]
            assert sorted(received) == list(range(n)), "every message, once"
            if busy_polling:
                assert polled_in_db, "the loop polled and its consumer's row said so"
                assert len(notified) < n // 2, f"{len(notified)} of {n} publishes notified"
            else:
                assert not polled_in_db
                assert len(notified) == n

            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # the stream is over: two empty polls stop it
                hub.run_once()
            assert not transport._polling
            with psycopg.connect(db_url) as check:
                row = check.execute("SELECT bool_or(polling) FROM pgskip.consumers")
                assert row.fetchone() == (False,)
            _notes(listener)
            sent = time.monotonic()
            _stream(url, queue, 1, 0)
            while len(received) < n + 1 and time.monotonic() < sent + 10:
                hub.run_once()
            assert len(received) == n + 1
            assert time.monotonic() - sent < 5, "woken by its notification, not the 30 s poll"
        finally:
            transport.unregister_from_event_loop(conn.connection, hub)
            hub.close()


def _add_consumers(db_url: str, n: int, *, queue: str, polling: bool) -> None:
    """``n`` consumer rows of ``queue`` (``polling`` as given) and ``n`` of remote-control
    queues of their own, as a fleet of ``n`` workers registers them."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.consumers (id, hostname, pid, queues, lease_until, polling)"
            " SELECT gen_random_uuid(), 'fleet', g, ARRAY[%s], now() + interval '1 hour', %s"
            "   FROM generate_series(1, %s) AS g",
            (queue, polling, n),
        )
        conn.execute(
            "INSERT INTO pgskip.consumers (id, hostname, pid, queues, lease_until)"
            " SELECT gen_random_uuid(), 'fleet', g, ARRAY['w' || g || '.celery.pidbox'],"
            "        now() + interval '1 hour'"
            "   FROM generate_series(1, %s) AS g",
            (n,),
        )
        conn.execute("ANALYZE pgskip.consumers")


def _announce_plan(store: Store, db_url: str, queue: str) -> str:
    """The generic plan of ``announce``, prepared, for a pending message of ``queue``."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        text = store.q["announce"].as_string(None)
        for k, name in enumerate(["queue", "status"], 1):
            text = text.replace(f"%({name})s", f"${k}")
        text = text.replace("%(channel)s", "'c'").replace("%(scheduled_channel)s", "'s'")
        text = text.replace("%(run_at)s", "NULL")
        conn.execute(f"PREPARE flags(text, text) AS {text}")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        rows = conn.execute(f"EXPLAIN EXECUTE flags({queue!r}, 'pending')")
        return "\n".join(r[0] for r in rows)


def test_the_flags_of_a_large_fleet_are_read_with_one_index_probe(
    store: Store, db_url: str
) -> None:
    """The read of the flags is one probe of consumer_queues' (queue, polling) index (migration
    0010), not a scan of consumers, in the generic plan that prepared statements run. Here
    3,000 workers that do not poll consume ``celery`` and their own remote-control queue, and
    the queue looked up has one consumer, registered last, which polls: before 0010 finding
    it scanned every consumer row."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.consumers (id, hostname, pid, queues, lease_until)"
            " SELECT gen_random_uuid(), 'fleet', g, ARRAY['celery', 'w' || g || '.celery.pidbox'],"
            "        now() + interval '1 hour'"
            "   FROM generate_series(1, 3000) AS g"
        )
    cid = _consumer(store, ["fleet"])
    store.start_polling([cid])
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE pgskip.consumers, pgskip.consumer_queues")
    # announce's plan; the quiet inserts and announce_many include the same fragment.
    plan = _announce_plan(store, db_url, "fleet")
    assert "consumer_queues_by_queue" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_consumer_queues_follow_every_change_to_consumers(store: Store, db_url: str) -> None:
    """consumer_queues, which publishes read, holds exactly each consumer's queues and flag
    through registration, re-registration with other queues, the polling statements, the
    heartbeat, leaving, the sweep and TRUNCATE (its triggers, migration 0010)."""

    def rows() -> set[tuple[str, str, bool]]:
        with psycopg.connect(db_url, autocommit=True) as conn:
            mirrored = set(
                conn.execute(
                    "SELECT consumer::text, queue, polling FROM pgskip.consumer_queues"
                ).fetchall()
            )
            expected = set(
                conn.execute(
                    "SELECT DISTINCT c.id::text, q, c.polling"
                    "  FROM pgskip.consumers AS c, unnest(c.queues) AS q"
                ).fetchall()
            )
        assert mirrored == expected
        return mirrored

    a, b = _consumer(store, ["qa", "qb", "qa"]), _consumer(store, ["qb"])
    assert rows() == {(str(a), "qa", False), (str(a), "qb", False), (str(b), "qb", False)}
    store.start_polling([a, b])
    assert rows() == {(str(a), "qa", True), (str(a), "qb", True), (str(b), "qb", True)}
    assert store.stop_polling([b])
    assert (str(b), "qb", False) in rows()
    store.register_consumer(a, hostname="test", queues=["qc"], lease=60)  # re-registers
    assert rows() == {(str(a), "qc", False), (str(b), "qb", False)}
    store.start_polling([a])
    store.renew_consumers([a], 60, polling=True)
    assert (str(a), "qc", True) in rows()
    store.renew_consumers([a], 60)  # a heartbeat of a consumer that no longer polls
    assert (str(a), "qc", False) in rows()
    store.unregister_consumer(b)
    assert rows() == {(str(a), "qc", False)}
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.consumers SET lease_until = now() - interval '1 s'")
    store.sweep(max_attempts=5)
    assert rows() == set()
    _consumer(store, ["qd"])
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("TRUNCATE pgskip.consumers")
    assert rows() == set()


def test_a_large_fleet_is_announced_exactly_as_a_small_one(
    store: Store, listener: psycopg.Connection[Any], db_url: str, quiet_publishes: list[int]
) -> None:
    """With thousands of consumer rows: quiet while they all poll, notified as soon as one of
    them stops, and a queue nobody consumes is still notified."""
    _add_consumers(db_url, 1500, queue="fleet", polling=True)
    for _ in range(6):  # past the point where a prepared statement turns to its generic plan
        store.publish(_message("fleet"))
    assert _notes(listener) == []
    assert len(quiet_publishes) == 5
    late = _consumer(store, ["fleet"])  # registers not polling
    store.publish(_message("fleet"))
    assert _notes(listener) == [(CHANNEL, "fleet")]
    store.start_polling([late])
    store.publish(_message("fleet"))
    store.publish(_message("fleet"))
    assert _notes(listener) == []
    for _ in range(6):
        store.publish(_message("nobody-in-the-fleet"))
    assert _notes(listener) == [(CHANNEL, "nobody-in-the-fleet")] * 6
