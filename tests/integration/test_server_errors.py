"""Server errors are classified by SQLSTATE on every path: those that pass reach kombu as
connection errors (it reconnects and retries, and a consumer goes on with nothing lost), the
others fail loudly, and in a caller's transaction they reach the caller.

Faults are injected into a real server: the jobs table is locked (ACCESS EXCLUSIVE) so that the
statement under test waits, found in ``pg_stat_activity`` by a piece of its text, and then
canceled (``pg_cancel_backend``), its session terminated (``pg_terminate_backend``), or ended
by the ``lock_timeout`` or ``statement_timeout`` its session got from ``ALTER DATABASE``.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from psycopg import errors as pg_errors
from psycopg import sql

from kombu_pgskip import apply_async_in
from kombu_pgskip.exceptions import (
    PermissionDenied,
    PersistentDatabaseError,
    SchemaNotInstalled,
    TransientDatabaseError,
    classify,
    psycopg_class,
)
from kombu_pgskip.fetcher import AsyncFetcher
from kombu_pgskip.store import Store
from kombu_pgskip.transport import Transport
from tests.publish_support import make_app

# Pieces of statements' texts, by which their sessions are found in pg_stat_activity (which
# keeps the first 1024 bytes of a statement): any of them.
#: ack_fetch (and ack_delete_fetch), and no other statement.
FETCH = ("WITH acked AS (",)
#: Every insert of a message: publish_routed, and the others.
INSERT = ("WITH targets AS (", "jobs (queue, priority, status, run_at")
#: Store.size.
SIZE = ('FROM "pgskip".jobs WHERE queue',)
#: The LISTEN connection's last statement.
LISTEN = ('LISTEN "pgskip:',)

#: The SQLSTATEs each fault may raise. A terminated session reports 57P01, or, when libpq
#: reads the end of the connection before the server's message, no SQLSTATE at all.
SQLSTATES: dict[str, set[str | None]] = {
    "cancel": {"57014"},
    "terminate": {"57P01", None},
    "statement_timeout": {"57014"},
    "lock_timeout": {"55P03"},
}
TIMEOUT_MS = 300


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _admin(db_url: str) -> psycopg.Connection[Any]:
    """A session of the test's own, never bounded by the timeouts set for the database."""
    return psycopg.connect(
        db_url, autocommit=True, options="-c lock_timeout=0 -c statement_timeout=0"
    )


_BACKEND = (
    "SELECT pid FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    "   AND EXISTS (SELECT FROM unnest(%s::text[]) AS m WHERE position(m in query) > 0)"
    "   AND (NOT %s OR wait_event_type = 'Lock')"
    " ORDER BY backend_start DESC LIMIT 1"
)


def _find_backend(db_url: str, marker: tuple[str, ...], *, waiting: bool) -> int | None:
    """The session of this database whose (last) statement contains one of ``marker``; with
    ``waiting``, only while that statement waits for a lock."""
    with _admin(db_url) as conn:
        row = conn.execute(_BACKEND, (list(marker), waiting)).fetchone()
    return None if row is None else int(row[0])


def _backend(db_url: str, marker: tuple[str, ...], *, waiting: bool, timeout: float = 10.0) -> int:
    """:func:`_find_backend`, waiting up to ``timeout`` seconds for it."""
    deadline = time.monotonic() + timeout
    with _admin(db_url) as conn:
        while True:
            row = conn.execute(_BACKEND, (list(marker), waiting)).fetchone()
            if row is not None:
                return int(row[0])
            if time.monotonic() > deadline:
                raise AssertionError(f"no session {'waits in' if waiting else 'ran'} {marker!r}")
            time.sleep(0.01)


def _set_timeout(db_url: str, kind: str, value: str | None) -> None:
    """``ALTER DATABASE ... SET kind`` (``RESET`` with ``None``): for its new sessions."""
    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    target = sql.SQL("ALTER DATABASE {} ").format(sql.Identifier(str(dbname)))
    if value is None:
        statement = target + sql.SQL("RESET {}").format(sql.Identifier(kind))
    else:
        statement = target + sql.SQL("SET {} = {}").format(sql.Identifier(kind), value)
    with _admin(db_url) as conn:
        conn.execute(statement)


