"""Where a :class:`~kombu_pgskip.store.Store` runs its statements: the executor.

A store holds the broker's operations: every runtime statement (``sql/*.sql``) by name, and the
one rule that decides where the NOTIFY of an insert goes
(:meth:`~kombu_pgskip.store.Store._notify_placement`). An executor runs the statements it is
given on one database session and answers the questions that rule asks about that session.
The same store operations therefore run on either executor:

* :class:`OwnConnection`: a psycopg connection the executor opens itself, in autocommit mode
  (each statement is a transaction of its own), opened lazily, reopened after it broke and
  never shared with a forked child; the statements run once per message are prepared and run
  through libpq (:mod:`kombu_pgskip.libpq`);
* :class:`CallerConnection`: a connection that belongs to the caller (``apply_async_in``),
  reached through an :class:`~kombu_pgskip.adapters.Adapter`. Every statement lands in the
  caller's transaction; nothing here opens, commits, rolls back or closes it. Where the
  caller's driver has an after-commit hook, it collects the NOTIFYs that transaction owes and
  sends them once it has committed (:meth:`CallerConnection.wakes`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg import pq, sql

from . import exceptions
from .adapters import Adapter, Query, pyformat_text
from .libpq import Statement, run_then
from .migrate import check_schema
from .sql import queries_for, queries_in, raw_queries
from .urls import Connection, connect, mask_url

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Rows = list[tuple[Any, ...]]
#: A runtime statement: its name, the statement, its parameters.
Step = tuple[str, Query, Params]
#: Sends a statement down an open pipeline; the function it returns gives the statement's
#: rows once the pipeline has ended.
Send = Callable[[Query, Params], Callable[[], Rows]]

_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)


class Wakes(Protocol):
    """The NOTIFYs a caller's transaction owes, sent once it has committed."""

    def add(
        self,
        queue: str,
        status: str,
        run_at: datetime | None,
        named: tuple[int, int] | None = None,
    ) -> None:
        """Owe the NOTIFY of a message written to ``queue`` (its due time if ``scheduled``);
        ``named``: its (id, slot), for the notification that names it."""


class Executor(ABC):
    """Runs a store's statements on one database session."""

    #: The broker's schema: checked on connecting, and the store's statements address it.
    schema: str
    #: Where the statements run, for messages: a URL with its secrets masked, or a description.
    where: str

    @property
    @abstractmethod
    def conn(self) -> Connection:
        """The executor's own psycopg connection, opened if need be."""

    @abstractmethod
    def connect(self) -> None:
        """Open the session now and check it, or raise: see :meth:`Store.connect`."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the session (close it, if it is the executor's)."""

    @abstractmethod
    def exclusive(self) -> AbstractContextManager[object]:
        """Held while no other thread's statement may run on the session: between a question
        about the session (:meth:`flushes_alone`) and the statement its answer chose. Re-entrant,
        and cheap: it wraps every publish."""

    @abstractmethod
    def run(self, query: Query, params: Params) -> Rows:
        """Run one statement; its rows, with the driver's Python values."""

    @abstractmethod
    def run_direct(self, name: str, query: Query, params: Params) -> Rows:
        """Run the runtime statement ``name`` (``query``), one of those run once per
        message, the executor's fastest way; its rows, whose values may come back as text."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[None]:
        """A block whose statements are written all or none."""

    def flushes_alone(self) -> bool:
        """Whether the next statement is a transaction of its own whose commit waits for its
        WAL to be flushed, and a second transaction can follow it in the same round trip
        (:meth:`run_then`). Asked under :meth:`exclusive`."""
        return False

    def run_then(self, first: Step, then: Step) -> tuple[Rows, str | None]:
        """``first`` in a transaction of its own, then ``then`` in another, in one round trip;
        only where :meth:`flushes_alone` said so. Returns ``first``'s rows (values as text)
        and why ``then`` failed, or ``None``: ``then`` runs whether ``first`` failed or not, a
        failed ``first`` raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot run two transactions at once")

    def wakes(self, announce: Step) -> Wakes | None:
        """Where the next statement lands in a caller's transaction that has an after-commit
        hook: the NOTIFYs that transaction owes at its current savepoint, to which a write
        adds its messages. Once the transaction has committed they are sent by ``announce``,
        its parameters given the owed ``queues`` and earliest due time ``run_at``. ``None``
        elsewhere. Asked before the statement it follows is run."""
        return None

    def pipeline(self) -> AbstractContextManager[Send] | None:
        """One transaction whose statements go down a pipeline, the next one sent while the
        server runs the previous ones; ``None`` where there is none to be had."""
        return None


_schema_checked: set[tuple[str, str]] = set()
_schema_lock = threading.Lock()

