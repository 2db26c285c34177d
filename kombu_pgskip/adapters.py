"""Run kombu-pgskip's statements on a connection that belongs to the caller.

One adapter per driver family: psycopg 3, psycopg2, SQLAlchemy (over psycopg or psycopg2) and
Django (over either). An adapter

* tells whether the connection can take the job *in a transaction* (:meth:`Adapter.check`):
  it is open, its transaction is not aborted, and it is not in autocommit mode outside an
  explicit transaction (where the job would be committed on its own);
* runs one statement and returns its rows as tuples (:meth:`Adapter.run`), translating the
  driver's errors that have a clearer meaning (by SQLSTATE, never by message text);
* where the driver or framework has an after-commit hook (Django's ``on_commit``, a
  SQLAlchemy ``Session``'s ``after_commit`` event, a :func:`kombu_pgskip.transaction` block
  on psycopg 3), keeps callbacks to run once the caller's transaction has committed
  (:meth:`Adapter.after_commit`), dropped with a savepoint rolled back.

An adapter never commits, rolls back or closes the caller's transaction or connection, and
never opens one: the one statement a callback runs after the caller's commit is committed on
its own.
Only the driver modules the caller already imported are looked at: nothing here imports
psycopg2, SQLAlchemy or Django.
"""

from __future__ import annotations

import sys
import threading
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

import psycopg
from psycopg import pq, sql
from psycopg.rows import tuple_row

from . import exceptions
from .sql import quote_ident

Rows = list[tuple[Any, ...]]
#: a statement as psycopg 3 takes it
Query = sql.SQL | sql.Composed

# libpq's PGTransactionStatusType; psycopg2's TRANSACTION_STATUS_* constants have the same values.
_IDLE = int(pq.TransactionStatus.IDLE)
_INERROR = int(pq.TransactionStatus.INERROR)
_UNKNOWN = int(pq.TransactionStatus.UNKNOWN)

_IN_FAILED_SQL_TRANSACTION = "25P02"


class AfterCommit(Protocol):
    """A callback run once the caller's transaction has committed, found again by its key."""

    after_commit_key: Hashable

    def __call__(self) -> None: ...

    def merge(self, other: Any) -> None:
        """Take in what ``other``, a callback with the same key, was to do."""


_C = TypeVar("_C", bound=AfterCommit)


def pyformat_text(template: str, schema: str) -> str:
    """A runtime SQL block with the schema quoted in, for drivers that take ``%(name)s``.

    The blocks use the ``str.format`` syntax that :meth:`psycopg.sql.SQL.format` also follows
    (``{schema}``, ``{{`` for a literal brace), so both render the same statement.
    """
    return template.format(schema=quote_ident(schema))


