"""Enqueue Celery tasks inside the caller's own database transaction.

.. code-block:: python

    from kombu_pgskip import apply_async_in

    with psycopg.connect(dsn) as conn, conn.transaction():
        order_id = create_order(conn, cart)
        apply_async_in(conn, send_invoice_email, args=(order_id,), countdown=5)

Guarantee
=========
The job is a row written by the caller's connection, in the caller's transaction:

* **commit**: the job exists, and workers idle on LISTEN wake at once (the notification is
  sent at commit; on Django, by an ``on_commit`` callback right after it, on a SQLAlchemy
  ``Session`` by its ``after_commit`` event, and in a :func:`transaction` block on psycopg 3,
  one statement for all the transaction's jobs, so that the commit does not hold
  PostgreSQL's cluster-wide NOTIFY lock);
* **rollback** (or rollback to a savepoint taken before the call): no job, no wake-up, as if
  :func:`apply_async_in` had never been called.

Nothing here commits, rolls back or closes the caller's connection, and nothing opens another
one: the queue row is not declared (the worker consuming the queue declares it), so the only
write is the job's row and no lock is held that other transactions enqueuing to the same queue
would wait for.

The stored message is the one ``apply_async`` would have sent (same headers, properties, body,
routing; ``before_task_publish`` and ``after_task_publish`` fire), because it *is* Celery's own
``apply_async``/``send_task``, given a kombu connection whose channel writes through the
caller's connection. ``after_task_publish`` therefore means "written in your transaction", not
"committed".

Failure modes, each raised before anything is written (except a failing ``INSERT`` itself,
which aborts the caller's transaction as any failing statement does):

* :class:`~kombu_pgskip.exceptions.NotAConnection`: not a supported connection object;
* :class:`~kombu_pgskip.exceptions.ConnectionInAutocommit`: the job would commit on its own;
* :class:`~kombu_pgskip.exceptions.TransactionAborted`: an earlier statement failed;
* :class:`~kombu_pgskip.exceptions.ConnectionClosed`;
* :class:`~kombu_pgskip.exceptions.SchemaNotInstalled` / ``SchemaOutdated`` / ``SchemaTooNew``;
* :class:`~kombu_pgskip.exceptions.UnsupportedCanvas`: a chord (see below);
* :class:`~kombu_pgskip.exceptions.ConfigurationError`: the app's broker is not ``pgskip://``.

Canvas
======
Tasks, signatures, ``chain`` (its first step is written now, the rest travel in the message as
with ``apply_async``), ``group``, ``chunks``, ``xmap``/``xstarmap``. Chords are refused:
Celery's ``chord.apply_async`` does not pass the connection on, so its header would be
published through the app's broker connection, outside the transaction. That includes a chain
whose first step is a group followed by more tasks, which Celery turns into a chord.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from functools import cached_property
from typing import Any

import psycopg
from amqp.protocol import queue_declare_ok_t
from celery import current_app
from celery.canvas import Signature, _chain, chord, group, maybe_signature
from celery.result import AsyncResult
from kombu.connection import Connection as KombuConnection
from kombu.messaging import Producer
from kombu.transport import virtual
from kombu.utils.uuid import uuid as kombu_uuid
from psycopg import pq, sql

from . import exceptions
from .adapters import (
    Adapter,
    AfterCommitBlock,
    Query,
    adapt,
    after_commit_blocks,
    psycopg_depth,
    pyformat_text,
)
from .executor import CallerConnection
from .migrate import Applied, latest_version, require_version
from .options import CALLER_CONNECTION_OPTION
from .sql import quote_ident
from .store import Store
from .transport import Channel, Options, Transport

logger = logging.getLogger(__name__)

_ADAPTER_OPTION = CALLER_CONNECTION_OPTION

# The schema check, as migrate.check_schema does it, in statements that cannot fail (and so
# cannot abort the caller's transaction) when the schema is missing.
_CHECK_QUERIES = {
    "migrations_table": "SELECT to_regclass(%(migrations)s) IS NOT NULL",
    "schema_version": "SELECT max(version) FROM {schema}.migrations",
    # compatible_with through to_jsonb: a migrations table made before that column existed
    # answers NULL instead of failing (which would abort the caller's transaction).
    "applied": "SELECT version, name, checksum, (to_jsonb(m)->>'compatible_with')::integer"
    " FROM {schema}.migrations AS m ORDER BY version",
}


@functools.cache
def _check_statements(schema: str) -> dict[str, tuple[Query, str]]:
    ident = sql.Identifier(schema)
    return {
        name: (sql.SQL(text).format(schema=ident), pyformat_text(text, schema))
        for name, text in _CHECK_QUERIES.items()
    }


_VirtualChannel: Any = virtual.Channel
_KombuConnection: Any = KombuConnection


class _CallerChannel(Channel):
    """A publishing channel on the caller's connection.

    It declares nothing in the database: declaring upserts the queue's row, and inside the
    caller's transaction that row lock would be held until commit, so every other transaction
    enqueuing to the same queue would wait for this one. Publishing does not need the row; the
    worker consuming the queue declares it. Exchanges and bindings stay in memory, as kombu's
    virtual transports keep them, so that routing through an exchange works.
    """

    def queue_declare(self, queue: str | None = None, passive: bool = False, **kwargs: Any) -> Any:
        name = queue or f"amq.gen-{kombu_uuid()}"
        return queue_declare_ok_t(name, 0, 0)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        return None

    def exchange_declare(self, *args: Any, **kwargs: Any) -> None:
        _VirtualChannel.exchange_declare(self, *args, **kwargs)

    def queue_bind(self, *args: Any, **kwargs: Any) -> None:
        _VirtualChannel.queue_bind(self, *args, **kwargs)

    def _queue_bind(self, *args: Any, **kwargs: Any) -> None:
        return None


class _CallerTransport(Transport):
    """The pgskip transport with every statement on the caller's connection.

    No error is recoverable by reconnecting: the caller's transaction cannot be replayed, so
    kombu must not retry; errors reach the caller unchanged.
    """

    Channel = _CallerChannel
    connection_errors = ()  # type: ignore[assignment,unused-ignore]
    channel_errors = ()  # type: ignore[assignment,unused-ignore]
    recoverable_connection_errors = ()
    recoverable_channel_errors = ()

    @staticmethod
    def _client_url(client: Any) -> str:
        return "caller's connection"

    @cached_property
    def store(self) -> Store:
        client: Any = self.client
        adapter: Adapter = client.transport_options[_ADAPTER_OPTION]
        return Store.on(
            CallerConnection(adapter, schema=self.options.schema),
            notify_after_commit=self.options.notify_after_commit,
        )


# Connections whose schema was found installed and current, per schema; weakly keyed by the
# driver's connection object so a pooled connection is checked once in its life.
_schema_ok: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()
_schema_lock = threading.Lock()


def _check_schema(adapter: Adapter, schema: str) -> None:
    """Raise unless ``schema`` is installed at the version this package needs (cached)."""
    key = adapter.identity()
    if key is not None:
        with _schema_lock:
            try:
                if schema in _schema_ok.get(key, ()):
                    return
            except TypeError:  # not weakly referenceable: check every time
                key = None
    statements = _check_statements(schema)
    migrations = f"{quote_ident(schema)}.migrations"
    query, text = statements["migrations_table"]
    installed = bool(adapter.run(query, text, {"migrations": migrations})[0][0])
    current = 0
    applied: list[Applied] | None = None
    if installed:
        query, text = statements["schema_version"]
        current = int(adapter.run(query, text, {})[0][0] or 0)
        if current > latest_version():
            # A newer schema: the code runs against it if every migration since says so.
            query, text = statements["applied"]
            applied = [
                Applied(int(r[0]), str(r[1]), str(r[2]), None if r[3] is None else int(r[3]))
                for r in adapter.run(query, text, {})
            ]
    require_version(
        schema,
        current,
        where=f" in the database of the caller's {adapter.driver} connection",
        applied=applied,
    )
    if key is not None:
        with _schema_lock, suppress(TypeError):
            _schema_ok.setdefault(key, set()).add(schema)


# app -> (the broker settings it was checked with, whether they name the pgskip transport)
_broker_checked: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], bool]] = (
    weakref.WeakKeyDictionary()
)


def _require_pgskip_broker(app: Any) -> None:
    """The job is written where ``pgskip://`` workers read: refuse apps whose broker is another."""
    conf = app.conf
    settings = (conf.broker_write_url, conf.broker_url, conf.broker_transport)
    cached = _broker_checked.get(app)
    if cached is not None and cached[0] == settings:
        ok = cached[1]
    else:
        try:
            transport_cls = app.connection_for_write().get_transport_cls()
            ok = isinstance(transport_cls, type) and issubclass(transport_cls, Transport)
        except Exception:  # an unknown or unimportable transport
            ok = False
        _broker_checked[app] = (settings, ok)
    if not ok:
        raise exceptions.ConfigurationError(
            f"the Celery app {app.main!r} does not use the kombu-pgskip broker: apply_async_in "
            "writes the job into PostgreSQL, where only pgskip:// workers read it; set "
            "broker_url = 'pgskip://user:password@host:5432/dbname'"
        )


