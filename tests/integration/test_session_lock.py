"""A consumer is dead soon after its process's session ends; leases never wait for ``jobs``.

The session lock (kombu_pgskip/leases.py): a consuming process holds an advisory lock on its
background thread's lease connection and writes its key into its consumers' rows; sweep()
(migration 0016) suspects a consumer whose key is no longer held and takes it for dead once a
sweep LOCK_GRACE_S later still finds it released, and keeps the lease rule for consumers without
a key, or with a key taken before the server last started. The background thread
(kombu_pgskip/background.py) renews on that connection alone, before any housekeeping, and
bounds every housekeeping statement's wait.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql

from kombu_pgskip.acks import AckBatcher
from kombu_pgskip.background import Background
from kombu_pgskip.envelope import to_row
from kombu_pgskip.grants import apply_grants, grant_statements
from kombu_pgskip.leases import LeaseRenewal, SessionLock
from kombu_pgskip.options import Options
from kombu_pgskip.store import LOCK_GRACE_S, Store
from tests.conftest import PgServer
from tests.safety_support import login_role, require_passwords


@dataclass
class Holder:
    """A consuming channel as the lease renewal sees it."""

    consumer_id: uuid.UUID = field(default_factory=uuid.uuid4)
    acks: AckBatcher = field(init=False)
    lost: int = 0

    def __post_init__(self) -> None:
        self.acks = AckBatcher(self.consumer_id)

    def lease_lost(self) -> None:
        self.lost += 1


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _publish(store: Store, queue: str, n: int = 1, **properties: Any) -> None:
    for i in range(n):
        message = {
            "body": json.dumps({"i": i}),
            "headers": {"task": "t", "id": f"{queue}-{i}"},
            "properties": {"delivery_info": {}, **properties},
        }
        store.publish(to_row(queue, message, eta_threshold=2, max_message_size=10**6))


def _statuses(db_url: str) -> list[str]:
    with psycopg.connect(db_url) as conn:
        return [r[0] for r in conn.execute("SELECT status::text FROM pgskip.jobs ORDER BY id")]


def _consumer_row(db_url: str, consumer: uuid.UUID) -> tuple[Any, ...] | None:
    with psycopg.connect(db_url) as conn:
        return conn.execute(
            "SELECT lock_key, lock_server_start IS NOT NULL, lease_until - now() > interval '0'"
            " FROM pgskip.consumers WHERE id = %s",
            (consumer,),
        ).fetchone()


def _held_keys(db_url: str) -> set[int]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks"
            " WHERE locktype = 'advisory' AND objsubid = 1 AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    return {int(r[0]) for r in rows}


def _held_consumer(store: Store, db_url: str, lease: float = 3600) -> tuple[Store, uuid.UUID]:
    """A consumer with an hour's lease, holding one message, whose process's lock is held on
    the session of the store returned (close it: the process is gone)."""
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="test", queues=["q"], lease=lease)
    assert len(store.fetch(["q"], 1, cid)) == 1
    lease_store = Store(db_url)
    lock = SessionLock()
    key = lock.held_on(lease_store)
    assert key is not None
    assert lease_store.renew_consumers([cid], lease, lock_key=key) == {cid}
    return lease_store, cid


def _end(lease_store: Store, db_url: str) -> None:
    """Close the session of ``lease_store``, as a process's death does, and wait until the
    server has released its locks (the backend exits a moment after the client has gone)."""
    pid = lease_store.conn.info.backend_pid
    lease_store.close()
    with psycopg.connect(db_url, autocommit=True) as conn:
        _wait_for(
            lambda: not conn.execute("SELECT 1 FROM pg_locks WHERE pid = %s", (pid,)).fetchone(),
            5,
            "the ended session's locks released",
        )


def _grace_over(db_url: str) -> None:
    """As if the sweeps' grace (LOCK_GRACE_S) had passed since a sweep found locks released."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.consumers SET lock_lost_at = lock_lost_at - interval '1 minute'"
            " WHERE lock_lost_at IS NOT NULL"
        )


