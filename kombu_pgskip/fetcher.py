"""The ``ack_fetch`` statement without blocking the worker's event loop.

Inside a Celery worker the transport fetches from kombu's event loop, the same thread that
hands tasks to the prefork pool and reads their results. A blocking fetch stalls all of that
for a round trip. :class:`AsyncFetcher` sends the statement on a connection of its own and
returns at once; the loop watches the socket and collects the rows when they arrive (the way
kombu's Redis transport sends ``BRPOP`` and reads the reply later).

It speaks libpq directly (``psycopg.pq``), on a connection opened by psycopg: one prepared
statement (or, with ``prepared=False`` for PgBouncer in transaction pooling, the statement text
every time), parameters and results in text format.

**An idle worker takes the message it is told of.** A publish of one message names it in its
notification (queue, id and slot: ``name_it`` in ``sql/publish.sql``). When the dispatcher
knows that message is the only one announced since a fetch that left nothing due behind
(:class:`~kombu_pgskip.policy.Announced`) and there are no acks to write, the fetch is
``take_announced``: that message by its primary key, under the conditions of every fetch
(pending, due, not paused, not limited, not expired), with the same look into the urgent
queues (in that slot: their messages have notifications of their own). It runs on the
message's slot alone: ``jobs`` is a ring of partitions (migration 0027) and a generic plan
sets up every one of them at each place a statement reads ``jobs``, most of an idle fetch's
time; the slot's statement, prepared once per slot, is planned for that partition alone.
When several idle workers share a queue, each notification wakes them all: those whose take
finds the message taken send nothing more.

**Acks alone.** The acks of an idle worker's last tasks wait for the next fetch, or for a
flush a few milliseconds later (``policy.ACK_FLUSH_DELAY``). When the consumer knows that
fetch would find nothing (its last fetch left nothing behind, and no notification came
since: ``FetchPolicy.acks_alone``),
:meth:`AsyncFetcher.send_acks` writes them with the ``ack`` statement alone, on the same
connection and without blocking the loop either.
"""

from __future__ import annotations

import logging
import os
import re
import select
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq, sql

from . import exceptions
from .libpq import array_literal, positional, result_error
from .sql import queries_for
from .store import (
    FETCH_MAX_BYTES,
    FetchedRow,
    Position,
    fetch_filled,
    fetched_rows,
    scan_params,
)
from .urls import connect, mask_url

logger = logging.getLogger(__name__)

_PARAMS = (
    "ids",
    "deliveries",
    "queues",
    "limit",
    "max_bytes",
    "consumer",
    "urgent",
    "after_priority",
    "after_run_at",
    "after_id",
)