class Adapter(ABC):
    """The caller's connection, seen by kombu-pgskip."""

    #: the driver family, for messages
    driver: ClassVar[str]

    @abstractmethod
    def check(self) -> None:
        """Raise unless a statement run now lands in a transaction the caller will end.

        :class:`~kombu_pgskip.exceptions.ConnectionClosed`,
        :class:`~kombu_pgskip.exceptions.TransactionAborted` or
        :class:`~kombu_pgskip.exceptions.ConnectionInAutocommit`.
        """

    @abstractmethod
    def identity(self) -> object | None:
        """The driver's connection object (one server session), or ``None`` if unknown yet."""

    @abstractmethod
    def _execute(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        """Run the statement (``query`` for psycopg 3, ``text`` for pyformat drivers)."""

    def after_commit(self, key: Hashable, make: Callable[[], _C]) -> _C | None:
        """The callback with ``key`` that runs once the caller's transaction has committed,
        and never if it rolls back, shared by everything written at the current savepoint:
        the first call there makes it (``make()``) and registers it, later ones get it back
        and add to it. A rolled-back savepoint drops its callbacks with what it wrote, and
        what an outer level wrote never shares a callback with an inner savepoint's. ``None``
        where the driver offers no such hook (then the NOTIFY stays in the caller's
        transaction). Asked before the statement that the callback follows is run."""
        return None

    def run_after_commit(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        """Run a statement from a callback of :meth:`after_commit`, once the caller's
        transaction has committed (Django: in autocommit mode again, as :meth:`run`)."""
        return self.run(query, text, params)

    def run(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        """Run one statement on the caller's connection and return its rows as tuples."""
        try:
            return self._execute(query, text, params)
        except exceptions.PgSkipError:
            raise
        except Exception as exc:
            translated = translate_driver_error(exc)
            if translated is None:
                raise
            raise translated from exc

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


def _check_status(status: int, autocommit: bool, driver: str) -> None:
    """The rule shared by psycopg 3 and psycopg2 (same libpq status values).

    Not in autocommit mode, an idle connection is fine: the driver opens a transaction with the
    first statement, which the caller commits or rolls back. In autocommit mode only an explicit
    transaction block (psycopg's ``conn.transaction()``, a ``BEGIN``) makes the write wait for
    the caller's commit.
    """
    if status == _UNKNOWN:
        raise exceptions.ConnectionClosed(
            f"the {driver} connection is broken (transaction status unknown): "
            "open a new connection and a new transaction"
        )
    if status == _INERROR:
        raise exceptions.TransactionAborted()
    if autocommit and status == _IDLE:
        raise exceptions.ConnectionInAutocommit()


def _check_driver_connection(raw: Any, driver: str) -> None:
    """:func:`_check_status` for a raw psycopg 3 or psycopg2 connection."""
    if isinstance(raw, psycopg.Connection):
        if raw.closed:
            raise exceptions.ConnectionClosed()
        _check_status(int(raw.info.transaction_status), raw.autocommit, driver)
        return
    if _is_psycopg2_connection(raw):
        if raw.closed:
            raise exceptions.ConnectionClosed()
        _check_status(int(raw.get_transaction_status()), bool(raw.autocommit), driver)


def _is_psycopg2_connection(obj: object) -> bool:
    ext = sys.modules.get("psycopg2.extensions")
    return ext is not None and isinstance(obj, ext.connection)


def _psycopg2_params(params: Mapping[str, Any]) -> dict[str, Any]:
    # psycopg2 adapts lists (to arrays), datetimes and None itself, but not UUIDs unless the
    # application registered an adapter; the statements cast them (``::uuid``) anyway.
    def plain(value: Any) -> Any:
        if isinstance(value, uuid.UUID):
            return str(value)
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return {k: plain(v) for k, v in params.items()}


class AfterCommitCallbacks:
    """The callbacks written at one level of a caller's transaction (the transaction, or a
    savepoint in it), to run once the transaction has committed."""

    def __init__(self) -> None:
        self.callbacks: list[AfterCommit] = []

    def find_or_add(self, key: Hashable, make: Callable[[], _C]) -> _C:
        """The callback with ``key``; made and added by ``make()`` if there is none yet."""
        found = self.find(key)
        if found is not None:
            return found  # type: ignore[return-value]
        made = make()
        self.callbacks.append(made)
        return made

    def find(self, key: Hashable) -> AfterCommit | None:
        """This block's callback with ``key``, if any."""
        return next((c for c in self.callbacks if c.after_commit_key == key), None)

    def absorb(self, callbacks: list[AfterCommit]) -> None:
        """Take over the callbacks of a block nested in this one that was kept (its savepoint
        released): from now on their fate is this block's, so each is merged into this
        block's callback with the same key, if any."""
        for callback in callbacks:
            mine = self.find(callback.after_commit_key)
            if mine is None:
                self.callbacks.append(callback)
            else:
                mine.merge(callback)


class AfterCommitBlock(AfterCommitCallbacks):
    """One :func:`kombu_pgskip.transaction` block open on a psycopg 3 connection.

    ``depth`` is psycopg's count of transaction blocks open on the connection just inside this
    one, or ``None`` where nothing can be deferred (the block does not end in a commit of ours
    to wait for: the connection was already in a transaction, or in pipeline mode)."""

    def __init__(self, depth: int | None) -> None:
        super().__init__()
        self.depth = depth


#: the kombu_pgskip.transaction() blocks open on each psycopg 3 connection, innermost last
_after_commit_blocks: weakref.WeakKeyDictionary[Any, list[AfterCommitBlock]] = (
    weakref.WeakKeyDictionary()
)
_after_commit_lock = threading.Lock()


def after_commit_blocks(conn: psycopg.Connection[Any]) -> list[AfterCommitBlock]:
    """The stack of :class:`AfterCommitBlock` of ``conn`` (created empty)."""
    with _after_commit_lock:
        return _after_commit_blocks.setdefault(conn, [])


def psycopg_depth(conn: psycopg.Connection[Any]) -> int | None:
    """How many ``conn.transaction()`` blocks are open on ``conn`` (psycopg keeps the count
    in a private attribute; ``None`` where a psycopg version has no such count)."""
    depth = getattr(conn, "_num_transactions", None)
    return depth if isinstance(depth, int) else None


class PsycopgAdapter(Adapter):
    """A psycopg 3 connection (a cursor is accepted and its connection used)."""

    driver = "psycopg"

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def check(self) -> None:
        _check_driver_connection(self.conn, self.driver)

    def identity(self) -> object:
        return self.conn

    def after_commit(self, key: Hashable, make: Callable[[], _C]) -> _C | None:
        """Inside a :func:`kombu_pgskip.transaction` block only, and only while no other
        transaction block (a savepoint of the caller's own, ``conn.transaction()``) is open
        inside it: such a block may roll back without our knowing, so what is written in it
        keeps its NOTIFY inside, where a rollback drops it."""
        with _after_commit_lock:
            blocks = _after_commit_blocks.get(self.conn)
        if not blocks:
            return None
        block = blocks[-1]
        if block.depth is None or psycopg_depth(self.conn) != block.depth:
            return None
        return block.find_or_add(key, make)

    def _execute(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        # A plain cursor whatever the connection's cursor_factory (a RawCursor would not take
        # %(name)s) or row_factory (we want tuples).
        with psycopg.Cursor(self.conn, row_factory=tuple_row) as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description is not None else []


class Psycopg2Adapter(Adapter):
    """A psycopg2 connection (a cursor is accepted and its connection used)."""

    driver = "psycopg2"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def check(self) -> None:
        _check_driver_connection(self.conn, self.driver)

    def identity(self) -> object:
        return self.conn

    def _execute(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        ext = sys.modules["psycopg2.extensions"]
        # The plain cursor class, whatever cursor_factory the connection has (a RealDictCursor
        # would return dicts). ``with cursor`` closes the cursor only; it does not commit.
        with self.conn.cursor(cursor_factory=ext.cursor) as cur:
            cur.execute(text, _psycopg2_params(params))
            return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []


#: what each SQLAlchemy ``SessionTransaction`` (a session's transaction, or a savepoint of
#: it) owes after the commit
_session_levels: weakref.WeakKeyDictionary[Any, AfterCommitCallbacks] = weakref.WeakKeyDictionary()
#: the sessions whose commits are watched (see SQLAlchemyAdapter.after_commit)
_watched_sessions: weakref.WeakSet[Any] = weakref.WeakSet()


def _session_level(transaction: Any) -> AfterCommitCallbacks:
    with _after_commit_lock:
        level = _session_levels.get(transaction)
        if level is None:
            level = _session_levels[transaction] = AfterCommitCallbacks()
        return level


def _session_committed(session: Any) -> None:
    """SQLAlchemy's ``after_commit``: a savepoint was released (the session's nested
    transaction is the one committing), or the session's transaction committed. What a
    released savepoint owed now belongs to the level around it; what the transaction owed
    runs now, while the session still holds the connection that committed."""
    nested = session.get_nested_transaction()
    committing = nested if nested is not None else session.get_transaction()
    with _after_commit_lock:
        level = _session_levels.pop(committing, None) if committing is not None else None
    if level is None:
        return
    if nested is not None:
        _session_level(_enclosing_level(nested)).absorb(level.callbacks)
        return
    for callback in level.callbacks:
        callback()


def _enclosing_level(nested: Any) -> Any:
    """The session transaction, or the savepoint, that ``nested`` (a savepoint) is inside."""
    parent = nested.parent
    while parent.parent is not None and not parent.nested:
        parent = parent.parent
    return parent


class SQLAlchemyAdapter(Adapter):
    """A SQLAlchemy 2 ``Connection`` (a ``Session`` is accepted: its ``connection()`` is used).

    Statements go through ``Connection.exec_driver_sql``, so SQLAlchemy knows about them: it
    begins its transaction if it had not yet ("autobegin"), and a later ``commit()`` commits
    the job with everything else.
    """

    driver = "SQLAlchemy"
    _DRIVERS: ClassVar[frozenset[str]] = frozenset({"psycopg", "psycopg2"})

    def __init__(self, conn: Any) -> None:
        dialect = conn.dialect
        if dialect.name != "postgresql" or dialect.driver not in self._DRIVERS:
            raise exceptions.NotAConnection(
                f"SQLAlchemy connection to {dialect.name}+{dialect.driver}: apply_async_in "
                "supports PostgreSQL through psycopg (postgresql+psycopg://) or psycopg2 "
                "(postgresql+psycopg2://)"
            )
        self.conn = conn
        self._pg2 = dialect.driver == "psycopg2"
        self.session: Any = None  # the Session the connection came from, if any

    @classmethod
    def from_session(cls, session: Any) -> SQLAlchemyAdapter:
        try:
            # Begins the session's transaction if it had not yet, as a query would.
            conn = session.connection()
        except Exception as exc:
            _raise_sqlalchemy_state_error(exc)
            raise
        adapter = cls(conn)
        adapter.session = session
        return adapter

    def after_commit(self, key: Hashable, make: Callable[[], _C]) -> _C | None:
        """Given a ``Session`` only, through its ``after_commit`` event, which SQLAlchemy
        fires once the connection has committed and before the session lets go of it (and
        also when a savepoint of ``begin_nested()`` is released). A callback belongs to the
        session's innermost transaction level when it is made: one that is rolled back
        (``rollback()``, a savepoint rolled back) takes it away, one released hands it to
        the level around it. Not for a bare ``Connection`` (Core has no after-commit event),
        nor, outside the session's own savepoints, while a savepoint opened on the
        connection itself (which the session does not know of) is open. Such a savepoint
        opened inside one of the session's is not seen: rolled back, it leaves a wake-up for
        jobs that do not exist (an empty fetch), never a job without one."""
        session = self.session
        if session is None:
            return None
        level = session.get_nested_transaction()
        if level is None:
            if self.conn.get_nested_transaction() is not None:
                return None
            level = session.get_transaction()
            if level is None:
                return None
        with _after_commit_lock:
            if session not in _watched_sessions:
                sys.modules["sqlalchemy"].event.listen(session, "after_commit", _session_committed)
                _watched_sessions.add(session)
        return _session_level(level).find_or_add(key, make)

    def run_after_commit(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        """On the driver's own connection (psycopg2 here: a psycopg 3 one is run through
        libpq before this is asked). SQLAlchemy's ``Connection`` has committed and would
        begin a new transaction, which the session rolls back as it lets go of the
        connection. With no transaction open the statement is committed on its own; where
        the session's commit did not end the connection's transaction (a session joined to a
        transaction of the caller's), it runs in that one, which commits it or not."""
        raw = self.identity()
        # Idle: in autocommit for this statement only (psycopg2 would otherwise send a BEGIN
        # and then need a COMMIT, two more round trips); the switch itself sends nothing.
        switch = int(raw.get_transaction_status()) == _IDLE and not raw.autocommit
        ext = sys.modules["psycopg2.extensions"]
        if switch:
            raw.autocommit = True
        try:
            with raw.cursor(cursor_factory=ext.cursor) as cur:
                cur.execute(text, _psycopg2_params(params))
                return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []
        finally:
            if switch:
                raw.autocommit = False

    def check(self) -> None:
        conn = self.conn
        if conn.closed or conn.invalidated:
            raise exceptions.ConnectionClosed()
        trans = conn.get_transaction()
        if trans is not None and not trans.is_active:
            # An inner block failed; SQLAlchemy refuses statements until it is rolled back.
            raise exceptions.TransactionAborted()
        _check_driver_connection(self.identity(), self.driver)

    def identity(self) -> Any:
        return self.conn.connection.dbapi_connection

    def _execute(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        args = _psycopg2_params(params) if self._pg2 else dict(params)
        result = self.conn.exec_driver_sql(text, args)
        return [tuple(r) for r in result.fetchall()] if result.returns_rows else []


def _raise_sqlalchemy_state_error(exc: BaseException) -> None:
    """Translate SQLAlchemy's "the transaction must be rolled back first" and "closed" errors."""
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is None:
        return
    if isinstance(exc, sa_exc.PendingRollbackError):
        raise exceptions.TransactionAborted() from exc
    if isinstance(exc, sa_exc.ResourceClosedError):
        raise exceptions.ConnectionClosed() from exc


class DjangoAdapter(Adapter):
    """Django's ``connection`` (or ``connections[alias]``) on the PostgreSQL backend.

    The job must be written inside ``transaction.atomic()`` (or with autocommit turned off):
    in Django's default autocommit mode every statement commits on its own.
    """

    driver = "Django"

    def __init__(self, connection: Any) -> None:
        if getattr(connection, "vendor", None) != "postgresql":
            raise exceptions.NotAConnection(
                f"Django database {getattr(connection, 'alias', '?')!r} uses the "
                f"{getattr(connection, 'vendor', '?')} backend: apply_async_in needs PostgreSQL"
            )
        self.connection = connection
        self._pg2 = getattr(connection.Database, "__name__", "") == "psycopg2"

    def check(self) -> None:
        c = self.connection
        if c.needs_rollback:
            raise exceptions.TransactionAborted(
                f"{exceptions.TransactionAborted.default_message()} (Django: an error occurred "
                "in the current atomic block; leave it before enqueuing)"
            )
        if not c.in_atomic_block and c.get_autocommit():
            raise exceptions.ConnectionInAutocommit(
                "Django's connection is in autocommit mode outside transaction.atomic(): the "
                "job would be committed on its own, whatever your transaction does. Enqueue "
                "inside `with transaction.atomic():`"
            )
        raw = self.identity()
        if raw is not None:
            _check_driver_connection(raw, self.driver)

    def identity(self) -> object | None:
        raw: object | None = self.connection.connection
        return raw

    def after_commit(self, key: Hashable, make: Callable[[], _C]) -> _C | None:
        """Through the connection's ``on_commit`` (what ``transaction.on_commit`` calls),
        inside ``atomic()`` only (with autocommit turned off by hand Django refuses it). Django
        runs the callback right after the outermost ``atomic()`` block commits, and drops it if
        a savepoint that was open when it was registered rolls back: a callback is shared only
        by writes made with the same savepoints open, whose fate is the same."""
        conn = self.connection
        if not conn.in_atomic_block:
            return None
        open_savepoints = set(conn.savepoint_ids)
        # Django keeps (savepoint ids, callback[, robust]) per registration, in order.
        for entry in reversed(getattr(conn, "run_on_commit", None) or ()):
            callback = entry[1]
            if entry[0] == open_savepoints and getattr(callback, "after_commit_key", None) == key:
                found: _C = callback
                return found
        made = make()
        conn.on_commit(made)
        return made

    def _execute(self, query: Query, text: str, params: Mapping[str, Any]) -> Rows:
        args = _psycopg2_params(params) if self._pg2 else dict(params)
        with self.connection.cursor() as cur:
            cur.execute(text, args)
            return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []


def _looks_like_django_connection(obj: object) -> bool:
    # Duck-typed: django.db.connection is a ConnectionProxy that forwards attribute access.
    return (
        callable(getattr(obj, "get_autocommit", None))
        and hasattr(obj, "in_atomic_block")
        and hasattr(obj, "vendor")
        and callable(getattr(obj, "cursor", None))
    )


def adapt(obj: object) -> Adapter:
    """The adapter for the caller's connection object, or :class:`NotAConnection`."""
    if isinstance(obj, psycopg.Connection):
        return PsycopgAdapter(obj)
    if isinstance(obj, psycopg.Cursor):
        return PsycopgAdapter(obj.connection)
    if isinstance(obj, (psycopg.AsyncConnection, psycopg.AsyncCursor)):
        raise exceptions.NotAConnection(
            "async psycopg connections are not supported by apply_async_in (Celery publishes "
            "synchronously): use a sync psycopg.Connection"
        )
    ext = sys.modules.get("psycopg2.extensions")
    if ext is not None:
        if isinstance(obj, ext.connection):
            return Psycopg2Adapter(obj)
        if isinstance(obj, ext.cursor):
            return Psycopg2Adapter(obj.connection)
    adapter = _sqlalchemy_adapter(obj)
    if adapter is not None:
        return adapter
    if _looks_like_django_connection(obj):
        return DjangoAdapter(obj)
    kind = type(obj)
    raise exceptions.NotAConnection(
        f"{exceptions.NotAConnection.default_message()} Got {kind.__module__}.{kind.__qualname__}"
    )


def _sqlalchemy_adapter(obj: object) -> Adapter | None:
    engine = sys.modules.get("sqlalchemy.engine")
    if engine is None:
        return None
    if isinstance(obj, engine.Connection):
        return SQLAlchemyAdapter(obj)
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None:
        if isinstance(obj, orm.scoped_session):
            obj = obj()  # the session of the current scope
        if isinstance(obj, orm.Session):
            return SQLAlchemyAdapter.from_session(obj)
    if isinstance(obj, engine.Engine):
        raise exceptions.NotAConnection(
            "a SQLAlchemy Engine is not a connection: pass the Connection of your transaction "
            "(`with engine.begin() as conn: apply_async_in(conn, ...)`) or a Session"
        )
    asyncio_ext = sys.modules.get("sqlalchemy.ext.asyncio")
    if asyncio_ext is not None and isinstance(
        obj, (asyncio_ext.AsyncConnection, asyncio_ext.AsyncSession)
    ):
        raise exceptions.NotAConnection(
            "async SQLAlchemy connections are not supported by apply_async_in (Celery "
            "publishes synchronously): use a sync Connection or Session"
        )
    return None


class _Coded(Exception):
    """A stand-in carrying only a SQLSTATE, for :func:`exceptions.translate`."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error, through SQLAlchemy's ``.orig`` and Django's chaining."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(code, str):
            return code
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


def translate_driver_error(exc: BaseException) -> exceptions.PgSkipError | None:
    """The kombu-pgskip error for any driver's error, by SQLSTATE; ``None`` to re-raise as is."""
    code = sqlstate_of(exc)
    if code is None:
        return None
    if code == _IN_FAILED_SQL_TRANSACTION:
        return exceptions.TransactionAborted()
    translated = exceptions.translate(_Coded(code))
    return translated if isinstance(translated, exceptions.PgSkipError) else None


__all__ = [
    "Adapter",
    "DjangoAdapter",
    "Psycopg2Adapter",
    "PsycopgAdapter",
    "Query",
    "SQLAlchemyAdapter",
    "adapt",
    "pyformat_text",
    "quote_ident",
    "sqlstate_of",
    "translate_driver_error",
]
