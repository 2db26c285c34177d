"""Every database operation of the broker, by name.

A :class:`Store` holds the operations: which runtime statement (``sql/*.sql``) each runs, with what
parameters, and where the NOTIFY that wakes consumers goes (:meth:`Store._notify_placement`).
An executor (:mod:`kombu_pgskip.executor`) runs them on one session:

* ``Store(url, ...)`` runs them on a connection of its own
  (:class:`~kombu_pgskip.executor.OwnConnection`) in autocommit mode: each operation is one
  statement and one transaction (a durable publish is two: the insert, then its NOTIFY), so a
  crash between two operations leaves every row in a state the sweeper understands;
* ``Store.on(CallerConnection(adapter, schema=...))`` runs the same operations in a caller's
  transaction (``apply_async_in``), which it never commits, rolls back or closes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from . import exceptions
from .executor import Executor, OwnConnection, Wakes, check_writable
from .sql import queries_for
from .urls import Connection

logger = logging.getLogger(__name__)


class Position(NamedTuple):
    """Where a message stands in its queue's delivery order (priority first, then due time, then
    id): a consumer's next fetch of the queue may start after the last one it took
    (``sql/consume.sql``, ``due``). ``run_at`` is the due time as the server wrote it, which it
    reads back exactly."""

    priority: int
    run_at: str
    id: int


#: The position before every message: a fetch from here scans its queue from the beginning.
START = Position(32767, "-infinity", 0)


@dataclass(frozen=True)
class FetchedRow:
    """A message a fetch took.

    ``attempts`` counts its deliveries (this one included). ``delivery`` is this delivery's
    fencing token: ack, requeue and fail change the row only while it still runs under this
    delivery, which no later delivery of it matches (0 for a no-ack fetch: nothing settles
    it). ``budget_full`` is true on the last row of a fetch whose byte budget
    (``max_bytes``) left a due message behind. ``position``: where it stood in its queue."""

    id: int
    queue: str
    payload: dict[str, Any]
    redelivered: bool
    attempts: int
    delivery: int = 0
    budget_full: bool = False
    position: Position = START

    @property
    def tag(self) -> tuple[int, int]:
        """What :meth:`Store.ack`, :meth:`Store.requeue` and :meth:`Store.fail` take:
        (row id, delivery token)."""
        return self.id, self.delivery


#: Rows the SQL function ``sweep()`` returns to the queue per call (migration 0016).
SWEEP_BATCH = 10_000
#: How long after a sweep found a consumer's session lock released a later sweep takes it for
#: dead, if the lock is still released (the interval in ``sweep()``, migration 0016).
LOCK_GRACE_S = 2.0
#: Expired messages :meth:`Store.drop_expired` deletes per statement.
DROP_EXPIRED_BATCH = 5_000

#: Payload bytes after which a fetch takes no further message (the transport option
#: ``fetch_max_bytes``; it always takes one): a fetch's whole result is in the worker's memory
#: at once, and holds less than this plus one message.
FETCH_MAX_BYTES = 16 * 1024 * 1024


#: With a per-key limit, how many due messages of the queue a limited fetch looks at to find
#: those whose key has a free slot (``sql/consume.sql``, ``fetch_limited``).
LIMIT_WINDOW = 1000


@dataclass(frozen=True)
class LimitedFetch:
    """What a limited fetch (:meth:`Store.fetch_limited`) took and found.

    ``limited``: the queue has limits (else it took nothing, and the normal fetch takes its
    messages). ``free``: slots under ``max_running`` left after it (None: no such limit).
    ``tokens``: tokens left in the bucket (None: no rate). ``more``: due messages were left
    behind (for lack of credit, of a slot, of a token, or of a slot of their key). ``acked``:
    how many of the acks it carried were still this consumer's. ``rate``: the queue's."""

    rows: list[FetchedRow]
    limited: bool
    free: int | None
    tokens: float | None
    more: bool
    rate: float | None = None
    acked: int = 0


@dataclass(frozen=True)
class NewMessage:
    """A message ready to be inserted (see :func:`kombu_pgskip.envelope.to_row`)."""

    queue: str
    priority: int
    status: str
    run_at: datetime | None
    payload: str
    task_name: str | None
    task_id: str | None
    ttl_ms: int | None
    unique_key: str | None = None
    concurrency_key: str | None = None

    def to(self, queue: str, payload: str | None = None) -> NewMessage:
        """This message for ``queue``, with another ``payload`` if given (faster than
        ``dataclasses.replace``)."""
        return NewMessage(
            queue,
            self.priority,
            self.status,
            self.run_at,
            self.payload if payload is None else payload,
            self.task_name,
            self.task_id,
            self.ttl_ms,
            self.unique_key,
            self.concurrency_key,
        )

    def params(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "priority": self.priority,
            "status": self.status,
            "run_at": self.run_at,
            "payload": self.payload,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "ttl_ms": self.ttl_ms,
            "unique_key": self.unique_key,
            "concurrency_key": self.concurrency_key,
        }


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which inserts of deliverable messages are announced."""
    return f"pgskip:{schema}"


def scheduled_channel(schema: str) -> str:
    """The channel on which the due time of newly scheduled (far-future) messages is announced."""
    return f"pgskip:{schema}:scheduled"


#: PostgreSQL's longest identifier in bytes (NAMEDATALEN - 1): schema and channel names alike.
IDENTIFIER_BYTES = 63
#: The longest schema name whose notification channels are identifiers PostgreSQL accepts.
MAX_SCHEMA_BYTES = IDENTIFIER_BYTES - len(scheduled_channel("").encode())


def validate_schema_name(schema: object) -> str:
    """Return ``schema`` if it can name the broker's schema, else raise
    :class:`~kombu_pgskip.exceptions.ConfigurationError`: 1 to :data:`MAX_SCHEMA_BYTES` bytes
    of UTF-8 without NUL, so that ``pgskip:<schema>:scheduled`` is a channel name PostgreSQL
    takes (it refuses a NOTIFY on a longer one)."""
    size = len(schema.encode("utf-8", "surrogatepass")) if isinstance(schema, str) else 0
    if not isinstance(schema, str) or not 0 < size <= MAX_SCHEMA_BYTES or "\x00" in schema:
        raise exceptions.ConfigurationError(
            f"schema name {schema!r} ({size} bytes): a schema name is 1 to {MAX_SCHEMA_BYTES} "
            "bytes of UTF-8 without NUL (its notification channel pgskip:<schema>:scheduled "
            f"must fit PostgreSQL's {IDENTIFIER_BYTES}-byte identifiers); choose a shorter one"
        )
    return schema