@contextmanager
def _enqueue_on(conn: object, app: Any) -> Iterator[tuple[KombuConnection, Producer]]:
    """A kombu connection and producer whose every statement runs on ``conn``."""
    _require_pgskip_broker(app)
    adapter = adapt(conn)
    adapter.check()
    options = dict(app.conf.broker_transport_options or {})
    schema = Options.from_transport_options(options).schema  # validated as the broker does
    _check_schema(adapter, schema)
    options[_ADAPTER_OPTION] = adapter
    # Not the broker URL as hostname: kombu would read a transport from a "pgskip+..." scheme.
    kconn: Any = _KombuConnection(
        "localhost", transport=_CallerTransport, transport_options=options
    )
    try:
        producer = app.amqp.Producer(kconn, auto_declare=False)
        yield kconn, producer
    finally:
        kconn.release()  # our kombu objects only; the caller's connection stays as it was


_OWN_OPTIONS = ("connection", "producer", "publisher")


def _check_options(options: Mapping[str, Any], what: str) -> dict[str, Any]:
    for name in _OWN_OPTIONS:
        if options.get(name) is not None:
            raise TypeError(
                f"{what} writes through the connection you pass; {name}= is not allowed"
            )
    if options.get("retry"):
        raise TypeError(
            f"{what} cannot retry: a failed statement aborts your transaction, so there is "
            "nothing to retry in it (omit retry=)"
        )
    return {k: v for k, v in options.items() if k not in (*_OWN_OPTIONS, "retry")}