#: This process's id, set again in a forked child by the hook below: an executor compares it
#: with the one it was made in before every statement, where ``os.getpid()`` would be a system
#: call each time (several per publish).
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class OwnConnection(Executor):
    """A connection of the executor's own: opened lazily, in autocommit mode, dropped (never
    closed) in a forked child, reopened after it broke.

    psycopg serialises concurrent use of one connection statement by statement, so acks from
    pool threads and fetches from the consumer thread can share it. A lock of the executor's
    (:meth:`exclusive`) is held for every statement and across every transaction of several
    statements (:meth:`transaction`, :meth:`pipeline`): another thread's statement waits for
    that transaction to end instead of running inside it.

    Every error of its statements is classified by SQLSTATE
    (:func:`~kombu_pgskip.exceptions.classify`): those that pass raise a
    :class:`~kombu_pgskip.exceptions.TransientDatabaseError`, which kombu retries after
    reconnecting; the rest an error that kombu does not retry.
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str,
        check: bool = True,
        asynchronous_commit: bool = False,
        **connect_kwargs: Any,
    ) -> None:
        """``check``: on connecting, the schema must be installed at the version this package
        needs, and :meth:`connect` checks that the session can write. ``asynchronous_commit``
        sets ``synchronous_commit = off`` for the session: commits return before their WAL is
        flushed. ``connect_kwargs`` go to :func:`kombu_pgskip.urls.connect`; with
        ``prepare_threshold=None`` (PgBouncer in transaction pooling mode) nothing is
        prepared."""
        self.url = url
        self.schema = schema
        self.where = mask_url(url)
        self._check = check
        self._asynchronous_commit = asynchronous_commit
        # run_then needs libpq's pipeline mode (libpq >= 14).
        self._flushes_alone = not asynchronous_commit and psycopg.Pipeline.is_supported()
        self._connect_kwargs = connect_kwargs
        self._conn: Connection | None = None
        self._opening = threading.Lock()
        self._busy = threading.RLock()
        self._pid = _pid
        # The transaction() and pipeline() blocks open (changed only under _busy).
        self._blocks = 0
        # Statements run through libpq (run_direct, run_then), prepared unless psycopg may
        # not prepare either.
        self._direct: dict[str, Statement] = {}
        self._prepared = connect_kwargs.get("prepare_threshold", 5) is not None
        # Around every statement: server errors classified by SQLSTATE (exceptions.classify),
        # so that those that pass reach kombu as connection errors and the others do not.
        self._classifying = exceptions.classifying(url_for_messages=self.where)

    def __repr__(self) -> str:
        return f"<OwnConnection {self.where}>"

    def _forget_parent(self) -> None:
        """In a forked child: the parent's socket is not ours to use or to close, nor is the
        state of its locks (a thread of the parent may have held one when it forked), nor its
        open transaction."""
        if self._pid != _pid:
            self._conn = None
            self._opening = threading.Lock()
            self._busy = threading.RLock()
            self._blocks = 0
            self._pid = _pid

    def exclusive(self) -> threading.RLock:
        """The executor's lock, replaced first in a forked child."""
        self._forget_parent()
        return self._busy

    @property
    def conn(self) -> Connection:
        self._forget_parent()
        conn = self._conn
        if conn is None or conn.closed:
            with self._opening:  # two threads finding no connection open one, not two
                conn = self._conn
                if conn is None or conn.closed:
                    conn = self._connect()
                    self._conn = conn
        return conn

    def _connect(self) -> Connection:
        conn = connect(self.url, **self._connect_kwargs)
        try:
            if self._asynchronous_commit:
                with self._classifying:
                    conn.execute("SET synchronous_commit TO off")
            self._ensure_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _ensure_schema(self, conn: Connection) -> None:
        """Check the schema once per process for each (URL, schema)."""
        if not self._check:
            return
        key = (self.url, self.schema)
        with _schema_lock:
            if key in _schema_checked:
                return
        try:
            check_schema(conn, self.schema)
        except psycopg.Error as exc:
            raise exceptions.translate(exc, url_for_messages=self.where) from exc
        with _schema_lock:
            _schema_checked.add(key)

    def connect(self) -> None:
        _ = self.conn
        if self._check:
            try:
                check_writable(self)
            except BaseException:
                self.close()  # whoever asked gets an error, not a connection to close
                raise

    def close(self) -> None:
        """Close the connection; in a forked child, only forget it."""
        conn, self._conn = self._conn, None
        if conn is None or self._pid != _pid:
            return
        try:
            conn.close()
        except Exception:  # closing a broken connection must not mask the original error
            logger.debug("error closing connection", exc_info=True)

    def run(self, query: Query, params: Params) -> Rows:
        with self._classifying, self.exclusive():
            cur = self.conn.execute(query, params)
            return cur.fetchall() if cur.description is not None else []

    def run_direct(self, name: str, query: Query, params: Params) -> Rows:
        """Through libpq: psycopg's own overhead is a measurable share of the time of the
        statements run once per message. The values come back as text."""
        with self._classifying, self.exclusive():
            res = self._statement(name, query).run(self.conn, params)
        return text_rows(res)

    def _statement(self, name: str, query: Query) -> Statement:
        statement = self._direct.get(name)
        if statement is None:
            text = query.as_string(None)
            statement = self._direct[name] = Statement(name, text, prepared=self._prepared)
        return statement

    def flushes_alone(self) -> bool:
        """Outside every transaction, the executor's own and one opened on :attr:`conn` by
        someone else, unless commits are asynchronous (they wait for no flush) or libpq has
        no pipeline mode."""
        return (
            self._flushes_alone
            and not self._blocks
            and self.conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
        )

    def run_then(self, first: Step, then: Step) -> tuple[Rows, str | None]:
        with self._classifying, self.exclusive():
            inserted, announced = run_then(
                self.conn,
                (self._statement(first[0], first[1]), first[2]),
                (self._statement(then[0], then[1]), then[2]),
            )
        failure = None
        if announced.status not in _OK:
            failure = (announced.get_error_message() or "").strip()
        return text_rows(inserted), failure

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._classifying, self.exclusive(), self.conn.transaction():
            self._blocks += 1
            try:
                yield
            finally:
                self._blocks -= 1

    def pipeline(self) -> AbstractContextManager[Send] | None:
        """Where libpq has pipeline mode (libpq >= 14)."""
        if not psycopg.Pipeline.is_supported():
            return None
        return self._pipeline()

    @contextmanager
    def _pipeline(self) -> Iterator[Send]:
        with self._classifying, self.exclusive():
            conn = self.conn
            with conn.pipeline(), conn.transaction():
                self._blocks += 1
                try:
                    yield functools.partial(_send, conn)
                finally:
                    self._blocks -= 1