# -- sweep(): the session rule and the lease rule --------------------------------------------------


def test_a_consumer_whose_process_session_ended_is_dead_once_the_grace_is_over(
    store: Store, db_url: str
) -> None:
    _publish(store, "q")
    lease_store, cid = _held_consumer(store, db_url)
    assert store.sweep(max_attempts=20) == (0, 0, 0)  # alive: its lock is held
    assert store.suspected_consumers() == 0
    _end(lease_store, db_url)  # the process is gone: its session ends, the lock with it
    assert store.sweep(max_attempts=20) == (0, 0, 0)  # found released: suspected
    assert store.suspected_consumers() == 1
    assert store.sweep(max_attempts=20) == (0, 0, 0)  # not for LOCK_GRACE_S
    _grace_over(db_url)
    assert store.sweep(max_attempts=20) == (1, 0, 1)
    assert _statuses(db_url) == ["pending"]
    assert _consumer_row(db_url, cid) is None
    assert store.suspected_consumers() == 0


def test_the_grace_is_counted_by_the_server_clock(store: Store, db_url: str) -> None:
    _publish(store, "q")
    lease_store, _ = _held_consumer(store, db_url)
    _end(lease_store, db_url)
    assert store.sweep(max_attempts=20) == (0, 0, 0)
    time.sleep(LOCK_GRACE_S + 0.2)
    assert store.sweep(max_attempts=20) == (1, 0, 1)


def test_a_consumer_without_a_lock_key_keeps_the_lease_rule(store: Store, db_url: str) -> None:
    """Registered but not yet renewed with a key, or renewed without one (listen=False)."""
    _publish(store, "q", 2)
    fresh, keyless = uuid.uuid4(), uuid.uuid4()
    for cid in (fresh, keyless):
        store.register_consumer(cid, hostname="test", queues=["q"], lease=3600)
        assert len(store.fetch(["q"], 1, cid)) == 1
    assert store.renew_consumers([keyless], 3600, lock_key=None) == {keyless}
    assert store.sweep(max_attempts=20) == (0, 0, 0)
    assert _consumer_row(db_url, keyless) == (None, False, True)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.consumers SET lease_until = now() - interval '1 s'")
    assert store.sweep(max_attempts=20) == (2, 0, 2)


def test_a_key_taken_before_the_server_last_started_proves_nothing(
    store: Store, db_url: str
) -> None:
    """After a restart or a failover every session has ended: only the lease says who is dead
    until each process has renewed on the new server."""
    _publish(store, "q")
    lease_store, _ = _held_consumer(store, db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.consumers SET lock_server_start = pg_postmaster_start_time()"
            " - interval '1 hour'"
        )
    _end(lease_store, db_url)
    assert store.sweep(max_attempts=20) == (0, 0, 0)
    assert store.suspected_consumers() == 0
    assert _statuses(db_url) == ["running"]


def test_a_lease_run_out_is_death_even_with_the_lock_held(store: Store, db_url: str) -> None:
    """A process that hangs while connected keeps its lock; its lease runs out all the same."""
    _publish(store, "q")
    lease_store, _ = _held_consumer(store, db_url)
    try:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("UPDATE pgskip.consumers SET lease_until = now() - interval '1 s'")
        assert store.sweep(max_attempts=20) == (1, 0, 1)
    finally:
        lease_store.close()


