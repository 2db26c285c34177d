"""Statements run through libpq itself (``psycopg.pq``), below psycopg's cursor layer.

A psycopg ``execute`` costs about 50 us of client CPU more than the libpq call it makes
(cursor set-up, parameter adaptation, the generator-driven wait, result wrapping): a quarter of
a durable single-row INSERT on a fast disk. The hot paths (one publish per message, the
worker's fetch) therefore speak libpq directly, on connections opened and owned by psycopg:
parameters and results in text format, ``%(name)s`` placeholders turned into ``$n``, errors
raised as the psycopg exceptions (:func:`psycopg.errors.error_from_result`), classified by
SQLSTATE (:func:`kombu_pgskip.exceptions.classify`) as on the package's other connections.
"""

from __future__ import annotations

import re
import select
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg import errors, pq

from . import exceptions

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
#: Around every call into libpq here: psycopg's own errors from it (a closed connection, a
#: failed send) are classified as the results' are.
_CLASSIFYING = exceptions.classifying()


def positional(text: str) -> tuple[str, list[str]]:
    """``%(name)s`` placeholders as ``$n`` (one number per name), and the names in order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(number, text), names


def array_literal(values: Sequence[Any]) -> bytes:
    """A PostgreSQL array literal of ``values`` (ints, or strings quoted and escaped; None is
    NULL)."""
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
        elif isinstance(v, int):
            parts.append(str(v))
        else:
            parts.append('"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"')
    return ("{" + ",".join(parts) + "}").encode()


def text_value(value: Any) -> bytes | None:
    """``value`` as a text-format parameter (``None`` is SQL NULL)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, (int, UUID)):
        return str(value).encode()
    if isinstance(value, datetime):
        return value.isoformat().encode()
    if isinstance(value, (list, tuple)):
        return array_literal(value)
    raise TypeError(f"no text format for a parameter of type {type(value).__name__}")


def connection_error(
    pgconn: pq.abc.PGconn,
    message: str,
    *,
    sqlstate: str | None = None,
    url_for_messages: str | None = None,
) -> BaseException:
    """The error to raise for a failure on ``pgconn``, classified by
    :func:`~kombu_pgskip.exceptions.classify`: psycopg's class for ``sqlstate``; without one
    (libpq's own failures: the connection went away, or its state is unknown), an
    ``OperationalError``, which is transient (kombu and Celery reconnect)."""
    cls = exceptions.psycopg_class(sqlstate) if sqlstate else psycopg.OperationalError
    error = cls(message)
    if sqlstate and error.sqlstate != sqlstate:
        error.sqlstate = sqlstate  # a SQLSTATE newer than this psycopg: its class's class
    return exceptions.classify(error, url_for_messages=url_for_messages)


def result_error(
    conn: psycopg.Connection[Any], res: pq.abc.PGresult, *, url_for_messages: str | None = None
) -> BaseException:
    """The error to raise for the failed result ``res`` of ``conn``, classified by
    :func:`~kombu_pgskip.exceptions.classify`: psycopg's exception for its SQLSTATE (with the
    server's diagnostics), or, without one, for a lost connection. ``url_for_messages``: the
    (masked) URL the message names."""
    if _sqlstate(res) is None:
        message = res.get_error_message() or conn.pgconn.get_error_message()
        return connection_error(
            conn.pgconn, message or "connection lost", url_for_messages=url_for_messages
        )
    error = errors.error_from_result(res, encoding=conn.info.encoding)
    return exceptions.classify(error, url_for_messages=url_for_messages)