def _refuse_chords(sig: Any, app: Any) -> None:
    """Raise :class:`UnsupportedCanvas` if publishing ``sig`` now would publish a chord."""
    if isinstance(sig, chord):
        raise exceptions.UnsupportedCanvas()
    if isinstance(sig, group):
        for task in sig.tasks:
            _refuse_chords(maybe_signature(task, app=app), app)
    elif isinstance(sig, _chain):
        steps = _flatten_chain(sig, app)
        if not steps:
            return
        first = steps[0]
        if isinstance(first, group) and len(steps) > 1:
            raise exceptions.UnsupportedCanvas(
                f"{exceptions.UnsupportedCanvas.default_message()} (a chain that starts with a "
                "group followed by more tasks is a chord to Celery)"
            )
        _refuse_chords(first, app)


def _flatten_chain(sig: Any, app: Any) -> list[Any]:
    steps: list[Any] = []
    for task in sig.tasks:
        task = maybe_signature(task, app=app)
        if isinstance(task, _chain):
            steps.extend(_flatten_chain(task, app))
        else:
            steps.append(task)
    return steps


def apply_async_in(
    conn: object,
    task: Any,
    args: Any = None,
    kwargs: Any = None,
    **options: Any,
) -> AsyncResult:
    """Enqueue ``task`` (a task, a signature, a chain or group) inside ``conn``'s transaction.

    ``conn`` is the caller's open connection: a psycopg 3 connection or cursor, a psycopg2
    connection or cursor, a SQLAlchemy ``Connection`` or ``Session``, or Django's
    ``connection`` inside ``transaction.atomic()``. It is never committed, rolled back or
    closed. ``options`` are those of ``apply_async`` (queue, exchange, routing_key, priority,
    countdown, eta, expires, headers, task_id, link, link_error, serializer, ...), with the same
    meaning; ``connection``, ``producer`` and ``retry=True`` are refused.

    Commit: the job exists and idle workers wake at once. Rollback: no job and no wake-up.
    Returns the :class:`~celery.result.AsyncResult` ``apply_async`` returns.

    .. code-block:: python

        with psycopg.connect(dsn) as conn, conn.transaction():
            order_id = create_order(conn, cart)
            apply_async_in(conn, send_invoice_email, args=(order_id,), countdown=5)

    Each of these errors is raised before anything is written (the schema check runs
    statements that cannot fail, so the transaction is still usable after it):

    * :class:`~kombu_pgskip.exceptions.NotAConnection`: ``conn`` is not one of the
      connections above (an ``Engine``, a DSN, an async connection);
    * :class:`~kombu_pgskip.exceptions.ConnectionInAutocommit`: the job would be committed
      on its own; open a transaction first;
    * :class:`~kombu_pgskip.exceptions.TransactionAborted`: an earlier statement of the
      transaction failed; roll back (or to a savepoint) first;
    * :class:`~kombu_pgskip.exceptions.ConnectionClosed`;
    * :class:`~kombu_pgskip.exceptions.SchemaNotInstalled`,
      :class:`~kombu_pgskip.exceptions.SchemaOutdated`,
      :class:`~kombu_pgskip.exceptions.SchemaTooNew`: the database ``conn`` is connected to
      has no pgskip schema, or one of another version;
    * :class:`~kombu_pgskip.exceptions.UnsupportedCanvas`: a chord, or a chain that starts
      with a group followed by more tasks (Celery would publish its header outside the
      transaction);
    * :class:`~kombu_pgskip.exceptions.ConfigurationError`: the task's app does not use the
      ``pgskip://`` broker.

    A failing ``INSERT`` of the job itself (the role lacks the privilege, say) aborts the
    transaction as any failing statement does.
    """
    if isinstance(task, dict):
        task = maybe_signature(task)
    if not callable(getattr(task, "apply_async", None)):
        raise TypeError(f"apply_async_in needs a Celery task or signature, got {task!r}")
    opts = _check_options(options, "apply_async_in")
    app = task.app if isinstance(task, Signature) else task._get_app()
    _refuse_chords(task, app)
    with _enqueue_on(conn, app) as (kconn, producer):
        result: AsyncResult = task.apply_async(
            args, kwargs, connection=kconn, producer=producer, retry=False, **opts
        )
    logger.debug(
        "task %s written in the caller's transaction",
        result.id,
        extra={"action": "apply_async_in"},
    )
    return result