def test_a_consumer_being_renewed_is_skipped_then_found_alive(db_url: str) -> None:
    """Its process reconnected and renews with the lock of its new session: while that
    renewal holds the row, the sweep leaves it alone (SKIP LOCKED) rather than judge it by the
    key of its ended session; once committed, the new key is held."""
    with _store(db_url) as store:
        _publish(store, "q")
        old, cid = _held_consumer(store, db_url)
        _end(old, db_url)  # the row names a key nobody holds
        with psycopg.connect(db_url) as renewing:
            renewing.execute("SELECT pg_advisory_lock(42)")
            renewing.execute(
                "UPDATE pgskip.consumers SET lock_key = 42, heartbeat_at = now(),"
                " lock_server_start = pg_postmaster_start_time() WHERE id = %s",
                (cid,),
            )
            assert store.sweep(max_attempts=20) == (0, 0, 0)
            renewing.commit()
            assert store.sweep(max_attempts=20) == (0, 0, 0)
            assert _statuses(db_url) == ["running"]


@contextmanager
def _store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    try:
        yield s
    finally:
        s.close()


def test_a_lock_another_session_holds_is_not_taken_a_new_key_is(db_url: str) -> None:
    with _store(db_url) as first, _store(db_url) as second:
        lock = SessionLock()
        taken = lock.held_on(first)
        assert taken is not None and first.take_session_lock(taken)  # re-entrant for itself
        assert not second.take_session_lock(taken)
        other = SessionLock()
        other.key = taken
        assert other.held_on(second) not in (None, taken)
        assert {taken, other.key} <= _held_keys(db_url)


def test_a_reconnected_lease_session_takes_the_same_key_again(db_url: str) -> None:
    """The lock session alone ended (an operator's pg_terminate_backend): a sweep in between
    suspects the consumer; the same key, taken again and renewed within the grace, clears
    the suspicion."""
    holder = Holder()
    with _store(db_url) as store, _store(db_url) as sweeper:
        _publish(store, "q")
        store.register_consumer(holder.consumer_id, hostname="t", queues=["q"], lease=3600)
        assert len(store.fetch(["q"], 1, holder.consumer_id)) == 1
        leases = LeaseRenewal(lambda: [holder], 3600)
        assert leases.renew(store) == [holder.consumer_id]
        assert leases.lock is not None
        key = leases.lock.key
        with psycopg.connect(db_url, autocommit=True) as admin:
            pid = store.conn.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            _wait_for(
                lambda: (
                    not admin.execute("SELECT 1 FROM pg_locks WHERE pid = %s", (pid,)).fetchall()
                ),
                5,
                "the terminated session's locks released",
            )
        assert sweeper.sweep(max_attempts=20) == (0, 0, 0)
        assert sweeper.suspected_consumers() == 1
        with pytest.raises(psycopg.OperationalError):
            leases.renew(store)
        store.close()
        assert leases.renew(store) == [holder.consumer_id]
        assert leases.lock.key == key and key in _held_keys(db_url)
        assert _consumer_row(db_url, holder.consumer_id) == (key, True, True)
        assert sweeper.suspected_consumers() == 0
        _grace_over(db_url)
        assert sweeper.sweep(max_attempts=20) == (0, 0, 0)
        assert _statuses(db_url) == ["running"]


# -- housekeeping: bounded, and skipping what others do -----------------------------------------


@contextmanager
def _locked(db_url: str, statement: str) -> Iterator[psycopg.Connection[Any]]:
    """A session holding what ``statement`` locks until the block ends."""
    with psycopg.connect(db_url) as conn:
        conn.execute(statement)
        try:
            yield conn
        finally:
            conn.rollback()


def test_renewal_does_not_wait_for_locks_on_jobs_or_queues(store: Store, db_url: str) -> None:
    store.declare_queue("q", arguments={"x-expires": 60_000})
    holder = Holder()
    store.register_consumer(holder.consumer_id, hostname="t", queues=["q"], lease=3600)
    with _store(db_url) as lease_store:
        with _locked(db_url, "LOCK TABLE pgskip.jobs, pgskip.queues IN ACCESS EXCLUSIVE MODE"):
            done = threading.Event()
            renewed: list[uuid.UUID] = []

            def renew() -> None:
                renewed.extend(LeaseRenewal(lambda: [holder], 3600).renew(lease_store))
                done.set()

            threading.Thread(target=renew, daemon=True).start()
            assert done.wait(10), "the renewal waited for a lock on jobs or queues"
            assert renewed == [holder.consumer_id]
            started = time.monotonic()
            gave_up = (pg_errors.LockNotAvailable, pg_errors.QueryCanceled)
            with pytest.raises(gave_up), store.bounded(0.2):
                store.sweep(max_attempts=20)
            with pytest.raises(gave_up), store.bounded(0.2):
                store.mark_queues_used([holder.consumer_id])
            assert time.monotonic() - started < 5
        # The connection is fine after a timeout; the consumer lives (its lock is held).
        assert store.sweep(max_attempts=20) == (0, 0, 0)