class Fault:
    """A server error injected into the statement of ``db_url`` that contains ``marker``.

    :meth:`prepare` (before the sessions under test connect) sets the timeout a ``*_timeout``
    fault needs. Inside the ``with`` block the jobs table is locked by another session, so the
    statement waits; a thread then finds it and cancels it or terminates its session (the
    timeouts end it by themselves). The lock is held until the block ends, or, with
    ``release_after``, until the fault was injected: a retry then goes through.
    """

    def __init__(
        self,
        db_url: str,
        kind: str,
        *,
        marker: tuple[str, ...] = FETCH,
        release_after: bool = False,
    ) -> None:
        assert kind in SQLSTATES, kind
        self.db_url = db_url
        self.kind = kind
        self.marker = marker
        self.release_after = release_after
        self.sqlstates = SQLSTATES[kind]
        self.pid: int | None = None
        self._locked = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    @property
    def timeout(self) -> str | None:
        return self.kind if self.kind.endswith("_timeout") else None

    def prepare(self) -> Fault:
        if self.timeout:
            _set_timeout(self.db_url, self.timeout, str(TIMEOUT_MS))
        return self

    def __enter__(self) -> Fault:
        self._thread.start()
        assert self._locked.wait(10), "the jobs table could not be locked"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release.set()
        self._thread.join(20)
        if self.timeout:
            _set_timeout(self.db_url, self.timeout, None)
        if self._error is not None and exc is None:
            raise self._error

    def _run(self) -> None:
        try:
            with _admin(self.db_url) as holder, holder.transaction():
                holder.execute("LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE")
                self._locked.set()
                if not self.timeout:  # a timeout ends the wait by itself
                    self.pid = _backend(self.db_url, self.marker, waiting=True)
                    end = "cancel" if self.kind == "cancel" else "terminate"
                    with _admin(self.db_url) as admin:
                        admin.execute(f"SELECT pg_{end}_backend(%s)", (self.pid,))
                if not self.release_after:
                    self._release.wait(30)
        except BaseException as exc:
            self._error = exc
            self._locked.set()


def _assert_transient(exc: BaseException, sqlstates: set[str | None]) -> None:
    """``exc`` is what kombu reconnects for, and says what happened."""
    assert isinstance(exc, TransientDatabaseError), repr(exc)
    assert isinstance(exc, Transport.connection_errors)
    assert exc.sqlstate in sqlstates, (exc.sqlstate, str(exc))
    assert isinstance(exc.__cause__, psycopg.Error)
    if exc.sqlstate is not None:
        assert f"SQLSTATE {exc.sqlstate}" in str(exc)
        assert isinstance(exc, psycopg_class(exc.sqlstate))  # psycopg's except clauses match