def send_task_in(
    conn: object,
    name: str,
    args: Any = None,
    kwargs: Any = None,
    *,
    app: Any = None,
    **options: Any,
) -> AsyncResult:
    """Enqueue the task called ``name`` inside ``conn``'s transaction, as ``app.send_task``.

    For tasks whose code is not importable here. ``app`` defaults to Celery's current app,
    and must use the ``pgskip://`` broker. Everything else (connections, options, the
    guarantee, the errors) is as :func:`apply_async_in`.

    .. code-block:: python

        with psycopg.connect(dsn) as conn, conn.transaction():
            send_task_in(conn, "billing.send_invoice", args=(order_id,), app=app)
    """
    app = app if app is not None else current_app
    opts = _check_options(options, "send_task_in")
    with _enqueue_on(conn, app) as (kconn, _producer):
        result: AsyncResult = app.send_task(
            name, args, kwargs, connection=kconn, retry=False, **opts
        )
    logger.debug(
        "task %s (%s) written in the caller's transaction",
        result.id,
        name,
        extra={"action": "send_task_in"},
    )
    return result


@contextmanager
def transaction(
    conn: Any, savepoint_name: str | None = None, force_rollback: bool = False
) -> Iterator[psycopg.Transaction]:
    """``conn.transaction()`` on a psycopg 3 connection, with the NOTIFYs of the jobs enqueued
    inside sent after its commit instead of inside it.

    .. code-block:: python

        with kombu_pgskip.transaction(conn):
            order_id = create_order(conn, cart)
            apply_async_in(conn, send_invoice_email, args=(order_id,))

    Inside a plain ``conn.transaction()``, :func:`apply_async_in` and :func:`apply_many_in`
    send their NOTIFY in the transaction, and PostgreSQL then holds its cluster-wide NOTIFY
    lock from the commit until the commit is flushed (and confirmed by a synchronous standby):
    transactions that enqueue commit one at a time. Here the jobs are written without it, and
    once the outermost block has committed, one statement on ``conn`` (in autocommit: it leaves
    no transaction open) sends one NOTIFY per queue, as on Django.
    A rollback, an exception, :class:`psycopg.Rollback` or ``force_rollback`` sends nothing.
    The extra statement costs a round trip and a small transaction: it pays where many
    processes enqueue and commits are slow (network storage, a synchronous standby), and
    slows a single process on a fast local disk (docs/transactional-enqueue.md).

    Nested blocks of this function are savepoints whose jobs are announced only if they were
    kept. Jobs written inside a plain ``conn.transaction()`` opened within the block, or in a
    block entered while ``conn`` was already in a transaction (its commit is not this block's)
    or in pipeline mode, keep their NOTIFY inside the transaction, as without this function.
    Yields psycopg's :class:`~psycopg.Transaction`; takes the arguments of
    ``conn.transaction()``. Raises :class:`~kombu_pgskip.exceptions.NotAConnection` for
    anything but a psycopg 3 connection or cursor.
    """
    if isinstance(conn, psycopg.Cursor):
        conn = conn.connection
    if not isinstance(conn, psycopg.Connection):
        raise exceptions.NotAConnection(
            "kombu_pgskip.transaction() takes a psycopg 3 connection or cursor, got "
            f"{type(conn).__module__}.{type(conn).__qualname__}; on Django use "
            "transaction.atomic() (apply_async_in already sends its NOTIFY after the commit "
            "there); with other drivers, open the transaction as usual"
        )
    blocks = after_commit_blocks(conn)
    parent = blocks[-1] if blocks else None
    if parent is not None:
        deferring = parent.depth is not None and psycopg_depth(conn) == parent.depth
    else:
        deferring = (
            conn.info.transaction_status == pq.TransactionStatus.IDLE
            and conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
        )
    kept = False
    with conn.transaction(savepoint_name, force_rollback) as tx:
        block = AfterCommitBlock(psycopg_depth(conn) if deferring else None)
        blocks.append(block)
        try:
            yield tx
            kept = not force_rollback
        finally:
            blocks.pop()
    # Committed (or, nested, released): psycopg raised otherwise, or swallowed a Rollback.
    if not kept or not block.callbacks:
        return
    if parent is not None:
        parent.absorb(block.callbacks)
        return
    for callback in block.callbacks:
        callback()


__all__ = ["apply_async_in", "send_task_in", "transaction"]