class AsyncFetcher:
    """One ``ack_fetch`` in flight at a time on a dedicated connection.

    :meth:`send` writes the statement and returns; the caller watches :meth:`fileno` and calls
    :meth:`poll` when it is readable until it returns the result. Errors surface from
    :meth:`send`, :meth:`poll` and :meth:`wait` classified by SQLSTATE
    (:func:`~kombu_pgskip.exceptions.classify`): a lost connection, a canceled statement, a
    lock or statement timeout, a deadlock, a server shutting down are a
    :class:`~kombu_pgskip.exceptions.TransientDatabaseError`, an ``OperationalError``, which
    kombu and Celery recover from by reconnecting; other server errors are not retried. After
    any error the connection is closed: the next fetch opens a new one.
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str,
        asynchronous_commit: bool,
        prepared: bool = True,
        keep_completed: bool = True,
        max_bytes: int = FETCH_MAX_BYTES,
        **connect_kwargs: Any,
    ) -> None:
        """``keep_completed=False``: acks delete their messages (``ack_delete_fetch``).
        ``max_bytes``: the byte budget of every fetch (:meth:`~kombu_pgskip.store.Store.fetch`)."""
        self.url = url
        self._max_bytes = str(max_bytes).encode()
        self.schema = schema
        self._asynchronous_commit = asynchronous_commit
        self._prepared = prepared
        self._connect_kwargs = connect_kwargs  # for urls.connect
        self._where = mask_url(url)
        self._classifying = exceptions.classifying(url_for_messages=self._where)
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = os.getpid()
        self._sent: int | None = None  # the limit of the fetch in flight (0: acks alone)
        # Whether the last fetch saw a due message in one of the urgent queues it was given.
        self.urgent = False
        queries = queries_for(schema)
        name = "ack_fetch" if keep_completed else "ack_delete_fetch"
        self._statement = f"pgskip_{name}".encode()
        query, names = positional(queries[name].as_string(None))
        assert set(names) == set(_PARAMS), names
        self._query = query.encode()
        self._order = names
        # The take of a message a notification named (send with named=).
        query, names = positional(queries["take_announced"].as_string(None))
        assert set(names) == {"id", "queues", "consumer", "urgent"}, names
        self._take_statement = b"pgskip_take_announced"
        self._take_query = _one_slot(query.encode(), schema)
        self._take_order = names
        # The acks alone (send_acks).
        name = "ack" if keep_completed else "ack_delete"
        self._ack_statement = f"pgskip_{name}".encode()
        query, names = positional(queries[name].as_string(None))
        assert set(names) == {"ids", "deliveries", "consumer"}, names
        self._ack_query = query.encode()
        self._ack_order = names
        self._drained = False  # whether the last fetch took every due message it could see
        self._statements: set[bytes] = set()  # prepared on this connection
        self._by_id = False  # the fetch in flight takes a named message (take_announced)
        self._acks_only = False  # the statement in flight writes acks and fetches nothing

    @property
    def in_flight(self) -> bool:
        return self._sent is not None

    def _pgconn(self) -> pq.abc.PGconn:
        return self._connection().pgconn

    def _connection(self) -> psycopg.Connection[Any]:
        """The fetch connection, opened (and set up) if need be."""
        if self._pid != os.getpid():
            self._conn, self._sent, self._pid = None, None, os.getpid()  # not ours to use
        conn = self._conn
        if conn is None or conn.closed:
            conn = connect(self.url, **self._connect_kwargs)
            try:
                self._set_up(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            self._sent = None
        return conn

    def _set_up(self, conn: psycopg.Connection[Any]) -> None:
        """The session's settings, and the fetch statement prepared."""
        self._statements = set()
        with self._classifying:
            if self._asynchronous_commit:
                conn.execute("SET synchronous_commit TO off")
            if self._prepared:
                # ack_fetch only ever runs here. Left to choose, PostgreSQL plans it afresh on
                # every execution (its generic plan is estimated for a LIMIT of a tenth of the
                # table): a few hundred microseconds of server CPU per fetch. Its generic plan
                # walks the same indexes (docs/performance.md).
                conn.execute("SET plan_cache_mode TO force_generic_plan")
                self._prepare(conn, self._statement, self._query)

    def _prepare(self, conn: psycopg.Connection[Any], statement: bytes, query: bytes) -> None:
        res = conn.pgconn.prepare(statement, query)
        if res.status != pq.ExecStatus.COMMAND_OK:
            raise result_error(conn, res, url_for_messages=self._where)
        self._statements.add(statement)

    def fileno(self) -> int:
        return self._pgconn().socket

    def send(
        self,
        tags: Sequence[tuple[int, int]],
        queues: Sequence[str],
        limit: int,
        consumer: uuid.UUID,
        urgent: Sequence[str] = (),
        after: Sequence[Position] | None = None,
        named: tuple[int, int] | None = None,
    ) -> None:
        """Ack ``tags`` ((id, delivery token) pairs) and ask for up to ``limit`` messages of
        ``queues``, each scanned after the position given for it in ``after`` (default: from
        the beginning); do not wait. :attr:`urgent` then says whether a due message waits in
        one of the queues ``urgent`` (read in the fetch's snapshot; not fetched).

        ``named``: (id, slot) of the one message announced since the last fetch (the caller
        knows nothing else became due). If that fetch left nothing due behind and there are
        no acks to write, only that message is taken, by its id (``take_announced``, on its
        slot alone); if another consumer took it first, nothing is, and nothing more is sent.
        """
        if self._sent is not None:
            raise RuntimeError("a fetch is already in flight")
        idle = self._drained and not tags
        if named is not None and idle and limit > 0:
            ident, slot = named
            values = {
                "consumer": str(consumer).encode(),
                "id": str(ident).encode(),
                "queues": array_literal(list(queues)),
                "urgent": array_literal(list(urgent)),
            }
            self._send(
                [values[n] for n in self._take_order],
                b"%s_slot_%d" % (self._take_statement, slot),
                self._take_query.replace(b"{slot}", b"%d" % slot),
            )
            self._sent, self._by_id, self._acks_only = limit, True, False
            return
        params = self.params(tags, queues, limit, consumer, urgent, after)
        self._send(params, self._statement, self._query)
        self._sent, self._by_id, self._acks_only = limit, False, False

    def send_acks(self, tags: Sequence[tuple[int, int]], consumer: uuid.UUID) -> None:
        """Write the acks ``tags`` ((id, delivery token) pairs, fenced as :meth:`send` writes
        them) and fetch nothing; do not wait. :meth:`poll` then returns (acks still ours, no
        rows, 0). For a consumer that knows a fetch would find nothing: the ``ack`` statement
        costs the server about half of an ``ack_fetch`` that finds nothing."""
        if self._sent is not None:
            raise RuntimeError("a fetch is already in flight")
        values = _ack_values(tags, consumer)
        self._send([values[n] for n in self._ack_order], self._ack_statement, self._ack_query)
        self._sent, self._acks_only = 0, True

    def _send(self, params: list[bytes], statement: bytes, query: bytes) -> None:
        """Send ``query`` with ``params``: prepared as ``statement`` (once per connection)
        unless the statements are sent as text."""
        conn = self._connection()
        pgconn = conn.pgconn
        try:
            with self._classifying:
                if not self._prepared:
                    pgconn.send_query_params(query, params)
                else:
                    if statement not in self._statements:
                        self._prepare(conn, statement, query)
                    pgconn.send_query_prepared(statement, params)
                while pgconn.flush():  # 1 while data remains to be sent: rare for a small query
                    select.select([], [pgconn.socket], [], 1.0)
        except BaseException:
            self._drop()  # its state unknown: the next fetch opens a new connection
            raise

    def params(
        self,
        tags: Sequence[tuple[int, int]],
        queues: Sequence[str],
        limit: int,
        consumer: uuid.UUID,
        urgent: Sequence[str] = (),
        after: Sequence[Position] | None = None,
    ) -> list[bytes]:
        """The statement's parameters for :meth:`send`'s arguments, in its order, as text."""
        values = _ack_values(tags, consumer) | {
            "queues": array_literal(list(queues)),
            "limit": str(max(limit, 0)).encode(),
            "max_bytes": self._max_bytes,
            "urgent": array_literal(list(urgent)),
        }
        values |= {k: array_literal(v) for k, v in scan_params(queues, after).items()}
        return [values[n] for n in self._order]

    def poll(self) -> tuple[int, list[FetchedRow], int] | None:
        """None while the result has not arrived; else (acks still ours, rows, limit asked).
        A failed fetch raises, classified by SQLSTATE, its connection closed."""
        if self._sent is None:
            return None
        conn = self._connection()
        pgconn = conn.pgconn
        try:
            with self._classifying:
                pgconn.consume_input()
                if pgconn.is_busy():
                    return None
                results = []
                while (res := pgconn.get_result()) is not None:
                    results.append(res)
                for res in results:
                    if res.status != pq.ExecStatus.TUPLES_OK:
                        raise result_error(conn, res, url_for_messages=self._where)
            if self._acks_only:
                self._sent, self.urgent = None, False
                return sum(res.ntuples for res in results), [], 0
            acked, rows = self._parse(results)
        except BaseException:
            self._drop()
            raise
        limit, self._sent = self._sent, None
        if not self._by_id or rows:
            # A take by id that found its message taken says nothing new: what the fetch
            # before it left stands.
            self._drained = not fetch_filled(rows, limit)
        return acked, rows, limit

    def wait(self, timeout: float = 30.0) -> tuple[int, list[FetchedRow], int] | None:
        """Block until the fetch in flight (if any) completes."""
        while self._sent is not None:
            result = self.poll()
            if result is not None:
                return result
            readable, _, _ = select.select([self.fileno()], [], [], timeout)
            if not readable:
                self._drop()
                raise exceptions.TransientDatabaseError(
                    f"no answer to a fetch within {timeout} s at {self._where}: the "
                    "connection is taken for lost and closed; kombu and Celery reconnect"
                )
        return None

    def _parse(self, results: list[pq.abc.PGresult]) -> tuple[int, list[FetchedRow]]:
        """``ack_fetch``'s text-format results as (acks still ours, rows in delivery order)."""
        acked = 0
        urgent = False
        rows: list[tuple[Any, ...]] = []
        for res in results:
            for i in range(res.ntuples):
                value = res.get_value
                acked = int(value(i, 0) or 0)
                urgent = value(i, 11) == b"t"
                if value(i, 1) is None:
                    continue  # the lone row of a fetch that found nothing
                rows.append(
                    (
                        int(value(i, 1) or 0),  # id
                        (value(i, 2) or b"").decode(),  # queue
                        (value(i, 3) or b"{}").decode(),  # payload (JSON text)
                        value(i, 4) == b"t",  # redelivered
                        int(value(i, 5) or 0),  # attempts
                        None,  # expires_at (not used by consumers)
                        int(value(i, 7) or 0),  # priority
                        int(value(i, 8) or 0),  # round-robin rank
                        int(value(i, 9) or 0),  # delivery token
                        value(i, 10) == b"t",  # budget_full
                        (value(i, 12) or b"").decode(),  # run_at, as text
                    )
                )
        self.urgent = urgent
        return acked, fetched_rows(rows)

    def _drop(self) -> None:
        conn, self._conn, self._sent = self._conn, None, None
        self._drained = False
        if conn is not None and self._pid == os.getpid():
            try:
                conn.close()
            except Exception:
                logger.debug("error closing the fetch connection", exc_info=True)

    def close(self) -> None:
        """Close the connection (a forked child only forgets it)."""
        if self._pid != os.getpid():
            self._conn, self._sent = None, None
            return
        self._drop()