def _statuses(db_url: str) -> dict[str, int]:
    with _admin(db_url) as conn:
        rows = conn.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _wait_all_completed(db_url: str, n: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (counts := _statuses(db_url)) != {"completed": n}:
        assert time.monotonic() < deadline, counts
        time.sleep(0.05)


# -- consuming ----------------------------------------------------------------------------------


class Consuming:
    """One kombu connection consuming ``queue``, each body's ``i`` recorded and acked: by
    blocking ``drain_events`` or on kombu's event loop (a Hub, as Celery runs it)."""

    def __init__(
        self, db_url: str, queue: Queue, got: list[int], *, loop: bool, **options: Any
    ) -> None:
        self.conn = Connection(_broker(db_url), transport_options=options)
        self.loop = loop
        self.hub: Hub | None = None

        def take(body: Any, message: Any) -> None:
            got.append(int(body["i"]))
            message.ack()

        Consumer(self.conn.channel(), [queue], callbacks=[take], prefetch_count=2).consume()
        if loop:
            self.hub = Hub()
            self.hub.propagate_errors = self.conn.connection_errors  # as Celery's worker sets
            self.conn.transport.register_with_event_loop(self.conn.connection, self.hub)

    def step(self) -> None:
        if self.hub is not None:
            self.hub.run_once()
        else:
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)

    def until(self, done: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.step()

    def running_until(self, find: Callable[[], int | None], timeout: float = 15.0) -> int:
        """Run until ``find()`` finds something; return it."""
        deadline = time.monotonic() + timeout
        while (found := find()) is None:
            assert time.monotonic() < deadline, "timed out"
            self.step()
        return found

    def error(self, timeout: float = 15.0) -> BaseException:
        """Run until an error comes out; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.step()
            except Exception as exc:
                return exc
        raise AssertionError(f"no error within {timeout} s")

    def close(self) -> None:
        if self.hub is not None:
            self.conn.transport.unregister_from_event_loop(self.conn.connection, self.hub)
            self.hub.close()
        self.conn.release()


def _publish(db_url: str, queue: Queue, ids: range) -> None:
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        for i in ids:
            producer.publish(
                {"i": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue]
            )


def _ride_out(
    db_url: str, fault: Fault, *, loop: bool, **options: Any
) -> tuple[BaseException, list[int]]:
    """Consume four messages, inject ``fault`` and get the error it raises, reconnect as
    kombu's consumers do (a new connection) and consume four more: (the error, every id
    received, in order)."""
    queue = Queue("faults", Exchange("faults"), "faults")
    got: list[int] = []
    fault.prepare()
    _publish(db_url, queue, range(4))
    consuming = Consuming(db_url, queue, got, loop=loop, **options)
    try:
        consuming.until(lambda: len(got) >= 4)
        with fault:
            error = consuming.error()
    finally:
        consuming.close()
    _publish(db_url, queue, range(4, 8))
    again = Consuming(db_url, queue, got, loop=loop, **options)
    try:
        again.until(lambda: set(got) >= set(range(8)))
    finally:
        again.close()
    _wait_all_completed(db_url, 8)
    return error, got


#: The fetch paths: the fetcher's connection (AsyncFetcher) from blocking drain_events and from
#: the event loop, and Store.ack_fetch through psycopg on the consumer connection.
MODES = {
    "drain": {"loop": False},
    "event-loop": {"loop": True},
    "sync-fetch": {"loop": False, "async_fetch": False},
}


@pytest.mark.parametrize("kind", list(SQLSTATES))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_fault_on_the_fetch_is_a_connection_error_and_the_consumer_goes_on(
    db_url: str, mode: str, kind: str
) -> None:
    fault = Fault(db_url, kind)
    error, got = _ride_out(db_url, fault, **MODES[mode])
    _assert_transient(error, fault.sqlstates)
    assert sorted(set(got)) == list(range(8))
    # The four acked before the fault were written (with the failed fetch's acks queued
    # again, or at close): none of them ran twice.
    assert got[:4] == [0, 1, 2, 3] and not set(got[4:]) & {0, 1, 2, 3}, got


@pytest.mark.parametrize("mode", ["drain", "event-loop"])
def test_the_listen_connection_terminated_is_a_connection_error(db_url: str, mode: str) -> None:
    queue = Queue("faults", Exchange("faults"), "faults")
    got: list[int] = []
    _publish(db_url, queue, range(2))
    consuming = Consuming(db_url, queue, got, **MODES[mode])
    try:
        consuming.until(lambda: len(got) >= 2)
        # A blocking drain opens the LISTEN connection when it first waits.
        pid = consuming.running_until(lambda: _find_backend(db_url, LISTEN, waiting=False))
        with _admin(db_url) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        error = consuming.error()
    finally:
        consuming.close()
    _assert_transient(error, {None, "57P01"})
    _publish(db_url, queue, range(2, 4))
    again = Consuming(db_url, queue, got, **MODES[mode])
    try:
        again.until(lambda: set(got) >= set(range(4)))
    finally:
        again.close()
    assert got == [0, 1, 2, 3]


def test_the_idle_fetch_connection_terminated_raises_on_the_next_fetch_and_reopens(
    db_url: str,
) -> None:
    """The fetcher's own calls: its send (or the poll after it) finds the session gone; the
    fetch after that runs on a new connection."""
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    me = uuid.uuid4()
    try:
        fetcher.send([], ["idle"], 1, me)
        assert fetcher.wait() == (0, [], 1)
        assert fetcher._conn is not None
        pid = fetcher._conn.info.backend_pid
        with _admin(db_url) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            admin.execute("SELECT pg_sleep(0.1)")
        with pytest.raises(Exception) as info:
            fetcher.send([], ["idle"], 1, me)
            fetcher.wait()
        _assert_transient(info.value, {"57P01", None})
        assert not fetcher.in_flight
        fetcher.send([], ["idle"], 1, me)
        assert fetcher.wait() == (0, [], 1)
        assert fetcher._conn is not None and fetcher._conn.info.backend_pid != pid
    finally:
        fetcher.close()


def test_the_fetch_statement_that_cannot_be_prepared_says_what_to_do(db_url: str) -> None:
    with _admin(db_url) as admin:
        admin.execute("DROP SCHEMA pgskip CASCADE")
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    try:
        with pytest.raises(SchemaNotInstalled, match="SQLSTATE 42P01"):
            fetcher.send([], ["q"], 1, uuid.uuid4())
        assert fetcher._conn is None
    finally:
        fetcher.close()


# -- publishing and the store's own statements ---------------------------------------------------


@pytest.mark.parametrize("exchange", ["routed", "default"])
def test_a_canceled_publish_raises_or_is_retried_once(db_url: str, exchange: str) -> None:
    """A routed publish is one statement through libpq; a publish to the default exchange is
    its insert and its NOTIFY down one pipeline (run_then)."""
    queue = Queue("pub", Exchange("pub"), "pub")
    target = (
        {"exchange": queue.exchange, "routing_key": "pub"}
        if exchange == "routed"
        else {"exchange": "", "routing_key": "pub"}
    )
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        queue(conn.channel()).declare()
        with Fault(db_url, "cancel", marker=INSERT), pytest.raises(Exception) as info:
            producer.publish({"i": 0}, retry=False, **target)
        _assert_transient(info.value, {"57014"})
        assert _statuses(db_url) == {}
        # kombu retries what its connection_errors hold: reconnected, it publishes once.
        with Fault(db_url, "cancel", marker=INSERT, release_after=True):
            producer.publish({"i": 1}, retry=True, retry_policy={"max_retries": 3}, **target)
    assert _statuses(db_url) == {"pending": 1}


@pytest.mark.parametrize("kind", ["cancel", "terminate"])
def test_the_stores_statements_raise_transient_errors_and_reconnect(db_url: str, kind: str) -> None:
    """Through psycopg's own execute (Store.execute), the sync path of every ack and
    declaration."""
    store = Store(db_url)
    try:
        assert store.size("q") == 0
        with Fault(db_url, kind, marker=SIZE), pytest.raises(Exception) as info:
            store.size("q")
        _assert_transient(info.value, SQLSTATES[kind])
        assert store.size("q") == 0  # the same store goes on (on a new session if need be)
    finally:
        store.close()


def test_a_lock_timeout_in_the_callers_transaction_reaches_the_caller_unretried(
    db_url: str,
) -> None:
    app = make_app(db_url)
    try:
        with Fault(db_url, "lock_timeout", marker=INSERT), psycopg.connect(db_url) as conn:
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{TIMEOUT_MS}ms",))
            with pytest.raises(pg_errors.LockNotAvailable) as info:
                apply_async_in(conn, app.tasks["txn.add"], args=(1, 2))
            # Not retried: a second try in the aborted transaction would have raised
            # "current transaction is aborted" instead.
            assert info.value.sqlstate == "55P03"
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
            conn.rollback()
    finally:
        app.close()
    assert _statuses(db_url) == {}


# -- errors that do not pass --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["drain", "event-loop"])
def test_a_dropped_schema_fails_loudly_on_the_fetch(db_url: str, mode: str) -> None:
    queue = Queue("faults", Exchange("faults"), "faults")
    got: list[int] = []
    _publish(db_url, queue, range(2))
    consuming = Consuming(db_url, queue, got, **MODES[mode])
    try:
        consuming.until(lambda: len(got) >= 2)
        with _admin(db_url) as admin:
            # The drop locks the partitions of jobs one by one, and a fetch running meanwhile
            # locks them in another order: the server may take the drop for a deadlock.
            for _ in range(5):
                try:
                    admin.execute("DROP SCHEMA pgskip CASCADE")
                    break
                except pg_errors.DeadlockDetected:
                    continue
        error = consuming.error()
    finally:
        with contextlib.suppress(Exception):  # the schema is gone: nothing to unregister
            consuming.close()
    assert isinstance(error, SchemaNotInstalled), repr(error)
    assert not isinstance(error, Transport.connection_errors)
    assert "SQLSTATE 42P01" in str(error) and "pgskip migrate" in str(error)


def test_a_value_the_server_refuses_fails_loudly_with_its_sqlstate(db_url: str) -> None:
    store = Store(db_url)
    try:
        with pytest.raises(PersistentDatabaseError) as info:
            store.run(sql.SQL("SELECT 'not a number'::int"), {})
        error = info.value
        assert isinstance(error, pg_errors.InvalidTextRepresentation)
        assert not isinstance(error, Transport.connection_errors)
        assert error.sqlstate == "22P02" and "SQLSTATE 22P02" in str(error)
        assert "not retried" in str(error)
        assert error.diag.message_primary is not None  # the server's diagnostics are kept
    finally:
        store.close()


# -- the table ----------------------------------------------------------------------------------

TRANSIENT = [
    "08000", "08006", "08P01", "40001", "40P01", "40003", "53000", "53100", "53200", "53300",
    "55P03", "57014", "57P01", "57P02", "57P03", "57P05", "58000", "58030", "25P03", "26000",
]  # fmt: skip
PERSISTENT = ["22P02", "23505", "40002", "54000", "55000", "57P04", "58P01", "0A000", "XX000"]


@pytest.mark.parametrize("sqlstate", TRANSIENT)
def test_transient_sqlstates_are_connection_errors(sqlstate: str) -> None:
    original = psycopg_class(sqlstate)("boom")
    error = classify(original, url_for_messages="pgskip://host/db")
    _assert_transient(error, {sqlstate})
    assert error.__cause__ is original
    assert "pgskip://host/db" in str(error) and "boom" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, TransientDatabaseError) and type(copy) is type(error)
    assert copy.sqlstate == sqlstate and str(copy) == str(error)


@pytest.mark.parametrize("sqlstate", PERSISTENT)
def test_other_sqlstates_are_not_retried(sqlstate: str) -> None:
    original = psycopg_class(sqlstate)("boom")
    error = classify(original)
    assert isinstance(error, PersistentDatabaseError)
    assert not isinstance(error, Transport.connection_errors)
    assert error.sqlstate == sqlstate and f"SQLSTATE {sqlstate}" in str(error)
    if not issubclass(type(original), psycopg.OperationalError):
        assert isinstance(error, type(original))
    pickle.loads(pickle.dumps(error))


@pytest.mark.parametrize(
    ("sqlstate", "cls"), [("42P01", SchemaNotInstalled), ("42501", PermissionDenied)]
)
def test_sqlstates_with_a_meaning_keep_their_translation(sqlstate: str, cls: type) -> None:
    error = classify(psycopg_class(sqlstate)("boom"))
    assert isinstance(error, cls) and f"SQLSTATE {sqlstate}" in str(error)
    assert not isinstance(error, Transport.connection_errors)


def test_a_lost_connection_is_transient_without_a_sqlstate() -> None:
    error = classify(psycopg.OperationalError("consuming input failed: server closed"))
    _assert_transient(error, {None})
    assert "lost" in str(error)


def test_the_callers_errors_keep_their_class() -> None:
    """What translating() leaves for a caller: psycopg's class, even for a transient error."""
    from kombu_pgskip.exceptions import translating

    with pytest.raises(pg_errors.DeadlockDetected), translating(url_for_messages="x"):
        raise pg_errors.DeadlockDetected("boom")
    with pytest.raises(pg_errors.ProgramLimitExceeded) as info, translating(url_for_messages="x"):
        raise pg_errors.ProgramLimitExceeded("boom")
    assert type(info.value) is pg_errors.ProgramLimitExceeded