class _KeyHeld(Exception):
    """A message of another task holds the unique key (:meth:`Store.take_over_unique_key`)."""


class _Placement(NamedTuple):
    """Where an insert's NOTIFY goes (:meth:`Store._notify_placement`): the insert statement
    to run, the statement that announces it in a transaction of its own right behind (or
    ``None``), and the NOTIFYs owed after the caller's commit to add its messages to (or
    ``None``)."""

    insert: str
    announce: str | None
    wakes: Wakes | None


class _Inserts:
    """The runtime statements that write messages (one, or several), and where
    each puts the NOTIFY: ``notifying`` inside its own statement, ``quiet`` nowhere (another
    statement sends it), ``announce`` alone."""

    __slots__ = ("behind", "inside", "quiet")

    def __init__(self, notifying: str, quiet: str, announce: str, noting: str = "") -> None:
        """``noting``: the insert that announce, right behind it, reads the message's id
        from (default: ``quiet``)."""
        self.quiet = quiet
        self.inside = _Placement(notifying, None, None)
        self.behind = _Placement(noting or quiet, announce, None)


#: One message and several: the single-row statements take 12-15 % less wall time per single
#: publish than the multi-row ones.
_ONE_ROW = _Inserts("publish", "insert_message", "announce", "insert_noting")
_MANY_ROWS = _Inserts("publish_many", "insert_many", "announce_many")