def _send(conn: Connection, query: Query, params: Params) -> Callable[[], Rows]:
    cursor = conn.cursor()
    cursor.execute(query, params)
    return cursor.fetchall


def text_rows(res: pq.abc.PGresult) -> Rows:
    """A libpq text-format result as rows of strings (None for NULL)."""
    value = res.get_value
    if res.nfields == 1:  # the ids of an insert: one column, up to thousands of rows
        return [(None if (v := value(i, 0)) is None else v.decode(),) for i in range(res.ntuples)]
    return [
        tuple(None if (v := value(i, j)) is None else v.decode() for j in range(res.nfields))
        for i in range(res.ntuples)
    ]


def check_writable(executor: Executor) -> None:
    """Raise :class:`~kombu_pgskip.exceptions.ReadOnlyDatabase` if the session of
    ``executor`` cannot write, naming the cause: a standby, or
    ``default_transaction_read_only`` and where it was set."""
    query = queries_in("health.sql", executor.schema)["write_access"]
    read_only, standby, source, user, database = executor.run(query, {})[0]
    if read_only:
        raise exceptions.ReadOnlyDatabase.because(
            standby=bool(standby),
            source=source,
            user=str(user),
            database=str(database),
            where=executor.where,
        )


@functools.cache
def _statement_texts(schema: str) -> dict[int, tuple[Query, str]]:
    """id(runtime statement) -> (the statement, its text for pyformat drivers)."""
    composed = queries_for(schema)
    return {
        id(query): (query, pyformat_text(raw_queries()[name], schema))
        for name, query in composed.items()
    }


@functools.cache
def _unprepared(name: str, text: str) -> Statement:
    """Statement ``name`` run through libpq without preparing it: nothing of ours is left
    prepared in a session that is not ours."""
    return Statement(name, text, prepared=False)


_NOTHING_HELD = nullcontext()