def test_the_sweep_skips_a_consumer_row_another_session_has_locked(
    store: Store, db_url: str
) -> None:
    _publish(store, "q")
    lease_store, cid = _held_consumer(store, db_url)
    _end(lease_store, db_url)
    assert store.sweep(max_attempts=20) == (0, 0, 0)
    _grace_over(db_url)
    locked = f"SELECT 1 FROM pgskip.consumers WHERE id = '{cid}' FOR UPDATE"
    with _locked(db_url, locked), store.bounded(2):  # would raise if it waited for the row
        assert store.sweep(max_attempts=20) == (0, 0, 0)
    assert store.sweep(max_attempts=20) == (1, 0, 1)


def test_expired_messages_are_dropped_in_batches_skipping_locked_rows(
    store: Store, db_url: str
) -> None:
    store.declare_queue("ttl", arguments={"x-message-ttl": 1})
    _publish(store, "ttl", 7)
    time.sleep(0.05)
    with psycopg.connect(db_url) as conn:
        first = conn.execute("SELECT min(id) FROM pgskip.jobs").fetchone()
    assert first is not None
    locked = f"SELECT 1 FROM pgskip.jobs WHERE id = {first[0]} FOR UPDATE"
    with _locked(db_url, locked), store.bounded(2):
        assert store.drop_expired(limit=4) == 4
        assert store.drop_expired(limit=4) == 2  # the locked one is skipped, not waited for
    assert store.drop_expired(limit=4) == 1


def test_queues_used_are_marked_skipping_locked_queue_rows(store: Store, db_url: str) -> None:
    for name in ("a", "b"):
        store.declare_queue(name, arguments={"x-expires": 60_000})
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="t", queues=["a", "b"], lease=3600)
    locked = "SELECT 1 FROM pgskip.queues WHERE name = 'a' FOR UPDATE"
    with _locked(db_url, locked), store.bounded(2):
        assert store.mark_queues_used([cid]) == 1
    assert store.mark_queues_used([cid]) == 2


# -- the background thread ----------------------------------------------------------------------


@contextmanager
def _background(db_url: str, holders: list[Holder], **options: Any) -> Iterator[Background]:
    opts = Options(**{"lease_seconds": 3.0, "sweep_interval": 1.0, **options})
    thread = Background(db_url, opts, lambda: holders)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
        thread.join(10)


def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_background_thread_renews_while_jobs_is_locked(store: Store, db_url: str) -> None:
    holder = Holder()
    store.register_consumer(holder.consumer_id, hostname="t", queues=["q"], lease=3)
    with _background(db_url, [holder]):
        _wait_for(lambda: (_consumer_row(db_url, holder.consumer_id) or [None])[0], 5, "marked")
        with _locked(db_url, "LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE"):
            time.sleep(7)  # more than two leases
            with psycopg.connect(db_url) as conn:
                lease_left = conn.execute(
                    "SELECT extract(epoch FROM lease_until - now())::float8 FROM pgskip.consumers"
                ).fetchone()
            assert lease_left is not None and lease_left[0] > 1, "renewed all along"
        assert store.sweep(max_attempts=20) == (0, 0, 0)
        assert holder.lost == 0