class Store:
    """The broker's database operations, run by an :class:`~kombu_pgskip.executor.Executor`."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "pgskip",
        check: bool = True,
        asynchronous_commit: bool = False,
        notify_after_commit: bool = True,
        keep_completed: bool = True,
        **connect_kwargs: Any,
    ):
        """A store on a connection of its own to ``url``
        (:class:`~kombu_pgskip.executor.OwnConnection`, which takes ``check``,
        ``asynchronous_commit`` and ``connect_kwargs``).

        ``asynchronous_commit`` sets ``synchronous_commit = off`` for this connection's
        session: commits return before their WAL is flushed. Only for statements whose loss in
        a server crash is harmless (fetches and acks: a lost one means a redelivery).

        ``notify_after_commit`` and ``keep_completed``: see :meth:`on`."""
        executor = OwnConnection(
            url,
            schema=validate_schema_name(schema),
            check=check,
            asynchronous_commit=asynchronous_commit,
            **connect_kwargs,
        )
        self._bind(executor, notify_after_commit=notify_after_commit, keep_completed=keep_completed)

    @classmethod
    def on(
        cls, executor: Executor, *, notify_after_commit: bool = True, keep_completed: bool = True
    ) -> Store:
        """A store whose statements ``executor`` runs, on the schema it names.

        ``notify_after_commit``: an insert's NOTIFY goes after the commit of the insert's
        transaction where that can be had, not inside it (:meth:`_notify_placement`).

        ``keep_completed=False`` (the transport option): :meth:`ack` and :meth:`ack_fetch`
        delete the acknowledged messages instead of marking them completed."""
        store = cls.__new__(cls)
        store._bind(
            executor, notify_after_commit=notify_after_commit, keep_completed=keep_completed
        )
        return store

    def _bind(self, executor: Executor, *, notify_after_commit: bool, keep_completed: bool) -> None:
        self.executor = executor
        self.schema = validate_schema_name(executor.schema)
        self.q = queries_for(self.schema)
        self.channel = notify_channel(self.schema)
        # Every insert statement wakes consumers itself (migration 0004): the two channels.
        self._channels = {
            "channel": self.channel,
            "scheduled_channel": scheduled_channel(self.schema),
        }
        self._ack, self._ack_fetch = (
            ("ack", "ack_fetch") if keep_completed else ("ack_delete", "ack_delete_fetch")
        )
        self._notify_after_commit = notify_after_commit
        # What ties an announce to the insert right before it (insert_noting).
        self._note_keys = itertools.count(1)
        # What sends the NOTIFYs owed after a caller's commit (CallerConnection.wakes).
        self._announce_owed = ("announce_many", self.q["announce_many"], self._channels)
        self._where = executor.where

    def __repr__(self) -> str:
        return f"<Store {self._where} schema={self.schema}>"

    # -- connection ------------------------------------------------------------------------------

    @property
    def conn(self) -> Connection:
        """The executor's own connection, opened if need be (an executor on a caller's
        connection has none to give)."""
        return self.executor.conn

    def connect(self) -> None:
        """Open the connection now and check it: raises if the server is unusable.

        Unless ``check`` is off, the schema must be installed at the needed version
        (:class:`~kombu_pgskip.exceptions.SchemaError`) and the session must be able to write
        (:class:`~kombu_pgskip.exceptions.ReadOnlyDatabase` naming the cause: a standby, or
        ``default_transaction_read_only`` and where it was set). On the caller's connection,
        nothing: it is open, and was checked.
        """
        self.executor.connect()

    def check_writable(self) -> None:
        """Raise :class:`~kombu_pgskip.exceptions.ReadOnlyDatabase` if this session cannot write."""
        check_writable(self.executor)

    def close(self) -> None:
        """Close the connection; in a forked child, only forget it; never the caller's."""
        self.executor.close()

    def execute(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run the named statement; driver errors that have a clearer meaning are translated."""
        with exceptions.translating(url_for_messages=self._where):
            return self.executor.run(self.q[name], params)

    def run(self, query: Any, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run ``query`` (a statement of another SQL file) as it is."""
        return self.executor.run(query, params)

    def execute_direct(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """As :meth:`execute`, by the executor's fastest way (on its own connection, through
        libpq, the values coming back as text): for the statements run once per message,
        where psycopg's own overhead is a measurable share of the time."""
        with exceptions.translating(url_for_messages=self._where):
            return self.executor.run_direct(name, self.q[name], params)

    # -- publishing ------------------------------------------------------------------------------

    def publish(self, message: NewMessage) -> int | None:
        """Insert one message into its queue; returns its id, or ``None`` when another message
        of the queue holds its unique key (nothing was written). On the store's own connection
        it is committed when this returns, and its NOTIFY follows in a transaction of its own,
        sent right behind the insert's in the same round trip (:meth:`_notify_placement`)."""
        ids = self._publish_chunk((message,))
        return ids[0] if ids else None

    def take_over_unique_key(self, message: NewMessage) -> int | None:
        """Publish ``message`` in place of the messages of the same task (``task_id``) that
        hold its unique key: Celery's ``retry`` publishes the retry while the message it
        retries still runs. One transaction: the key is taken from them, then ``message`` is
        inserted; returns its id, or ``None`` (nothing changed) when a message of another task
        holds the key."""
        params = {"queue": message.queue, "key": message.unique_key, "task_id": message.task_id}
        try:
            with self.executor.transaction():
                self.execute("release_unique_key", params)
                ids = self._publish_chunk((message,))
                if not ids:
                    raise _KeyHeld  # rolls the release back
        except _KeyHeld:
            return None
        return ids[0]

    def publish_many(self, messages: Sequence[NewMessage]) -> list[int]:
        """Insert ``messages`` with as few statements as their size allows, all or none.

        One statement per ``PUBLISH_MANY_CHUNK`` messages (or about 16 MB of payload); more
        than one run inside one transaction (the caller's, on a caller's connection), so a
        failure writes nothing. Returns the ids.
        """
        refuse_unique_keys(messages)
        chunks = publish_chunks(messages)
        if len(chunks) <= 1:
            return [i for chunk in chunks for i in self._publish_chunk(chunk)]
        with self.executor.transaction():
            return [i for chunk in chunks for i in self._publish_chunk(chunk)]

    def publish_stream(self, messages: Iterable[NewMessage]) -> list[int]:
        """As :meth:`publish_many` for messages built while they are written.

        ``messages`` may be a generator doing the work of building them: every
        ``PUBLISH_STREAM_CHUNK`` messages, their statement is sent down a pipeline and the next
        ones are built while the server inserts these. One transaction, all or none: an error
        raised by the generator or by the server rolls back every chunk already sent. Returns
        the ids in order. Without a pipeline (libpq < 14, a caller's connection), as
        :meth:`publish_many`.
        """
        pipeline = self.executor.pipeline()
        if pipeline is None:
            return self.publish_many(list(messages))
        fetches = []
        with exceptions.translating(url_for_messages=self._where):
            with pipeline as send:
                # Inside the pipeline's transaction: the rule puts the NOTIFY in the insert.
                insert, _, wakes = self._notify_placement(_MANY_ROWS)
                for chunk in stream_chunks(messages):
                    refuse_unique_keys(chunk)
                    fetches.append(send(self.q[insert], {**_many_params(chunk), **self._channels}))
                    if wakes is not None:
                        for m in chunk:
                            wakes.add(m.queue, m.status, m.run_at)
            return [int(r[0]) for fetch in fetches for r in fetch()]

    def _publish_chunk(self, messages: Sequence[NewMessage]) -> list[int]:
        """Insert ``messages`` with one statement and wake their consumers; returns their ids
        in order. Every publish but :meth:`publish_stream`'s pipeline and
        :meth:`publish_routed` writes through here: one message with the single-row
        statements, several (a chunk of :meth:`publish_many`) with the multi-row ones, the
        NOTIFY where :meth:`_notify_placement` puts it."""
        one = len(messages) == 1
        params: dict[str, Any] = messages[0].params() if one else _many_params(messages)
        params.update(self._channels)
        executor = self.executor
        with executor.exclusive(), exceptions.translating(url_for_messages=self._where):
            insert, announce, wakes = self._notify_placement(_ONE_ROW if one else _MANY_ROWS)
            if announce is None:
                rows = executor.run_direct(insert, self.q[insert], params)
            else:
                if one:
                    params["note_key"] = str(next(self._note_keys))
                else:
                    params.update(_owed(messages))
                rows, failure = executor.run_then(
                    (insert, self.q[insert], params), (announce, self.q[announce], params)
                )
                if failure is not None:
                    # The messages are committed: raising would make the caller publish again.
                    logger.warning(
                        "a publish's NOTIFY failed (consumers find the message at their next "
                        "poll): %s",
                        failure,
                        extra={"action": "announce_failed"},
                    )
        if wakes is not None:
            # insert_message returns the message's id and slot, for its notification to name it
            named = (int(rows[0][0]), int(rows[0][1])) if one and rows else None
            for m in messages:
                wakes.add(m.queue, m.status, m.run_at, named=named)
        return [int(r[0]) for r in rows]

    def _notify_placement(self, inserts: _Inserts) -> _Placement:
        """Where the NOTIFY that wakes the consumers of an insert goes, and so which of
        ``inserts`` (the insert with its NOTIFY, the insert alone, the NOTIFY alone) run:
        the one rule for every insert of :meth:`publish`, :meth:`publish_many` and
        :meth:`publish_stream`, on either executor.

        1. After the commit, where the insert lands in a caller's transaction that has an
           after-commit hook (:meth:`Executor.wakes`): the insert goes without its NOTIFY,
           and the transaction's NOTIFYs are sent in one statement once it has committed.
        2. In a transaction of its own right behind the insert's, in the same round trip,
           where the insert is a transaction of its own whose commit waits for a WAL flush
           (:meth:`Executor.flushes_alone`: the store's own connection in autocommit, outside
           any transaction, with synchronous commits).
        3. Inside the insert's transaction otherwise, where it is sent at that transaction's
           commit and dropped by its rollback: a transaction of several statements of the
           store's own (:meth:`publish_many` above one chunk, :meth:`publish_stream`) or one
           opened on its connection by someone else, asynchronous commits (no flush to wait
           for), a caller's transaction without an after-commit hook. And always with
           ``notify_after_commit`` off.

        PostgreSQL takes one lock for the whole cluster when a transaction that notified
        commits, and holds it until the commit's WAL is flushed (and confirmed by a
        synchronous standby): with the NOTIFY inside, only one durable insert in the cluster
        commits at a time, whatever the number of publishers. A transaction that only
        notifies writes no WAL and holds that lock briefly. Nothing is lost if the NOTIFY
        never comes (the connection dies between the two, the process right after the
        caller's commit): consumers find the rows at their next poll. 1 and 2 take a transaction id
        more (2: per insert; 1: per caller's transaction).

        :meth:`publish_routed` keeps its NOTIFY in its statement: the queues it wakes are
        known only once it ran. Asked under :meth:`Executor.exclusive`, so that the session
        stays as the answer found it until the chosen statement has run.
        """
        if self._notify_after_commit:
            wakes = self.executor.wakes(self._announce_owed)
            if wakes is not None:
                return _Placement(inserts.quiet, None, wakes)
            if self.executor.flushes_alone():
                return inserts.behind
        return inserts.inside

    def publish_routed(
        self, message: NewMessage, *, exchange: str, routing_key: str, queues: Sequence[str]
    ) -> list[str]:
        """Insert ``message`` into every live queue ``exchange`` routes ``routing_key`` to.

        The targets are the bindings stored by every process (fanout: all of them; topic: the
        ones whose pattern matches; direct: equal routing key) plus ``queues`` (the ones this
        process bound in memory), minus queues whose ``x-expires`` ran out. One statement, so
        one round trip whatever the number of targets, which wakes the consumers of every
        queue written to. Returns the queues written to.
        """
        params = message.params()
        params.update(self._channels)
        params.update(exchange=exchange, routing_key=routing_key, queues=list(queues))
        return [str(r[0]) for r in self.execute_direct("publish_routed", params)]

    def route(self, exchange: str, routing_key: str) -> list[str]:
        """The live queues bound in the database that ``exchange`` routes ``routing_key`` to."""
        rows = self.execute("route", {"exchange": exchange, "routing_key": routing_key})
        return [r[0] for r in rows]

    # -- exchanges and bindings --------------------------------------------------------------------

    def declare_exchange(
        self,
        name: str,
        type: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        """Create exchange ``name`` unless it exists. Raises
        :class:`~kombu_pgskip.exceptions.PreconditionFailed`, changing nothing, when it exists
        with another type (AMQP). Its flags and arguments have no effect here and are kept
        as first declared."""
        _no_nul(exchange=name)
        params = {
            "name": name,
            "type": type,
            "durable": durable,
            "auto_delete": auto_delete,
            "arguments": json.dumps(arguments or {}, default=str),
        }
        # No row: another session created it after the statement's snapshot; ask again.
        rows = self.execute("declare_exchange", params) or self.execute("declare_exchange", params)
        stored = str(rows[0][0]) if rows else type
        if stored != type:
            raise exceptions.PreconditionFailed(
                f"PRECONDITION_FAILED - exchange {name!r} was declared with type {stored!r}, "
                f"not {type!r}; nothing was changed: declare it as {stored!r}, or delete it "
                "first (Channel.exchange_delete)"
            )

    def exchange_type(self, name: str) -> str | None:
        """The declared type of ``name``, or ``None`` when no process declared it."""
        rows = self.execute("exchange_type", {"name": name})
        return str(rows[0][0]) if rows else None

    def delete_exchange(self, name: str) -> int:
        return int(self.execute("delete_exchange", {"name": name})[0][0])

    def bind(
        self,
        queue: str,
        exchange: str,
        routing_key: str,
        *,
        type: str,
        pattern: str | None = None,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        """Bind ``queue`` to ``exchange`` (rows for either are created if missing)."""
        _no_nul(exchange=exchange, routing_key=routing_key or "")
        self.execute(
            "bind",
            {
                "queue": queue,
                "exchange": exchange,
                "routing_key": routing_key or "",
                "type": type,
                "pattern": pattern,
                "arguments": json.dumps(arguments or {}, default=str),
            },
        )

    def unbind(self, queue: str, exchange: str, routing_key: str) -> None:
        self.execute(
            "unbind", {"queue": queue, "exchange": exchange, "routing_key": routing_key or ""}
        )

    def exchange_table(self, exchange: str) -> list[tuple[str, str | None, str]]:
        """Every binding of ``exchange`` as kombu's (routing_key, pattern, queue) triples."""
        return [(r[0], r[1], r[2]) for r in self.execute("exchange_table", {"exchange": exchange})]

    # -- consuming -------------------------------------------------------------------------------

    def fetch(
        self,
        queues: Sequence[str],
        limit: int,
        consumer: uuid.UUID,
        *,
        no_ack: bool = False,
        max_bytes: int = FETCH_MAX_BYTES,
        after: Sequence[Position] | None = None,
    ) -> list[FetchedRow]:
        """Take up to ``limit`` due messages, fairly across ``queues``, in delivery order.

        A message is taken only while the payloads taken before it total less than
        ``max_bytes``: a fetch holds less than ``max_bytes`` plus one message, and always takes
        at least one (a message larger than the budget comes alone). Messages left behind
        stay pending; :func:`fetch_filled` says whether to fetch again. ``after``: for each
        queue, the position its scan starts after (default: the beginning, :data:`START`)."""
        if not queues or limit <= 0:
            return []
        params = {"queues": list(queues), "limit": limit, "consumer": consumer}
        params |= {"max_bytes": max_bytes, **scan_params(queues, after)}
        rows = self.execute("fetch_noack" if no_ack else "fetch", params)
        return fetched_rows(rows)

    def ack_fetch(
        self,
        tags: Sequence[tuple[int, int]],
        queues: Sequence[str],
        limit: int,
        consumer: uuid.UUID,
        *,
        max_bytes: int = FETCH_MAX_BYTES,
        after: Sequence[Position] | None = None,
    ) -> tuple[int, list[FetchedRow]]:
        """:meth:`ack` and :meth:`fetch` in one statement: (acks still ours, messages taken)."""
        ids, deliveries = _split(tags)
        rows = self.execute(
            self._ack_fetch,
            {
                "ids": ids,
                "deliveries": deliveries,
                "queues": list(queues),
                "limit": max(limit, 0),
                "max_bytes": max_bytes,
                "consumer": consumer,
                "urgent": [],
                **scan_params(queues, after),
            },
        )
        acked = int(rows[0][0]) if rows else 0
        return acked, fetched_rows([(*r[1:11], r[12]) for r in rows if r[1] is not None])

    def ack(self, tags: Sequence[tuple[int, int]], consumer: uuid.UUID) -> int:
        """Mark (id, delivery token) pairs (:attr:`FetchedRow.tag`) completed (or delete them:
        ``keep_completed=False``); returns how many were still ours. A pair of an earlier
        delivery of a message, or of a consumer that lost it, changes nothing."""
        ids, deliveries = _split(tags)
        params = {"ids": ids, "deliveries": deliveries, "consumer": consumer}
        return len(self.execute(self._ack, params))

    def requeue(
        self, tags: Sequence[tuple[int, int]], consumer: uuid.UUID, *, max_attempts: int
    ) -> tuple[int, int]:
        """Return (id, delivery token) pairs to pending, fenced as :meth:`ack`; returns
        (requeued or failed, failed for max_attempts)."""
        ids, deliveries = _split(tags)
        row = self.execute(
            "requeue",
            {
                "ids": ids,
                "deliveries": deliveries,
                "consumer": consumer,
                "max_attempts": max_attempts,
                "channel": self.channel,
            },
        )[0]
        return int(row[0]), int(row[1])

    def fail(self, tags: Sequence[tuple[int, int]], consumer: uuid.UUID, error: str) -> int:
        """Move (id, delivery token) pairs to failed with ``error``, fenced as :meth:`ack`;
        returns how many were still ours."""
        ids, deliveries = _split(tags)
        return len(
            self.execute(
                "fail",
                {"ids": ids, "deliveries": deliveries, "consumer": consumer, "error": error},
            )
        )

    def register_consumer(
        self, consumer: uuid.UUID, *, hostname: str, queues: Sequence[str], lease: float
    ) -> None:
        self.execute(
            "register_consumer",
            {
                "id": consumer,
                "hostname": hostname,
                "pid": os.getpid(),
                "queues": list(queues),
                "lease": lease,
            },
        )

    def take_session_lock(self, key: int) -> bool:
        """Take the session-level advisory lock ``key`` on this store's connection; False if
        another session holds it. It is held until the session ends, however that happens:
        :meth:`sweep` takes the consumers renewed with it (:meth:`renew_consumers`) for dead
        once it is released."""
        return bool(self.execute("take_session_lock", {"key": key})[0][0])

    def renew_consumers(
        self, consumers: Sequence[uuid.UUID], lease: float, *, lock_key: int | None = None
    ) -> set[uuid.UUID]:
        """Extend leases; returns the consumers that still exist (the others were swept).

        ``lock_key``: the advisory lock this session holds (:meth:`take_session_lock`) for as
        long as their process lives; ``None``: none, the lease alone says they live. Only the
        ``consumers`` rows are written: no lock on ``jobs`` or ``queues`` delays a renewal."""
        if not consumers:
            return set()
        rows = self.execute(
            "renew_consumers", {"ids": list(consumers), "lease": lease, "lock_key": lock_key}
        )
        return {r[0] for r in rows}

    def mark_queues_used(self, consumers: Sequence[uuid.UUID]) -> int:
        """Restart the ``x-expires`` clock of the queues ``consumers`` consume, skipping queue
        rows another session has locked; returns how many were marked."""
        if not consumers:
            return 0
        return len(self.execute("mark_queues_used", {"ids": list(consumers)}))

    def unregister_consumer(self, consumer: uuid.UUID) -> int:
        """Forget a consumer; what it still held goes back to pending. Returns rows requeued."""
        row = self.execute("unregister_consumer", {"id": consumer, "channel": self.channel})[0]
        return int(row[1])

    def sweep(self, *, max_attempts: int, scan_every: float = 0.0) -> tuple[int, int, int]:
        """Rows of dead consumers, whose lease ran out or whose process's session ended:
        (requeued, failed, consumers forgotten); at most ``SWEEP_BATCH`` rows a call, rows
        and consumers another session has locked skipped. Due scheduled rows are promoted
        too (the maintenance job's sweep, one definition). The running rows of consumers no
        longer known (not taken for dead by this call) are read for unless the database's last
        such read began less than ``scan_every`` seconds ago and left nothing behind."""
        params = {"max_attempts": max_attempts, "scan_every": scan_every}
        row = self.execute("sweep", params)[0]
        return int(row[0]), int(row[1]), int(row[2])

    def suspected_consumers(self) -> int:
        """How many consumers a sweep found without their session lock, and will take for dead
        if a sweep ``LOCK_GRACE_S`` later still finds them so (unless a renewal clears them)."""
        return int(self.execute("suspected_consumers", {})[0][0])

    def rotate(self) -> tuple[int, int, int]:
        """Move the ring of ``jobs``' slots on when the current one has given out its ids, and
        empty the slots that hold nothing to keep: (slots emptied, messages moved to
        ``jobs_kept``, the current slot). Returns at once when another session rotates."""
        row = self.execute("rotate", {})[0]
        return int(row[0]), int(row[1]), int(row[2])

    def drop_expired(self, limit: int = DROP_EXPIRED_BATCH) -> int:
        """Delete up to ``limit`` waiting messages whose TTL ran out, skipping rows another
        session has locked; returns how many."""
        return int(self.execute("drop_expired", {"limit": limit})[0][0])

    @contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        """A transaction whose statements wait at most ``seconds`` for a lock and run at most
        ``seconds`` each, else raise (``LockNotAvailable``, ``QueryCanceled``) and write
        nothing: for housekeeping that must not hold up what comes after it."""
        ms = str(max(1, round(seconds * 1000)))
        with self.executor.transaction():
            self.execute("bound_waits", {"lock_ms": ms, "statement_ms": ms})
            yield

    def expire_queues(self) -> tuple[int, int]:
        """Delete queues whose ``x-expires`` ran out unused; returns (queues, messages)."""
        row = self.execute("expire_queues", {})[0]
        return int(row[0]), int(row[1])

    def promote_scheduled(self, limit: int = 10_000) -> tuple[int, float | None]:
        """Make due far-future messages pending; returns (promoted, seconds until the next)."""
        row = self.execute("promote_scheduled", {"limit": limit, "channel": self.channel})[0]
        return int(row[0]), (None if row[2] is None else float(row[2]))

    # -- queues ----------------------------------------------------------------------------------

    def purge(self, queue: str) -> int:
        return int(self.execute("purge", {"queue": queue})[0][0])

    def size(self, queue: str) -> int:
        return int(self.execute("size", {"queue": queue})[0][0])

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        """Create queue ``name``, or refresh its ``x-expires`` clock if it exists with the same
        settings. Raises :class:`~kombu_pgskip.exceptions.PreconditionFailed`, changing
        nothing, when it exists with other ones (AMQP: a queue's first declaration fixes
        them; ``pgskip queue-args`` changes them, as the schema's owner).

        Compared: ``auto_delete``, ``x-max-priority``, ``x-message-ttl`` and ``x-expires``,
        the settings that change what happens to its messages. ``durable`` (every queue is a
        table here) and other ``x-`` arguments have no effect and are kept as first declared.
        """
        args = dict(arguments or {})
        params = {
            "name": name,
            "durable": durable,
            "auto_delete": auto_delete,
            "arguments": json.dumps(args, default=str),
            "max_priority": _int_or_none(args.get("x-max-priority")),
            "message_ttl": _int_or_none(args.get("x-message-ttl")),
            "expires": _int_or_none(args.get("x-expires")),
        }
        for _ in range(2):  # the queue may be deleted between the two statements: again
            if self.execute("declare_queue", params):
                return
            stored = self.execute("queue_declaration", {"name": name})
            if stored:
                asked = (auto_delete, params["max_priority"], params["message_ttl"],
                         params["expires"])  # fmt: skip
                raise exceptions.PreconditionFailed(
                    f"PRECONDITION_FAILED - queue {name!r} was declared with "
                    f"{_queue_settings(stored[0])}, this declaration asks for "
                    f"{_queue_settings(asked)}; nothing was changed: declare it with the "
                    "same settings (every process that declares it, e.g. the same "
                    "task_queues / Queue(...) arguments), or have the schema's owner change "
                    f"them: celery -A proj pgskip queue-args {name} --set x-expires=... "
                    "(see --help)"
                )

    def has_queue(self, name: str) -> bool:
        return bool(self.execute("has_queue", {"name": name})[0][0])

    def delete_queue(self, name: str) -> int:
        """Drop a queue, its waiting messages and its bindings; returns the messages dropped."""
        return int(self.execute("delete_queue", {"name": name})[0][0])

    def delete_unused_queues(self, names: Sequence[str], consumer: uuid.UUID) -> tuple[int, int]:
        """Drop the ``auto_delete`` queues among ``names`` that no other live consumer consumes.

        Returns (queues, messages) deleted.
        """
        if not names:
            return 0, 0
        row = self.execute("delete_unused_queues", {"names": list(names), "consumer": consumer})[0]
        return int(row[0]), int(row[1])

    def queue_stats(self) -> list[dict[str, Any]]:
        cols = (
            "queue",
            "pending",
            "running",
            "scheduled",
            "failed",
            "oldest_pending_age",
            "completed_last_minute",
        )
        return [dict(zip(cols, r, strict=True)) for r in self.execute("queue_stats", {})]

    # -- pausing ---------------------------------------------------------------------------------

    def pause(self, names: Sequence[str], reason: str | None = None) -> list[str]:
        """Pause queues ``names`` for every worker (migration 0021): from the commit on, no
        fetch takes their messages until :meth:`resume`; publishes, countdowns and the tasks
        already running go on. Returns those not paused before, by name. Celery's own
        remote-control and event queues are refused (workers would stop answering ``celery
        inspect`` and ``control``): :class:`~kombu_pgskip.exceptions.ConfigurationError`."""
        for name in names:
            if is_celery_internal(name):
                raise exceptions.ConfigurationError(
                    f"{name!r} is one of Celery's remote-control or event queues: paused, "
                    "workers would stop answering `celery inspect` and `celery control`; "
                    "pause the task queues (those of task_queues / -Q) instead"
                )
        rows = self.execute("pause", {"names": list(names), "reason": reason})
        return sorted(str(r[0]) for r in rows)

    def resume(self, names: Sequence[str]) -> list[str]:
        """Resume paused queues ``names`` and wake their consumers at commit; returns those
        that were paused, by name."""
        rows = self.execute("resume", {"names": list(names), "channel": self.channel})
        return sorted(str(r[0]) for r in rows)

    def paused(self) -> list[dict[str, Any]]:
        """Every paused queue, by name: name, paused_at, paused_by, reason and its pending
        messages (``pending``)."""
        cols = ("name", "paused_at", "paused_by", "reason", "pending")
        return [dict(zip(cols, r, strict=True)) for r in self.execute("paused", {})]

    def unique_keys(self, queue: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The unique keys held (``queue``'s, or every queue's), by queue and key: queue,
        key, status, task, task_id and created_at of the message that holds each."""
        cols = ("queue", "key", "status", "task", "task_id", "created_at")
        rows = self.execute("unique_keys", {"queue": queue, "limit": limit})
        return [dict(zip(cols, r, strict=True)) for r in rows]

    # -- limits ----------------------------------------------------------------------------------

    def set_limit(
        self,
        name: str,
        *,
        max_running: int | None = None,
        max_running_per_key: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
    ) -> dict[str, Any]:
        """Set the limits of queue ``name`` for every worker (migration 0025), replacing those
        it had: from the commit on, at most ``max_running`` of its messages run at once, at
        most ``max_running_per_key`` per concurrency key, and at most ``rate`` start per
        second (a bucket of ``burst`` tokens, by default ``max(1, ceil(rate))``), counted
        across every worker (:meth:`fetch_limited`). Returns its row as :meth:`limits` lists
        it, with ``replaced``: whether it had limits before. Refused with
        :class:`~kombu_pgskip.exceptions.ConfigurationError`: no limit given, a limit below
        1, a burst without a rate, one of Celery's remote-control or event queues."""
        if is_celery_internal(name):
            raise exceptions.ConfigurationError(
                f"{name!r} is one of Celery's remote-control or event queues: limited, "
                "workers would answer `celery inspect` and `celery control` late or not at "
                "all; limit the task queues (those of task_queues / -Q) instead"
            )
        _no_nul(queue_name=name)
        check_limits(max_running, max_running_per_key, rate, burst)
        params = {
            "name": name,
            "max_running": max_running,
            "max_running_per_key": max_running_per_key,
            "rate": rate,
            "burst": burst,
        }
        row = self.execute("set_limit", params)[0]
        return {**dict(zip(_LIMIT_COLUMNS, row[:-1], strict=True)), "replaced": bool(row[-1])}

    def unlimit(self, names: Sequence[str]) -> list[str]:
        """Remove the limits of queues ``names`` and wake their consumers at commit (the normal
        fetch takes their messages again); returns those that were limited, by name."""
        rows = self.execute("unlimit", {"names": list(names), "channel": self.channel})
        return sorted(str(r[0]) for r in rows)

    def limits(self) -> list[dict[str, Any]]:
        """Every limited queue, by name: name, max_running, max_running_per_key, rate, burst
        (as the fetch applies it), set_at, set_by, and its ``pending`` and ``running``
        messages."""
        return [dict(zip(_LIMIT_COLUMNS, r, strict=True)) for r in self.execute("limits", {})]

    def limited_among(self, names: Sequence[str]) -> set[str]:
        """Which of queues ``names`` are limited."""
        if not names:
            return set()
        return {str(r[0]) for r in self.execute("limited_among", {"names": list(names)})}

    def fetch_limited(
        self,
        queue: str,
        limit: int,
        consumer: uuid.UUID,
        *,
        acks: Sequence[tuple[int, int]] = (),
        window: int = LIMIT_WINDOW,
    ) -> LimitedFetch:
        """Take up to ``limit`` due messages of the limited ``queue``, within its limits
        (:meth:`set_limit`), in delivery order; mark them running under ``consumer``.

        One transaction, in one round trip where libpq has pipeline mode: ``acks`` ((id,
        delivery token) pairs, fenced as :meth:`ack`) are written first, so the slots they
        free count; then the queue's row of ``queue_limits`` is locked, so that the limited
        fetches of the queue, in every worker, run one after the other; then one statement,
        whose snapshot sees every message an earlier one took, counts the running messages,
        refills the bucket, takes what the limits leave, and spends the tokens. A fetch that
        waits for the lock waits for the one fetch (or limit change) ahead of it. With a
        per-key limit, the first ``window`` due messages are looked at (see ``sql``).

        A queue with no limits (any more) takes nothing: ``LimitedFetch.limited`` is false,
        and the normal fetch takes its messages."""
        ids, deliveries = _split(acks)
        params = {"queue": queue, "limit": max(limit, 0), "consumer": consumer, "window": window}
        q = self.q
        with exceptions.translating(url_for_messages=self._where):
            with self._one_transaction() as send:
                acked = send(q[self._ack], {"ids": ids, "deliveries": deliveries,
                                            "consumer": consumer}) if acks else None  # fmt: skip
                send(q["limit_lock"], {"queue": queue})
                fetched = send(q["fetch_limited"], params)
            rows = fetched()
            done = len(acked()) if acked is not None else 0
        head = rows[0]
        return LimitedFetch(
            rows=fetched_rows([r[5:16] for r in rows if r[5] is not None]),
            limited=bool(head[0]),
            free=None if head[1] is None else int(head[1]),
            tokens=None if head[2] is None else float(head[2]),
            more=bool(head[3]),
            rate=None if head[4] is None else float(head[4]),
            acked=done,
        )

    @contextmanager
    def _one_transaction(self) -> Iterator[Any]:
        """A transaction whose statements go down a pipeline (one round trip) where there is
        one, else are run one by one; yields ``send(query, params)``, which returns a function
        giving the statement's rows once the block has ended."""
        pipeline = self.executor.pipeline()
        if pipeline is not None:
            with pipeline as send:
                yield send
            return
        with self.executor.transaction():

            def send(query: Any, params: dict[str, Any]) -> Any:
                rows = self.executor.run(query, params)
                return lambda: rows

            yield send


#: The columns of a limited queue's row (``limits``, ``set_limit``).
_LIMIT_COLUMNS = (
    "name",
    "max_running",
    "max_running_per_key",
    "rate",
    "burst",
    "set_at",
    "set_by",
    "pending",
    "running",
)


def check_limits(
    max_running: int | None,
    max_running_per_key: int | None,
    rate: float | None,
    burst: int | None,
) -> None:
    """Refuse limits ``queue_limits`` would not hold, saying why
    (:class:`~kombu_pgskip.exceptions.ConfigurationError`)."""
    if max_running is None and max_running_per_key is None and rate is None:
        raise exceptions.ConfigurationError(
            "no limit given: give a maximum of running messages, per key, or a rate "
            "(to remove a queue's limits: unlimit)"
        )
    for what, value in (("max_running", max_running), ("max_running_per_key",
                        max_running_per_key), ("burst", burst)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 < value <= 2**31 - 1):  # fmt: skip
            raise exceptions.ConfigurationError(
                f"{what} must be a whole number from 1 to {2**31 - 1}, not {value!r}"
            )
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not 0 < rate < float("inf")):  # fmt: skip
        raise exceptions.ConfigurationError(
            f"rate must be a positive number of messages per second, not {rate!r}"
        )
    if burst is not None and rate is None:
        raise exceptions.ConfigurationError("a burst is the size of a rate's bucket: give a rate")


def is_celery_internal(queue: str) -> bool:
    """Whether ``queue`` is one of Celery's remote-control queues (``<node>.celery.pidbox``,
    ``celery@host.celery.pidbox``, the ``<uuid>.reply.celery.pidbox`` replies) or event queues
    (``celeryev.<uuid>``)."""
    return queue.endswith(".pidbox") or queue.startswith("celeryev.")


def fetched_rows(rows: list[tuple[Any, ...]]) -> list[FetchedRow]:
    """Rows of ``fetch`` (or ``ack_fetch`` without its first column and ``urgent``; the payload
    as a dict or as JSON text) (id, queue, payload, redelivered, attempts, expires_at, priority,
    rn, delivery, budget_full, run_at as text) in delivery order: priority first, then
    round-robin across queues."""
    rows.sort(key=lambda r: (-r[6], r[7], r[0]))
    return [
        FetchedRow(
            id=r[0],
            queue=r[1],
            payload=r[2] if isinstance(r[2], dict) else json.loads(r[2]),
            redelivered=r[3],
            attempts=r[4],
            delivery=r[8],
            budget_full=bool(r[9]),
            position=Position(r[6], r[10], r[0]),
        )
        for r in rows
    ]


def scan_params(queues: Sequence[str], after: Sequence[Position] | None) -> dict[str, list[Any]]:
    """The ``after_*`` parameters of a fetch of ``queues``: each queue's scan starts after the
    position given for it (all from the beginning without ``after``)."""
    starts = list(after) if after is not None else [START] * len(queues)
    if len(starts) != len(queues):
        raise ValueError(f"{len(queues)} queues but {len(starts)} positions to start after")
    return {
        "after_priority": [p.priority for p in starts],
        "after_run_at": [p.run_at for p in starts],
        "after_id": [p.id for p in starts],
    }


def last_positions(rows: Sequence[FetchedRow]) -> dict[str, Position]:
    """The position of the last row taken from each queue (``rows`` in delivery order, in
    which a queue's rows keep their order)."""
    return {row.queue: row.position for row in rows}


def fetch_filled(rows: Sequence[FetchedRow], limit: int) -> bool:
    """Whether a fetch that asked for ``limit`` messages and took ``rows`` may have left due
    messages behind: it took its whole limit, or its byte budget stopped it first. The
    consumer's prefetch credit is then worth another fetch at once."""
    return len(rows) >= limit or any(row.budget_full for row in rows)


#: Most messages (and payload bytes) ``publish_many`` writes with one statement.
PUBLISH_MANY_CHUNK = 5_000
PUBLISH_MANY_BYTES = 16 * 1024 * 1024


def publish_chunks(messages: Sequence[NewMessage]) -> list[Sequence[NewMessage]]:
    """``messages`` split into the chunks ``publish_many`` writes with one statement each."""
    chunks: list[Sequence[NewMessage]] = []
    start, size = 0, 0
    for i, message in enumerate(messages):
        if i > start and (i - start >= PUBLISH_MANY_CHUNK or size >= PUBLISH_MANY_BYTES):
            chunks.append(messages[start:i])
            start, size = i, 0
        size += len(message.payload)
    if start < len(messages):
        chunks.append(messages[start:])
    return chunks


#: Messages per statement of ``publish_stream``: small enough that the server's insert of one
#: chunk overlaps the building of the next, large enough that a statement's own cost is small.
PUBLISH_STREAM_CHUNK = 100


def stream_chunks(messages: Iterable[NewMessage]) -> Iterator[list[NewMessage]]:
    """``messages`` taken ``PUBLISH_STREAM_CHUNK`` at a time (fewer once a chunk's payloads
    reach ``PUBLISH_MANY_BYTES``), each chunk yielded as soon as it is complete."""
    chunk: list[NewMessage] = []
    size = 0
    for message in messages:
        chunk.append(message)
        size += len(message.payload)
        if len(chunk) >= PUBLISH_STREAM_CHUNK or size >= PUBLISH_MANY_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


#: Separates the payloads in ``publish_many``'s statement: JSON text cannot hold U+001E
#: unescaped (a control character is escaped inside strings and not allowed outside them).
PAYLOAD_SEPARATOR = "\x1e"


def refuse_unique_keys(messages: Sequence[NewMessage]) -> None:
    """Raise unless no message of a publish of many carries a unique key: such a publish
    writes all its messages or none, and returns an id per message."""
    for m in messages:
        if m.unique_key is not None:
            raise exceptions.ConfigurationError(
                f"a message with a unique key ({m.unique_key!r}) in a publish of many messages: "
                "that publish writes all of them or none, so it takes no unique key; publish "
                "keyed tasks one by one (apply_async, apply_async_in); nothing was written"
            )


def _many_params(messages: Sequence[NewMessage]) -> dict[str, str]:
    """The parameters of ``publish_many``'s statement for ``messages``: their columns as one
    JSON array (``rows``), their payloads (already JSON) as one text split by the server
    (``payloads``)."""
    dump = json.dumps
    queues: dict[str, str] = {}
    parts = []
    for m in messages:
        queue = queues.get(m.queue)
        if queue is None:
            queue = queues[m.queue] = dump(m.queue)
        run_at = "null" if m.run_at is None else dump(m.run_at.isoformat())
        ttl_ms = "null" if m.ttl_ms is None else str(int(m.ttl_ms))
        task_name = "null" if m.task_name is None else dump(m.task_name)
        task_id = "null" if m.task_id is None else dump(m.task_id)
        key = "" if m.concurrency_key is None else f',"concurrency_key":{dump(m.concurrency_key)}'
        parts.append(
            f'{{"queue":{queue},"priority":{int(m.priority)},"status":"{m.status}",'
            f'"run_at":{run_at},"task_name":{task_name},"task_id":{task_id},'
            f'"ttl_ms":{ttl_ms}{key}}}'
        )
    payloads = PAYLOAD_SEPARATOR.join([m.payload for m in messages])
    if payloads.count(PAYLOAD_SEPARATOR) != max(len(parts) - 1, 0):
        raise exceptions.ConfigurationError(
            "a message payload holds the control character U+001E, which JSON text cannot "
            "hold unescaped: payloads must be JSON (as kombu-pgskip's envelope writes them); "
            "nothing was written"
        )
    return {"rows": "[" + ",".join(parts) + "]", "payloads": payloads}


def _owed(messages: Sequence[NewMessage]) -> dict[str, Any]:
    """The parameters of ``announce_many`` for ``messages``: the queues that got a pending
    message, each once in the order first written, and the earliest due time of the
    scheduled ones (``None`` if none)."""
    queues: dict[str, None] = {}
    due: datetime | None = None
    for m in messages:
        if m.status == "pending":
            queues[m.queue] = None
        elif m.run_at is not None and (due is None or m.run_at < due):
            due = m.run_at
    none = [None] * len(queues)  # insert_many's messages are not named
    return {"queues": list(queues), "ids": none, "slots": none, "run_at": due}


def _split(tags: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(id, delivery token) pairs as the arrays the fenced statements take: ids, deliveries."""
    return [t[0] for t in tags], [t[1] for t in tags]


def _no_nul(**names: str) -> None:
    """Refuse a name PostgreSQL cannot store (text holds no U+0000) before anything is written."""
    for what, name in names.items():
        if "\x00" in name:
            raise exceptions.ConfigurationError(
                f"invalid {what.replace('_', ' ')} {name!r}: NUL characters are not allowed"
            )


def _queue_settings(values: Sequence[Any]) -> str:
    """(auto_delete, max_priority, message_ttl, expires) as a queue's declaration reads them."""
    auto_delete, max_priority, message_ttl, expires = values
    parts = [f"auto_delete={bool(auto_delete)}"]
    for key, value in (
        ("x-max-priority", max_priority),
        ("x-message-ttl", message_ttl),
        ("x-expires", expires),
    ):
        parts.append(f"{key}={'none' if value is None else value}")
    return ", ".join(parts)


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise exceptions.ConfigurationError(
            f"queue argument must be an integer, got {value!r}"
        ) from None