class CallerConnection(Executor):
    """The caller's connection, reached through ``adapter``: every statement lands in the
    caller's transaction, which the caller commits or rolls back (the store's operations
    need no transaction of their own there: the caller's makes them all or none)."""

    def __init__(self, adapter: Adapter, *, schema: str) -> None:
        self.adapter = adapter
        self.schema = schema
        self.where = f"caller's {adapter.driver} connection"
        self._texts = _statement_texts(schema)

    def __repr__(self) -> str:
        return f"<CallerConnection {self.adapter!r}>"

    @property
    def conn(self) -> Connection:
        raise RuntimeError(
            "kombu-pgskip tried to open a connection of its own inside apply_async_in; "
            "everything must go through the caller's connection (this is a bug)"
        )

    def connect(self) -> None:
        """Nothing to open: the caller's connection is open, and was checked."""

    def close(self) -> None:
        """Never close the caller's connection: it is not ours."""

    def exclusive(self) -> AbstractContextManager[object]:
        """Nothing: the caller's connection is used by the caller's thread."""
        return _NOTHING_HELD

    def transaction(self) -> AbstractContextManager[None]:
        """Nothing to open: the caller's transaction."""
        return nullcontext()

    def run(self, query: Query, params: Params) -> Rows:
        return self.adapter.run(query, self._text(query), params)

    def run_direct(self, name: str, query: Query, params: Params) -> Rows:
        """Through the caller's driver, as every statement here."""
        return self.adapter.run(query, self._text(query), params)

    def wakes(self, announce: Step) -> Wakes | None:
        """Where the caller's driver has an after-commit hook (Django's ``on_commit``, a
        SQLAlchemy ``Session``'s ``after_commit`` event, a :func:`kombu_pgskip.transaction`
        block on psycopg 3; :meth:`Adapter.after_commit`): one collection per savepoint of the
        caller's transaction, shared by every write made at it, sent in one statement right
        after the commit (:meth:`announce`). A rollback, or a savepoint rolled back, drops
        what it owed: nobody is woken for a job that does not exist."""
        return self.adapter.after_commit(
            ("pgskip-wakes", self.schema), lambda: _Wakes(self, announce)
        )

    def announce(self, name: str, query: Query, params: Params) -> None:
        """Run the NOTIFYs owed on the caller's connection, now in autocommit, after its
        commit; a failure is logged, not raised (the jobs are committed: raising would reach
        the caller's commit; consumers find them at their next poll). On a psycopg 3
        connection it goes through libpq directly, unprepared: in a loop on the test machine,
        232 us and 62 us of client CPU per statement against 352 and 189 through Django's
        cursor."""
        try:
            raw = self.adapter.identity()
            if isinstance(raw, psycopg.Connection):
                _unprepared(name, self._text(query)).run(raw, params)
            else:
                self.adapter.run_after_commit(query, self._text(query), params)
        except Exception as exc:
            logger.warning(
                "the NOTIFY after the caller's commit failed (consumers find the job at "
                "their next poll): %s",
                str(exc).strip(),
                extra={"action": "announce_failed"},
            )

    def _text(self, query: Query) -> str:
        """``query`` as text for pyformat drivers."""
        known = self._texts.get(id(query))
        if known is not None and known[0] is query:
            return known[1]
        # not a runtime statement: render it (psycopg >= 3.2 needs no connection)
        return query.as_string(None) if isinstance(query, sql.Composable) else str(query)


class _Wakes:
    """The NOTIFYs one savepoint of a caller's transaction owes, sent right after its commit
    (:meth:`CallerConnection.wakes`): each queue that got a pending job, once, and the earliest
    due time of its scheduled jobs, as an insert that notifies inside its own transaction
    announces them."""

    def __init__(self, executor: CallerConnection, announce: Step) -> None:
        self.after_commit_key: Hashable = ("pgskip-wakes", executor.schema)
        self._executor = executor
        self._announce = announce
        # queue -> (id, slot) of the one pending message written to it, or None (several, or
        # one not named); in the order first written
        self._queues: dict[str, tuple[int, int] | None] = {}
        self._due: datetime | None = None

    def add(
        self,
        queue: str,
        status: str,
        run_at: datetime | None,
        named: tuple[int, int] | None = None,
    ) -> None:
        if status == "pending":
            self._owe(queue, named)
        else:
            self._due_at(run_at)

    def _owe(self, queue: str, named: tuple[int, int] | None) -> None:
        """Owe the notification of a pending message of ``queue``: named by its (id, slot)
        while it is the queue's only one."""
        self._queues[queue] = None if queue in self._queues else named

    def _due_at(self, run_at: datetime | None) -> None:
        if run_at is not None and (self._due is None or run_at < self._due):
            self._due = run_at

    def __call__(self) -> None:
        name, query, params = self._announce
        named = list(self._queues.values())
        owed = {
            **params,
            "queues": list(self._queues),
            "ids": [n[0] if n else None for n in named],
            "slots": [n[1] if n else None for n in named],
            "run_at": self._due,
        }
        self._executor.announce(name, query, owed)

    def merge(self, other: _Wakes) -> None:
        """Owe what ``other`` owes too (a nested block's, once it was kept)."""
        for queue, named in other._queues.items():
            self._owe(queue, named)
        self._due_at(other._due)


__all__ = [
    "CallerConnection",
    "Executor",
    "OwnConnection",
    "Rows",
    "Step",
    "Wakes",
    "check_writable",
]