class Statement:
    """One runtime statement (``sql/*.sql``), run with :meth:`run` on a psycopg connection.

    With ``prepared`` (the default) it is prepared once per connection under a name of its
    own (psycopg's automatic names start with ``_pg3_``); without, the text is sent every time
    as an unnamed statement, which PgBouncer in transaction pooling mode accepts.
    """

    def __init__(self, name: str, text: str, *, prepared: bool = True) -> None:
        query, self.params = positional(text)
        self.query = query.encode()
        self.name = f"pgskip_{name}".encode()
        self.prepared = prepared
        self._prepared_on: pq.abc.PGconn | None = None  # the libpq connection it was prepared on

    def run(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> pq.abc.PGresult:
        """Execute with ``params`` (every placeholder's name) and return the result; a failed
        statement raises the psycopg exception for its SQLSTATE, classified (as every error
        here: :data:`_CLASSIFYING`)."""
        values = self.values(params)
        with _CLASSIFYING, conn.lock:
            pgconn = conn.pgconn
            if not self.prepared:
                res = pgconn.exec_params(self.query, values)
            else:
                res = self._exec_prepared(conn, values)
                if res.status not in _OK and _sqlstate(res) == b"26000":
                    # Deallocated behind our back (DISCARD ALL, DEALLOCATE): nothing ran.
                    self._prepared_on = None
                    res = self._exec_prepared(conn, values)
        if res.status not in _OK:
            raise result_error(conn, res)
        return res

    def values(self, params: Mapping[str, Any]) -> list[bytes | None]:
        """``params`` (every placeholder's name) in the statement's order, text format."""
        return [text_value(params[n]) for n in self.params]

    def _exec_prepared(
        self, conn: psycopg.Connection[Any], values: list[bytes | None]
    ) -> pq.abc.PGresult:
        self._prepare(conn)
        # None is NULL here as in exec_params (psycopg's stub omits it).
        return conn.pgconn.exec_prepared(self.name, values)  # type: ignore[arg-type]

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Prepare on ``conn`` unless already done (no-op for unprepared statements)."""
        pgconn = conn.pgconn
        if not self.prepared or self._prepared_on is pgconn:
            return
        prep = pgconn.prepare(self.name, self.query)
        if prep.status != pq.ExecStatus.COMMAND_OK and _sqlstate(prep) != b"42P05":
            raise result_error(conn, prep)  # 42P05: already prepared on this connection
        self._prepared_on = pgconn

    def _send(self, pgconn: pq.abc.PGconn, values: list[bytes | None]) -> None:
        if self.prepared:
            pgconn.send_query_prepared(self.name, values)
        else:
            pgconn.send_query_params(self.query, values)


def run_then(
    conn: psycopg.Connection[Any],
    first: tuple[Statement, Mapping[str, Any]],
    then: tuple[Statement, Mapping[str, Any]],
) -> tuple[pq.abc.PGresult, pq.abc.PGresult]:
    """Run ``first`` in a transaction of its own, then ``then`` in another, in one round trip.

    Both go down a libpq pipeline with a Sync after each, so ``first`` has committed (or
    failed) before ``then`` starts, and ``then`` runs either way. A failed ``first`` raises,
    as :meth:`Statement.run` does; ``then``'s result is returned as it is, failed or not (by
    then ``first`` has committed, so the caller decides what its failure means). ``conn``
    must be in autocommit mode and outside a transaction; needs libpq >= 14.
    """
    with _CLASSIFYING, conn.lock:
        results = _run_pipeline(conn, (first, then))
        if results[0].status not in _OK and _sqlstate(results[0]) == b"26000":
            # first was deallocated behind our back (DISCARD ALL): it did not run, so running
            # both again cannot write twice; then's may be gone too.
            first[0]._prepared_on = then[0]._prepared_on = None
            results = _run_pipeline(conn, (first, then))
        if results[1].status not in _OK and _sqlstate(results[1]) == b"26000":
            then[0]._prepared_on = None  # prepared again next time
    if results[0].status not in _OK:
        raise result_error(conn, results[0])
    return results[0], results[1]


def _run_pipeline(
    conn: psycopg.Connection[Any], steps: Sequence[tuple[Statement, Mapping[str, Any]]]
) -> list[pq.abc.PGresult]:
    """``steps`` down one pipeline, a Sync after each: a transaction each."""
    pgconn = conn.pgconn
    for statement, _ in steps:
        statement._prepare(conn)
    values = [statement.values(params) for statement, params in steps]
    try:
        pgconn.enter_pipeline_mode()
        for (statement, _), vals in zip(steps, values, strict=True):
            statement._send(pgconn, vals)
            pgconn.pipeline_sync()
        while pgconn.flush():  # 1 while data remains to be sent: rare for small statements
            select.select([], [pgconn.socket], [], 1.0)
        results = [_pipeline_result(pgconn) for _ in steps]
        pgconn.exit_pipeline_mode()
    except BaseException:
        # Lost, or interrupted with results unread: the connection's state is unknown, so it
        # is closed (psycopg then reports it closed and the owner opens a new one).
        conn.close()
        raise
    return results


def _pipeline_result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult:
    """The result of the next statement in the pipeline (its first), up to and including the
    Sync that follows it."""
    results: list[pq.abc.PGresult] = []
    result: pq.abc.PGresult | None = None
    while True:
        # Wait in select(), which lets other threads run meanwhile; get_result() would not.
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [])
            pgconn.consume_input()
        res = pgconn.get_result()
        if res is None:
            # The end of the statement's results. Two in a row (no result between) only come
            # from a connection that went away.
            if result is None or pgconn.status != pq.ConnStatus.OK:
                raise connection_error(pgconn, pgconn.get_error_message() or "connection lost")
            results.append(result)
            result = None
            continue
        if res.status == pq.ExecStatus.PIPELINE_SYNC:
            if result is not None or len(results) != 1:
                raise connection_error(pgconn, "the pipeline's sync came out of turn")
            return results[0]
        if result is None:
            result = res


def _sqlstate(res: pq.abc.PGresult) -> bytes | None:
    return res.error_field(pq.DiagnosticField.SQLSTATE)