def test_the_background_thread_locks_again_when_its_session_is_ended(
    store: Store, db_url: str
) -> None:
    _publish(store, "q")
    holder = Holder()
    store.register_consumer(holder.consumer_id, hostname="t", queues=["q"], lease=3600)
    assert len(store.fetch(["q"], 1, holder.consumer_id)) == 1
    with _background(db_url, [holder], lease_seconds=30.0, sweep_interval=60.0) as thread:
        _wait_for(lambda: (_consumer_row(db_url, holder.consumer_id) or [None])[0], 5, "marked")
        assert thread.leases.lock is not None
        key = thread.leases.lock.key
        with psycopg.connect(db_url, autocommit=True) as admin:
            (pid,) = admin.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND (classid::bigint << 32) | objid::bigint = %s",
                (key,),
            ).fetchone() or (None,)
            assert pid is not None
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # Seen at once (its next renewal is 10 s away), the same key taken again.
        _wait_for(lambda: key in _held_keys(db_url), 3, "the lock taken again")
        assert store.sweep(max_attempts=20) == (0, 0, 0)
        assert _statuses(db_url) == ["running"]
    # The thread has stopped: its session ended, and so did its consumer, once the grace is
    # over.
    _wait_for(lambda: store.sweep(max_attempts=20)[0] == 1, 10, "the consumer swept")


def test_poll_only_mode_takes_no_lock_and_keeps_the_lease_rule(store: Store, db_url: str) -> None:
    holder = Holder()
    store.register_consumer(holder.consumer_id, hostname="t", queues=["q"], lease=3)
    with _background(db_url, [holder], listen=False) as thread:
        assert thread.leases.lock is None
        time.sleep(1.5)
        assert _consumer_row(db_url, holder.consumer_id) == (None, False, True)
        assert not _held_keys(db_url)


def test_a_started_background_thread_sweeps_at_once(store: Store, db_url: str) -> None:
    """A worker started in place of a killed one returns its predecessor's messages without
    waiting for sweep_interval."""
    _publish(store, "q")
    lease_store, _ = _held_consumer(store, db_url)
    _end(lease_store, db_url)
    holder = Holder()
    store.register_consumer(holder.consumer_id, hostname="t", queues=["q"], lease=30)
    started = time.monotonic()
    with _background(db_url, [holder], lease_seconds=30.0, sweep_interval=600.0):
        # Its first sweep finds the lock released; it sweeps again once the grace is over.
        _wait_for(lambda: _statuses(db_url) == ["pending"], 10, "the dead consumer's message")
        assert time.monotonic() - started < LOCK_GRACE_S + 3


# -- roles ---------------------------------------------------------------------------------------


def test_a_worker_role_locks_and_sweeps_and_a_publisher_cannot_forge_a_key(
    pg_server: PgServer, db_url: str
) -> None:
    require_passwords(pg_server)
    dbname = db_url.rsplit("/", 1)[1]
    with (
        login_role(pg_server.dsn, databases=(dbname,)) as worker,
        login_role(pg_server.dsn, databases=(dbname,)) as publisher,
    ):
        apply_grants(
            db_url,
            grant_statements(dbname, "pgskip", workers=[worker.name], publishers=[publisher.name]),
        )
        with _store(worker.url(db_url)) as store:
            _publish(store, "q")
            lease_store, cid = _held_consumer(store, worker.url(db_url))
            assert store.sweep(max_attempts=20) == (0, 0, 0)
            with (
                psycopg.connect(publisher.url(db_url), autocommit=True) as conn,
                pytest.raises(pg_errors.InsufficientPrivilege),
            ):
                conn.execute(
                    sql.SQL("UPDATE pgskip.consumers SET lock_key = 1 WHERE id = {}").format(
                        sql.Literal(str(cid))
                    )
                )
            _end(lease_store, db_url)
            assert store.sweep(max_attempts=20) == (0, 0, 0)
            _grace_over(db_url)
            assert store.sweep(max_attempts=20) == (1, 0, 1)