def _ack_values(tags: Sequence[tuple[int, int]], consumer: uuid.UUID) -> dict[str, bytes]:
    """The acks' parameters, as text: those ``ack`` takes, and the first of ``ack_fetch``."""
    return {
        "ids": array_literal([t[0] for t in tags]),
        "deliveries": array_literal([t[1] for t in tags]),
        "consumer": str(consumer).encode(),
    }


def _one_slot(query: bytes, schema: str) -> bytes:
    """``query`` reading one slot of ``jobs`` wherever it reads ``jobs``: the condition
    ``slot = {slot}`` (the slot put in by :meth:`AsyncFetcher.send`) first in the WHERE clause
    of each read, a constant, so that PostgreSQL plans the read of that partition alone. The
    privileges checked stay those on ``jobs``."""
    parent = re.escape(sql.Identifier(schema).as_bytes(None) + b".jobs")
    reads = list(re.finditer(parent + rb"(?:\s+AS\s+(\w+))?(?=\s)", query))
    out, done = [], 0
    for k, read in enumerate(reads):
        where = query.find(b" WHERE ", read.end())
        following = reads[k + 1].start() if k + 1 < len(reads) else len(query)
        if not 0 <= where < following:
            raise RuntimeError("the fetch reads jobs in a way _one_slot does not rewrite")
        where += len(b" WHERE ")
        out += [query[done:where], read.group(1) or b"jobs", b".slot = {slot} AND "]
        done = where
    return b"".join([*out, query[done:]])
