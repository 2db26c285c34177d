"""kombu transport for PostgreSQL: messages are rows, fetched with ``FOR UPDATE SKIP LOCKED``.

Features
========
* Type: virtual
* Supports direct, topic and fanout exchanges, with exchanges and bindings stored in the database
  so that every process routes through the bindings of every other (Celery remote control and
  events, Flower)
* Supports queue expiry (``x-expires``), auto-delete queues and no-ack consumption
* Supports priority 0-9 (9 first, AMQP order), clamped to a queue's ``x-max-priority``
* Supports TTL (``expiration`` / ``x-message-ttl``)
* Supports at-least-once delivery: a message leaves the table only when acknowledged

Connection string
=================
.. code-block::

    pgskip://user:password@host:5432/dbname?sslmode=require
    pgskip+postgresql://user:password@host1,host2/dbname?target_session_attrs=read-write

The query string holds libpq options. The password never appears in logs or ``repr``.
``broker_transport = "kombu_pgskip.transport:Transport"`` works too if ``kombu_pgskip`` cannot be
imported before the URL is parsed.

A message's life
================
``pending -> running`` when a consumer fetches it (one statement, ``UPDATE ... FROM (SELECT ...
FOR UPDATE SKIP LOCKED)``, up to the consumer's free prefetch credit); ``running -> completed`` on
ack (deleted instead with ``keep_completed=False``); ``running -> pending`` on requeue, on
channel close, or when its consumer's lease runs out (``redelivered`` is then true);
``running -> failed`` on reject without requeue or after ``max_attempts`` deliveries. A message
whose ``eta`` is more than ``eta_threshold`` seconds away is stored as ``scheduled`` and promoted
to ``pending`` when due, so workers do not hold it.

Every consumer has a lease (a row in ``consumers``) that a heartbeat thread renews every
``lease_seconds / 3``; a consumer that dies stops renewing, and after ``lease_seconds`` any live
worker's sweeper (every ``sweep_interval``) puts its rows back to ``pending``. Acks are fenced by
(consumer, delivery token, unique to each delivery): an ack from a consumer that lost its lease,
or of an earlier delivery of the same message, changes nothing.
Acks wait for the consumer's next fetch and are written by the same statement (or on their
own, at the latest by the heartbeat thread): a crash before that can only cause a redelivery.

Workers wake at commit through LISTEN/NOTIFY, with a poll every ``polling_interval`` as fallback.
The transport is asynchronous: a Celery worker runs its event loop (the LISTEN socket and a
self-pipe woken by acks are watched by kombu's hub), so it keeps answering remote control and
sending heartbeats while every prefork process is busy.

Routing
=======
Exchanges and bindings are rows (``exchanges``, ``bindings``), so a message published in one
process reaches queues bound in another: a publish to a named exchange is one statement that
finds the bound queues (direct: equal routing key; topic: pattern match; fanout: all) and inserts
a row into each. Queues declared with ``x-expires`` are deleted, with their messages and
bindings, once no live consumer used them for that long (live workers' sweepers, or pg_cron,
call ``<schema>.expire_queues()``), and no publish writes to them after that; ``auto_delete``
queues go when their last consumer cancels. No-ack consumers take rows with
``DELETE ... RETURNING``. See docs/celery-compatibility.md.

Transport options
=================
============================  =========  ==========================================================
option                        default    meaning
============================  =========  ==========================================================
``schema``                    "pgskip"   schema holding the tables (``pgskip migrate`` installs it)
``polling_interval``          1.0        seconds between polls when no notification arrives
``listen``                    True       use LISTEN/NOTIFY; False = poll only (PgBouncer
                                         transaction pooling)
``lease_seconds``             30.0       a consumer silent this long is dead; its rows return
``sweep_interval``            10.0       how often each worker sweeps dead consumers' rows
``max_attempts``              20         deliveries before a message goes to ``failed``
``eta_threshold``             2.0        ETAs further away than this wait in the database
``fetch_limit``               100        most messages fetched in one statement
``fetch_max_bytes``           16777216   payload bytes after which a fetch takes no further
                                         message (it always takes one, however large): one
                                         fetch's result, all in memory at once, holds less
                                         than this plus one message. A fetch that stops
                                         short is followed by another while prefetch credit
                                         remains
``max_message_size``          67108864   bytes of encoded message accepted by publish
                                         (at most 268435456)
``connect_timeout``           10         seconds to wait for a connection
``check_schema``              True       refuse to run against a missing or outdated schema
``synchronous_acks``          False      False: fetches and acks run on a connection of their
                                         own with ``synchronous_commit = off`` (a server crash
                                         can redeliver, never lose); True behind PgBouncer in
                                         transaction pooling
``async_fetch``               True       fetch on a connection of its own (the statement
                                         prepared once, with a generic plan); inside Celery's
                                         event loop without blocking the loop (rows are
                                         delivered when the reply arrives). False: on the
                                         consumer connection, waiting for the reply
``durable_publish``           True       False: publishes commit with ``synchronous_commit =
                                         off`` (faster; a PostgreSQL crash can lose publishes
                                         acknowledged in the last ~0.6 s; opt-in only)
``notify_after_commit``       True       a durable publish sends its NOTIFY in a transaction
                                         of its own, behind the insert's in the same round
                                         trip, so concurrent publishers' commits are not
                                         serialised by PostgreSQL's cluster-wide NOTIFY lock
                                         (two transaction ids per publish); apply_async_in and
                                         apply_many_in on Django, on a SQLAlchemy Session and
                                         in kombu_pgskip.transaction() send theirs after the
                                         caller's commit, one statement for all.
                                         False: the NOTIFY in the insert's transaction (one id)
``xmin_horizon_warning``      300.0      log a WARNING naming the session, prepared transaction
                                         or replication slot that has held the database's xmin
                                         horizon this many seconds (dead rows cannot be
                                         vacuumed meanwhile); 0 disables (see health.py)
``prepared_statements``       True       let psycopg prepare frequent statements; False behind
                                         PgBouncer in transaction pooling (before 1.21, or
                                         without ``max_prepared_statements``)
``fetch_cooldown``            0.002      a notification's fetch waits until this many seconds
                                         after the previous fetch was sent (in Celery's event
                                         loop and in a blocking ``drain_events``), so while
                                         tasks stream in one fetch takes the messages of that
                                         moment together; an idle worker fetches at once.
                                         0: every notification fetches
``fetch_cooldown_max``        0.02       the cooldown grows towards this while notified
                                         fetches come back empty (other workers on the queue
                                         took the message) and shrinks back to
                                         ``fetch_cooldown`` while they take rows; at or below
                                         ``fetch_cooldown``: a fixed cooldown
``keep_completed``            True       an ack marks its message ``completed`` (kept until the
                                         prune job's ``completed_retention``). False: an ack
                                         deletes it; failed messages are kept either way
============================  =========  ==========================================================
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from queue import Empty
from typing import Any

import psycopg
from amqp.protocol import queue_declare_ok_t
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from . import exceptions
from .envelope import (
    MAX_MESSAGE_SIZE_LIMIT,
    decode_problem,
    make_tag,
    parse_tag,
    to_message,
    to_routed_row,
    to_row,
    validate_queue_name,
)
from .fetcher import AsyncFetcher, Cooldown
from .health import HorizonMonitor
from .store import (
    FetchedRow,
    NewMessage,
    Store,
    fetch_filled,
    notify_channel,
    scheduled_channel,
    validate_schema_name,
)
from .urls import build_url, connect, mask_url, to_conninfo

logger = logging.getLogger(__name__)

#: Seconds the event loop waits before a small refill (less than half the prefetch window free
#: while the rest is still held): acks freeing more credit meanwhile make one larger fetch.
REFILL_DELAY = 0.001

#: Seconds an ack may wait in the event loop for a fetch to carry it when nothing asks for a
#: fetch sooner (a notification, or credit freed while messages were left behind for lack of
#: it). While tasks stream in, the next notification's fetch writes it; on an idle worker one
#: fetch this much later does. Unwritten acks only delay a row's ``completed``: a crash
#: meanwhile redelivers, never loses.
ACK_FLUSH_DELAY = 0.005


@dataclass
class Options:
    """Transport options, validated. See the module docstring for their meaning."""

    schema: str = "pgskip"
    polling_interval: float = 1.0
    listen: bool = True
    lease_seconds: float = 30.0
    sweep_interval: float = 10.0
    max_attempts: int = 20
    eta_threshold: float = 2.0
    fetch_limit: int = 100
    fetch_max_bytes: int = 16 * 1024 * 1024
    max_message_size: int = 64 * 1024 * 1024
    connect_timeout: float = 10.0
    check_schema: bool = True
    synchronous_acks: bool = False
    async_fetch: bool = True
    durable_publish: bool = True
    notify_after_commit: bool = True
    xmin_horizon_warning: float = 300.0
    prepared_statements: bool = True
    fetch_cooldown: float = 0.002
    fetch_cooldown_max: float = 0.02
    keep_completed: bool = True

    @property
    def connect_kwargs(self) -> dict[str, Any]:
        """psycopg arguments for every broker connection of a transport."""
        kwargs: dict[str, Any] = {"connect_timeout": self.connect_timeout}
        if not self.prepared_statements:
            # Transaction pooling runs each statement on any server connection: a statement
            # psycopg prepared on one is unknown, or another statement, on the next.
            kwargs["prepare_threshold"] = None
        if not self.listen:
            # Poll-only is the mode for PgBouncer in transaction pooling, where a session
            # setting would reach whichever client uses the server session next.
            kwargs["pin_search_path"] = False
        return kwargs

    @classmethod
    def from_transport_options(cls, options: dict[str, Any]) -> Options:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in options.items():
            if name not in known:
                continue  # kombu and Celery pass their own options through the same dict
            default = getattr(cls, name)
            try:
                if isinstance(default, bool):
                    if isinstance(value, str):
                        value = value.strip().lower() in ("1", "true", "yes", "on")
                    values[name] = bool(value)
                else:
                    values[name] = type(default)(value)
            except (TypeError, ValueError):
                raise exceptions.ConfigurationError(
                    f"transport option {name}={value!r}: expected {type(default).__name__}"
                ) from None
        opts = cls(**values)
        opts.validate()
        return opts

    def validate(self) -> None:
        validate_schema_name(self.schema)
        for name in ("polling_interval", "lease_seconds", "sweep_interval", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise exceptions.ConfigurationError(f"transport option {name} must be > 0")
        if self.lease_seconds < 3:
            raise exceptions.ConfigurationError("transport option lease_seconds must be >= 3")
        if (
            self.max_attempts < 1
            or self.fetch_limit < 1
            or self.fetch_max_bytes < 1
            or not 1024 <= self.max_message_size <= MAX_MESSAGE_SIZE_LIMIT
        ):
            raise exceptions.ConfigurationError(
                "transport options max_attempts, fetch_limit and fetch_max_bytes must be >= 1, "
                f"max_message_size between 1024 and {MAX_MESSAGE_SIZE_LIMIT}"
            )
        for name in (
            "eta_threshold",
            "xmin_horizon_warning",
            "fetch_cooldown",
            "fetch_cooldown_max",
        ):
            if getattr(self, name) < 0:
                raise exceptions.ConfigurationError(f"transport option {name} must be >= 0")


@dataclass
class _Collected:
    """A publish buffered by :meth:`Channel.collecting`: to ``row.queue``, or (``exchange``
    set) to every queue the exchange routes ``routing_key`` to, plus ``local`` ones."""

    row: NewMessage
    exchange: str | None = None
    routing_key: str = ""
    local: tuple[str, ...] = ()


class QoS(virtual.QoS):
    """Prefetch accounting from kombu; acks, rejects and restores become fenced row updates."""

    channel: Channel

    def ack(self, delivery_tag: Any) -> None:
        if self.channel.connection is None:
            self._settle_after_close("ack", delivery_tag)
            return
        if self.channel._batching_acks():
            # Written with the next fetch, together with every other ack that arrived
            # meanwhile: one statement instead of one per message. An ack lost in a crash
            # before it is written can only cause a redelivery, never a loss.
            first = self.channel._queue_ack(delivery_tag)
            self._quick_ack(delivery_tag)
            self.channel._ack_queued(first)
            return
        self.channel._settle("ack", [delivery_tag])
        self._quick_ack(delivery_tag)
        self.channel._credit_freed()

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if self.channel.connection is None:
            self._settle_after_close("requeue" if requeue else "reject", delivery_tag)
            return
        self.channel._settle("requeue" if requeue else "fail", [delivery_tag])
        self._quick_ack(delivery_tag)
        self.channel._credit_freed()

    def _settle_after_close(self, how: str, delivery_tag: Any) -> None:
        """A task finished after its channel closed (the connection was lost meanwhile).

        There is no connection to write through: the message stays ``running`` under this
        channel's consumer until the lease runs out, then runs again. Celery would treat an
        exception here as fatal and stop the worker.
        """
        logger.warning(
            "%s of message %s after its channel closed (connection lost): not written; the "
            "message returns to the queue when consumer %s's lease expires",
            how,
            delivery_tag,
            self.channel.consumer_id,
            extra={"action": f"{how}_after_close"},
        )
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Return every delivered, unacknowledged message to ``pending`` in one statement."""
        self._flush()
        tags = list(self._delivered)
        self._delivered.clear()
        if tags and self.channel.owned_by_this_process:
            try:
                self.channel._settle("requeue", tags)
            except Exception as exc:
                # Not lost: the consumer's lease runs out and the sweeper returns them.
                logger.warning(
                    "could not requeue %d unacked messages now (%s); they return to pending "
                    "when this consumer's lease expires",
                    len(tags),
                    exc,
                    extra={"action": "restore_failed"},
                )
        return []

    def restore_unacked_once(self, stderr: Any = None) -> None:
        if not self.channel.owned_by_this_process:
            self._on_collect.cancel()
            self._delivered.clear()
            return
        super().restore_unacked_once(stderr)


class Channel(virtual.Channel):
    """A kombu channel over the transport's shared connection.

    Exchanges and bindings are stored in the database as well as in kombu's per-process
    ``BrokerState``, and routing reads them, so a message published in one process reaches the
    queues another process bound: Celery's remote control (fanout ``celery.pidbox``, replies on
    a direct exchange to a queue only the caller declared) and events (topic ``celeryev``).
    """

    QoS = QoS
    connection: Transport

    #: kombu calls :meth:`_queue_bind` for every binding (the bindings are shared state).
    supports_fanout = True

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._pid = os.getpid()
        self.consumer_id = uuid.uuid4()
        self._tag_prefix = f"{uuid.uuid4().hex}."
        self._tags = itertools.count(1)
        self._ack_lock = threading.Lock()
        self._pending_acks: list[tuple[int, int]] = []
        self._refill_deferred = False
        self._more_due = False
        # Messages may be waiting that the last fetch left for lack of prefetch credit: an
        # ack (freeing credit) then asks for a fetch at once instead of waiting to be carried.
        self._starved = False
        self._fetcher: AsyncFetcher | None = None
        self._fetch_acks = 0  # acks sent with the fetch in flight
        self._sent_wake_seq = 0  # Transport._wake_seq when the fetch in flight was sent
        self._notified_fetch = False  # whether a notification came before it was sent
        self._collected: list[_Collected] | None = None
        self._registered = False
        self._no_ack_queues: set[str] = set()
        # Whether its no-ack queues are to be fetched at the next fetch (Transport._skips_noack).
        self._noack_due = True
        # Queues this channel declared with auto_delete: dropped when it stops consuming them.
        self._auto_delete_queues: set[str] = set()
        # Fail early, on the connection attempt, if the server or the schema is unusable.
        self.store.connect()

    def _next_delivery_tag(self) -> str:
        """The tag kombu stores in each message it publishes: unique per message, without
        kombu's ``uuid4`` (a system call) per publish. A consumer never sees it: a delivered
        message's tag is its row id and attempt (:func:`~kombu_pgskip.envelope.to_message`)."""
        return f"{self._tag_prefix}{next(self._tags)}"

    @property
    def owned_by_this_process(self) -> bool:
        return self._pid == os.getpid()

    @property
    def store(self) -> Store:
        return self.connection.store

    @property
    def consumer_store(self) -> Store:
        return self.connection.consumer_store

    @property
    def options(self) -> Options:
        return self.connection.options

    # -- kombu virtual API -------------------------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        row = to_row(
            queue,
            message,
            eta_threshold=self.options.eta_threshold,
            max_message_size=self.options.max_message_size,
        )
        if self._collected is not None:
            self._collected.append(_Collected(row))
        else:
            self.store.publish(row)

    @contextmanager
    def collecting(self) -> Iterator[list[int]]:
        """Buffer every publish in the block; write them all with one statement at its end.

        Yields a list that holds the new rows' ids once the block has ended. A block that
        raises writes nothing. Routing through exchanges is resolved at the end, once per
        (exchange, routing key). A nested block writes with the outermost one (its list stays
        empty). See :func:`kombu_pgskip.bulk.batch`.
        """
        ids: list[int] = []
        if self._collected is not None:
            yield ids
            return
        self._collected = []
        try:
            yield ids
            collected = self._collected
        finally:
            self._collected = None
        ids.extend(self._write_collected(collected))

    def _write_collected(self, collected: list[_Collected]) -> list[int]:
        rows = list(self._rows_of(collected))
        return self.store.publish_many(rows) if rows else []

    def write_streamed(self, collected: Iterable[_Collected]) -> list[int]:
        """Write publishes that are still being made (``collected`` builds them lazily) in one
        transaction: :meth:`~kombu_pgskip.store.Store.publish_stream`."""
        return self.store.publish_stream(self._rows_of(collected))

    def _rows_of(self, collected: Iterable[_Collected]) -> Iterator[NewMessage]:
        """The rows of buffered publishes, routed: through an exchange, once per (exchange,
        routing key), to the queues bound by every process plus this process's own."""
        routes: dict[tuple[str, str], list[str]] = {}
        targets_of: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
        for item in collected:
            if item.exchange is None:
                yield item.row
                continue
            by = (item.exchange, item.routing_key, item.local)
            targets = targets_of.get(by)
            if targets is None:
                key = (item.exchange, item.routing_key)
                if key not in routes:
                    routes[key] = self.store.route(*key)
                targets = sorted({*item.local, *routes[key]})
                if not targets and self.deadletter_queue:
                    targets = [self.deadletter_queue]
                targets_of[by] = targets
            row = item.row
            for queue in targets:
                yield row.to(queue)

    def create_publish_batch(self, max_size: int) -> PublishBatch:
        """kombu's ``Producer.batch()``: publishes buffered, written ``max_size`` at a time."""
        return PublishBatch(self, max_size)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        validate_queue_name(queue)
        self._ensure_registered([queue])
        rows = self.consumer_store.fetch([queue], 1, self.consumer_id)
        if not rows:
            raise Empty()
        return to_message(rows[0])

    def _purge(self, queue: str) -> int:
        return self.store.purge(validate_queue_name(queue))

    def _size(self, queue: str) -> int:
        return self.store.size(validate_queue_name(queue))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(validate_queue_name(queue))

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        auto_delete = bool(kwargs.get("auto_delete", False))
        self.store.declare_queue(
            validate_queue_name(queue),
            durable=bool(kwargs.get("durable", True)),
            auto_delete=auto_delete,
            arguments=kwargs.get("arguments"),
        )
        if auto_delete:
            self._auto_delete_queues.add(queue)
        else:
            self._auto_delete_queues.discard(queue)

    def queue_declare(self, queue: str | None = None, passive: bool = False, **kwargs: Any) -> Any:
        """As kombu's, except that a passive declaration of an existing queue declares nothing
        (AMQP: it only asks whether the queue exists, whatever the arguments given)."""
        if passive and queue and self._has_queue(queue):
            return queue_declare_ok_t(queue, self._size(queue), 0)
        return super().queue_declare(queue, passive=passive, **kwargs)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(validate_queue_name(queue))

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> dict[str, Any]:
        """``Queue(expires=, message_ttl=, max_priority=, ...)`` as ``x-`` arguments, as AMQP."""
        result: dict[str, Any] = to_rabbitmq_queue_arguments(arguments, **kwargs)
        return result

    # -- exchanges, bindings and routing ---------------------------------------------------------

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        type = type or "direct"
        exchange = exchange or f"amq.{type}"
        if passive:
            if exchange not in self.state.exchanges:
                stored = self.store.exchange_type(exchange)
                if stored is None:
                    raise ChannelError(
                        f"NOT_FOUND - no exchange {exchange!r}",
                        (50, 10),
                        "Channel.exchange_declare",
                        "404",
                    )
                self._remember_exchange(exchange, stored)
            return
        # The database first: a declaration it refuses leaves this process's state alone.
        self.store.declare_exchange(
            exchange, type, durable=durable, auto_delete=auto_delete, arguments=arguments
        )
        super().exchange_declare(
            exchange, type, durable, auto_delete, arguments, nowait=nowait, passive=False
        )

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        """Delete ``exchange`` and its bindings everywhere; the bound queues stay (as AMQP)."""
        self.store.delete_exchange(exchange)
        self.state.exchanges.pop(exchange, None)
        for key in [k for k in self.state.bindings if k[1] == exchange]:
            self.state.binding_delete(*key)

    def _remember_exchange(self, exchange: str, type: str) -> None:
        self.state.exchanges.setdefault(
            exchange,
            {"type": type, "durable": True, "auto_delete": False, "arguments": {}, "table": []},
        )

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Bind ``queue`` to ``exchange``, in the database (for every process) and in memory.

        Written to the database even when this process already knows the binding: the queue
        may have expired or been deleted by another process since.
        """
        exchange = exchange or "amq.direct"
        if exchange not in self.state.exchanges:
            self._remember_exchange(exchange, self.store.exchange_type(exchange) or "direct")
        meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        key, pattern, target = meta
        self._store_binding(exchange, key, pattern, target, arguments=arguments)
        if not self.state.has_binding(queue, exchange, routing_key):
            self.state.binding_declare(queue, exchange, routing_key, arguments)
            self.state.exchanges[exchange].setdefault("table", []).append(meta)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: Any, queue: str) -> None:
        self._store_binding(exchange, routing_key, pattern, queue)

    def _store_binding(
        self,
        exchange: str,
        routing_key: str,
        pattern: Any,
        queue: str,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        self.store.bind(
            validate_queue_name(queue),
            exchange,
            routing_key or "",
            type=self.typeof(exchange).type,
            pattern=pattern if isinstance(pattern, str) else None,
            arguments=arguments,
        )

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        exchange = exchange or "amq.direct"
        self.store.unbind(queue, exchange, routing_key or "")
        if exchange in self.state.exchanges:
            super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        else:
            self.state.binding_delete(queue, exchange, routing_key)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> Any:
        """Delete ``queue`` with its waiting messages and its bindings (of every process)."""
        validate_queue_name(queue)
        if if_empty and self._size(queue):
            return None
        self.store.delete_queue(queue)
        self._forget_queue_bindings(queue)
        self._auto_delete_queues.discard(queue)
        return None

    def _forget_queue_bindings(self, queue: str) -> None:
        for exchange, routing_key, args in list(self.state.queue_bindings(queue)):
            if exchange in self.state.exchanges:
                meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, args)
                table = self.state.exchanges[exchange].get("table", [])
                table[:] = [m for m in table if m != meta]
        self.state.queue_bindings_delete(queue)

    def get_table(self, exchange: str) -> list[tuple[Any, ...]]:
        """The bindings of ``exchange``: this process's and every other's (from the database)."""
        local = list(self.state.exchanges.get(exchange, {}).get("table", []))
        stored = self.store.exchange_table(exchange)
        return local + [m for m in stored if m not in local]

    def _local_targets(self, exchange: str, routing_key: str) -> list[str]:
        """Queues this process bound to ``exchange`` that match (kombu's in-memory routing)."""
        entry = self.state.exchanges.get(exchange)
        if not entry or not entry.get("table"):
            return []
        found = self.typeof(exchange).lookup(entry["table"], exchange, routing_key, None)
        return sorted(q for q in found if q)

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> list[str]:
        """The queues ``exchange`` routes ``routing_key`` to, bound by any process."""
        if default is None:
            default = self.deadletter_queue
        if not exchange:
            return [routing_key or default]
        queues = set(self._local_targets(exchange, routing_key))
        queues.update(self.store.route(exchange, routing_key))
        if not queues and default is not None:
            return [default]
        return sorted(queues)

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        """Publish ``message``: one statement routes it and inserts a row per target queue.

        To the default exchange (``""``) the routing key names the queue. Otherwise the
        database resolves the bindings of every process (direct, topic and fanout), so no
        extra round trip is spent on routing and a broadcast writes one row per live bound
        queue, none for queues whose ``x-expires`` ran out.
        """
        self._inplace_augment_message(message, exchange, routing_key)
        if not exchange:
            self._put(routing_key, message, **kwargs)
            return
        row = to_routed_row(
            exchange,
            message,
            eta_threshold=self.options.eta_threshold,
            max_message_size=self.options.max_message_size,
        )
        local = self._local_targets(exchange, routing_key or "")
        if self._collected is not None:
            self._collected.append(_Collected(row, exchange, routing_key or "", tuple(local)))
            return
        written = self.store.publish_routed(
            row, exchange=exchange, routing_key=routing_key or "", queues=local
        )
        if not written and self.deadletter_queue:
            self._put(self.deadletter_queue, message, **kwargs)
        elif not written:
            logger.debug(
                "message to exchange %r with routing key %r matched no queue; dropped",
                exchange,
                routing_key,
                extra={"action": "unroutable"},
            )

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Take one message; with ``no_ack`` it is deleted as it is taken."""
        validate_queue_name(queue)
        self._ensure_registered([queue])
        rows = self.consumer_store.fetch([queue], 1, self.consumer_id, no_ack=no_ack)
        if not rows:
            return None
        message = self.Message(to_message(rows[0]), channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def basic_consume(
        self,
        queue: str,
        no_ack: bool,
        callback: Callable[..., Any],
        consumer_tag: str,
        **kwargs: Any,
    ) -> Any:
        validate_queue_name(queue)
        if no_ack:
            self._no_ack_queues.add(queue)
            self._noack_due = True
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self._registered = False  # re-register with the new queue list
        self.connection._drained = False  # a new queue: fetch from it at once
        self.connection._wakeup_consumers()
        return result

    def basic_qos(
        self, prefetch_size: int = 0, prefetch_count: int = 0, apply_global: bool = False
    ) -> None:
        super().basic_qos(prefetch_size, prefetch_count, apply_global)
        if self.connection is not None:
            self.connection._drained = False
        self._credit_freed()  # a larger prefetch window: fetch more now

    def basic_cancel(self, consumer_tag: str) -> Any:
        if self.owned_by_this_process and not self.closed:
            self.flush_acks()  # later acks are written one by one once nothing is consumed
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._no_ack_queues.discard(queue)
            self._stopped_consuming(queue)
        return result

    def _stopped_consuming(self, queue: str) -> None:
        """This channel no longer consumes ``queue``: update its lease row; auto-delete."""
        if not self.owned_by_this_process:
            return
        try:
            if self._registered and not self.closed:  # on close, unregistering follows
                self.store.register_consumer(
                    self.consumer_id,
                    hostname=socket.gethostname(),
                    queues=list(dict.fromkeys(self._active_queues)),
                    lease=self.options.lease_seconds,
                )
            if queue in self._auto_delete_queues:
                self._auto_delete_queues.discard(queue)
                self.store.delete_unused_queues([queue], self.consumer_id)
                self._forget_queue_bindings(queue)
        except Exception as exc:
            # Not lost: an expiring queue expires by itself once its consumer is gone.
            logger.warning(
                "could not release queue %r after its consumer was cancelled (%s)",
                queue,
                exc,
                extra={"action": "cancel_cleanup_failed"},
            )

    def close(self) -> None:
        was_closed = self.closed
        transport = self.connection
        if not was_closed:
            self._release_fetch()
        if not was_closed and self.owned_by_this_process:
            try:
                self.flush_acks()
            except Exception as exc:
                # Not lost: unwritten acks only make their messages run again.
                logger.warning(
                    "could not write pending acks at close (%s); those messages will be "
                    "redelivered",
                    exc,
                    extra={"action": "ack_flush_failed"},
                )
        super().close()  # cancels consumers, requeues unacked messages, detaches the transport
        if transport is None:
            return
        if not was_closed and self._registered and self.owned_by_this_process:
            try:
                transport.store.unregister_consumer(self.consumer_id)
            except Exception as exc:
                logger.warning(
                    "could not unregister consumer %s (%s); its lease expires by itself",
                    self.consumer_id,
                    exc,
                    extra={"action": "unregister_failed"},
                )
            self._registered = False
        transport._forget_consumer(self)

    # -- consuming ---------------------------------------------------------------------------

    def _ensure_registered(self, queues: list[str]) -> None:
        if self._registered:
            return
        self.store.register_consumer(
            self.consumer_id,
            hostname=socket.gethostname(),
            queues=queues,
            lease=self.options.lease_seconds,
        )
        self._registered = True
        self.connection._track_consumer(self)

    def _fetch_batch(self, *, eager: bool = True) -> list[FetchedRow]:
        """Fetch up to the free prefetch credit from the active queues.

        The acks queued since the last statement ride along with the fetch (one round trip).
        Unless ``eager``, a small refill is put off while the consumer still holds at least
        half its window: the event loop comes back after ``REFILL_DELAY`` (or when more credit
        is freed) and fetches a larger batch, instead of one statement per finished task.
        Sets ``self._refill_deferred`` when it put the fetch off, and ``self._more_due`` when
        the fetch filled its whole limit (so more messages may be due right now).
        """
        self._refill_deferred = False
        self._more_due = False
        if not self._consumers or not self._active_queues:
            self.flush_acks()
            return []
        fetcher = self._own_fetcher()
        looped = fetcher is not None and self.connection._loop is not None
        if fetcher is not None and fetcher.in_flight:
            if looped:
                return []  # acks wait for the next fetch; the reply brings this one's rows
            return self._wait_fetch(fetcher)  # its blocking wait was interrupted (a signal)
        credit = self.qos.can_consume_max_estimate()
        limit = self.options.fetch_limit
        if credit is not None:
            limit = min(credit, limit)
            window = min(self.qos.prefetch_count, self.options.fetch_limit)
            in_flight = self.qos.prefetch_count - credit
            if not eager and 0 < limit < max(1, window // 2) and in_flight > 0:
                self._refill_deferred = True
                return []
        if limit <= 0:
            self._starved = True
            self.flush_acks()
            return []
        queues = list(dict.fromkeys(self._active_queues))
        self._ensure_registered(queues)
        ack_queues = [q for q in queues if q not in self._no_ack_queues]
        noack_queues = [q for q in queues if q in self._no_ack_queues]
        out: list[FetchedRow] = []
        transport = self.connection
        # A channel that also consumes with acks fetches both every time, as before: its own
        # fetch of those (without a fetcher of its own) does not say whether a no-ack queue
        # has a message waiting.
        if noack_queues and (self._noack_due or ack_queues or not transport._skips_noack()):
            # Never with a fetcher of its own (see _own_fetcher).
            out += self.consumer_store.fetch(
                noack_queues,
                limit,
                self.consumer_id,
                no_ack=True,
                max_bytes=self.options.fetch_max_bytes,
            )
            self._noack_due = fetch_filled(out, limit)  # more may be due
        if ack_queues and len(out) < limit:
            pairs = self._take_acks()
            if fetcher is not None:
                with self._acks_kept_if_unwritten(pairs):
                    fetcher.send(
                        pairs, ack_queues, limit, self.consumer_id, transport._urgent_queues()
                    )
                self._fetch_acks = len(pairs)
                # Sent for a notification (one arrived since the previous fetch was sent):
                # what it finds adapts the cooldown.
                self._notified_fetch = self._sent_wake_seq != transport._wake_seq
                self._sent_wake_seq = transport._wake_seq
                transport._last_fetch = time.monotonic()
                if not looped:  # kombu's blocking drain_events
                    rows = self._wait_fetch(fetcher)
                    if self._notified_fetch:
                        transport._cooldown.observe(len(rows))
                    return rows
                transport._watch_fetch(self, fetcher)
                return []  # the rows arrive with the reply (Transport._on_fetch_readable)
            with self._acks_kept_if_unwritten(pairs):
                done, rows = self.consumer_store.ack_fetch(
                    pairs,
                    ack_queues,
                    limit - len(out),
                    self.consumer_id,
                    max_bytes=self.options.fetch_max_bytes,
                )
            self._acks_written(len(pairs), done)
            out += rows
        else:
            self.flush_acks()
        # It filled its limit, or the byte budget stopped it with credit to spare: due
        # messages may be left behind, to be fetched at once, not at a notification or poll.
        self._more_due = self._starved = fetch_filled(out, limit)
        return out

    def _wait_fetch(self, fetcher: AsyncFetcher) -> list[FetchedRow]:
        """Wait here for the fetch in flight (outside an event loop, or at close) and take its
        rows."""
        result = fetcher.wait()
        return [] if result is None else self._fetched_async(result)

    def _own_fetcher(self) -> AsyncFetcher | None:
        """The channel's fetcher: ``ack_fetch`` on a connection of its own, prepared once with
        a generic plan. From an event loop it is sent without waiting; from kombu's blocking
        ``drain_events`` it is waited for. None (``consumer_store`` fetches) with
        ``async_fetch=False`` and for a channel with no-ack consumers (remote control)."""
        transport = self.connection
        if (
            transport is None
            or not self.options.async_fetch
            or self._no_ack_queues
            or not self.owned_by_this_process
            or self.closed
        ):
            return None
        if self._fetcher is None:
            self._fetcher = AsyncFetcher(
                transport.url,
                schema=self.options.schema,
                asynchronous_commit=not self.options.synchronous_acks,
                prepared=self.options.prepared_statements,
                keep_completed=self.options.keep_completed,
                max_bytes=self.options.fetch_max_bytes,
                **self.options.connect_kwargs,
            )
        return self._fetcher

    def _fetched_async(self, result: tuple[int, list[FetchedRow], int]) -> list[FetchedRow]:
        acked, rows, limit = result
        sent, self._fetch_acks = self._fetch_acks, 0
        self._acks_written(sent, acked)
        self._more_due = self._starved = fetch_filled(rows, limit)
        return rows

    def _release_fetch(self) -> None:
        """Closing with a fetch in flight: wait for it and put its rows back (never delivered)."""
        fetcher, self._fetcher = self._fetcher, None
        if fetcher is None:
            return
        try:
            rows = self._wait_fetch(fetcher) if self.owned_by_this_process else []
            if rows:
                self._settle("requeue", [make_tag(r.id, r.delivery) for r in rows])
        except Exception as exc:
            # Not lost: unregistering this consumer (or the sweeper) returns them.
            logger.warning(
                "could not return fetched messages at close (%s); they return to pending "
                "with this consumer's lease",
                exc,
                extra={"action": "fetch_release_failed"},
            )
        finally:
            transport = self.connection
            if transport is not None:
                transport._unwatch_fetch(fetcher)
            fetcher.close()

    def _batching_acks(self) -> bool:
        """Acks wait for the next fetch (or flush) while this channel consumes in this process.

        They are written by the next fetch: the event loop's, or a ``drain_events`` call's
        (sent within ``ACK_FLUSH_DELAY`` of the call's start); else by the channel's close, or
        at the latest the heartbeat thread's next beat. An ack lost in a crash before it is
        written only causes a redelivery.
        """
        return self.owned_by_this_process and not self.closed and bool(self._consumers)

    def _queue_ack(self, delivery_tag: Any) -> bool:
        """Queue an ack for the next statement; True if it is the first one waiting."""
        pair = parse_tag(delivery_tag)
        with self._ack_lock:
            self._pending_acks.append(pair)
            return len(self._pending_acks) == 1

    def _take_acks(self) -> list[tuple[int, int]]:
        with self._ack_lock:
            pairs, self._pending_acks = self._pending_acks, []
        return pairs

    def flush_acks(self, store: Store | None = None) -> int:
        """Write the acks queued since the last flush, in one statement; returns how many.

        ``store`` lets the heartbeat thread write them on its own connection. If the statement
        fails (that connection was lost), the acks are queued again for the next flush: the
        consumer may well be alive on its own connections, and an ack dropped here would
        leave its message ``running`` under a lease that keeps being renewed.
        """
        pairs = self._take_acks()
        if not pairs:
            return 0
        with self._acks_kept_if_unwritten(pairs):
            done = (store or self.connection.consumer_store).ack(pairs, self.consumer_id)
        self._acks_written(len(pairs), done)
        return len(pairs)

    @contextmanager
    def _acks_kept_if_unwritten(self, pairs: list[tuple[int, int]]) -> Iterator[None]:
        """Around the statement that writes ``pairs`` (taken by :meth:`_take_acks`): if it
        fails, they are put back, ahead of any queued since, for the next statement. Had it
        committed after all (the reply lost), writing them again changes nothing; the warning
        about acks that changed nothing is then logged for them."""
        try:
            yield
        except BaseException:
            with self._ack_lock:
                self._pending_acks[:0] = pairs
            raise

    def _acks_written(self, sent: int, done: int) -> None:
        if done < sent:
            logger.warning(
                "ack of %d messages changed nothing: this consumer's lease was taken away and "
                "the messages were handed to another consumer",
                sent - done,
                extra={"action": "ack_fenced", "consumer": str(self.consumer_id)},
            )

    def _fail_undecodable(self, row: FetchedRow, reason: str) -> None:
        """Move a message no consumer could decode to ``failed`` with ``reason`` (fenced)."""
        if row.queue not in self._no_ack_queues:
            self.consumer_store.fail([row.tag], self.consumer_id, reason)
        logger.error(
            "message %s of queue %r moved to failed: %s",
            row.id,
            row.queue,
            reason,
            extra={"action": "undecodable", "message_id": row.id},
        )

    def _credit_freed(self) -> None:
        transport = self.connection
        if transport is not None:
            transport._wakeup_consumers()

    def _ack_queued(self, first: bool) -> None:
        """An ack waits to be written (it freed prefetch credit; on any thread).

        Outside an event loop, or when the last fetch left messages behind for lack of
        credit, the consumer fetches at once (with the ack). Otherwise nothing is known to be
        waiting: the first queued ack only asks the loop to write it within
        ``ACK_FLUSH_DELAY``, and a notification's fetch usually carries it before that, so
        a stream of short tasks costs one statement per notification, not two.
        """
        transport = self.connection
        if transport is None:
            return
        if transport._loop is None or self._starved:
            transport._wakeup_consumers()
        elif first:
            transport._wakeup_consumers(fetch=False)

    def _settle(self, how: str, tags: list[Any]) -> None:
        pairs = [parse_tag(t) for t in tags]
        store = self.consumer_store
        if how == "ack":
            done = store.ack(pairs, self.consumer_id)
        elif how == "requeue":
            done, failed = store.requeue(
                pairs, self.consumer_id, max_attempts=self.options.max_attempts
            )
            if failed:
                logger.warning(
                    "%d messages moved to failed after %d deliveries",
                    failed,
                    self.options.max_attempts,
                    extra={"action": "max_attempts"},
                )
        else:
            done = store.fail(pairs, self.consumer_id, "rejected by consumer (requeue=False)")
        if done < len(pairs):
            logger.warning(
                "%s of %d messages changed nothing: this consumer's lease was taken away and "
                "the messages were handed to another consumer",
                how,
                len(pairs) - done,
                extra={"action": f"{how}_fenced", "consumer": str(self.consumer_id)},
            )


PgChannel = Channel  # the name ``Channel`` is shadowed inside Transport's body


class PublishBatch:
    """kombu 5.7's transport-owned publish batch (``with producer.batch(max_size): ...``).

    Messages are routed as they are published and written by one statement per ``max_size``
    messages (an automatic flush) and at the end of the block; a block that raises discards
    what was not flushed yet, as kombu specifies. For all-or-nothing over any number of
    messages, use :func:`kombu_pgskip.batch` instead.
    """

    def __init__(self, channel: Channel, max_size: int) -> None:
        self.channel = channel
        self.max_size = max_size
        self._items: list[_Collected] = []

    def publish(self, message: dict[str, Any], **kwargs: Any) -> None:
        channel = self.channel
        if channel._collected is not None:  # inside kombu_pgskip.batch(): that block writes
            channel.basic_publish(message, **kwargs)
            return
        channel._collected = self._items
        try:
            channel.basic_publish(message, **kwargs)
        finally:
            channel._collected = None
        if len(self._items) >= self.max_size:
            self.flush()

    def flush(self) -> None:
        items, self._items = self._items, []
        if items:
            self.channel._write_collected(items)

    def discard(self) -> None:
        self._items = []

    def close(self) -> None:
        self._items = []


def _close_quietly(conn: psycopg.Connection[Any]) -> None:
    """Close ``conn``, ignoring errors (it is already broken)."""
    try:
        conn.close()
    except Exception:
        logger.debug("error closing a broken connection", exc_info=True)


class _Heartbeat(threading.Thread):
    """Renews this process's consumer leases and sweeps dead consumers' rows.

    It has its own connection, so leases stay alive while the consumer thread is busy (a task
    running in the solo pool, a slow callback).
    """

    def __init__(self, transport: Transport) -> None:
        super().__init__(name="pgskip-heartbeat", daemon=True)
        self.transport = transport
        self.stop_event = threading.Event()
        self.store = Store(
            transport.url,
            schema=transport.options.schema,
            check=False,
            keep_completed=transport.options.keep_completed,  # it writes acks (flush_acks)
            **transport.options.connect_kwargs,
        )
        self.horizon = HorizonMonitor(self.store, transport.options.xmin_horizon_warning)

    def run(self) -> None:
        opts = self.transport.options
        interval = opts.lease_seconds / 3.0
        next_sweep = time.monotonic() + opts.sweep_interval * (0.5 + (os.getpid() % 100) / 200)
        while not self.stop_event.wait(interval):
            try:
                self.beat()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + opts.sweep_interval
                    self.sweep()
                self.horizon.maybe_check()  # throttled; logs its own failures
            except Exception as exc:
                logger.warning(
                    "lease renewal failed: %s", exc, extra={"action": "heartbeat_failed"}
                )
                self.store.close()
        self.store.close()

    def beat(self) -> None:
        opts = self.transport.options
        channels = self.transport._consumer_channels()
        if not channels:
            return
        for channel in channels:
            # Acks of a consumer that has stopped calling drain_events would otherwise wait.
            channel.flush_acks(self.store)
        ids = [c.consumer_id for c in channels]
        alive = self.store.renew_consumers(ids, opts.lease_seconds)
        for channel in channels:
            if channel.consumer_id not in alive:
                logger.warning(
                    "consumer %s was declared dead (lease expired); messages it held were "
                    "returned to the queue and their acks will be ignored",
                    channel.consumer_id,
                    extra={"action": "lease_lost"},
                )
                channel._registered = False

    def sweep(self) -> None:
        requeued, failed, forgotten = self.store.sweep(
            max_attempts=self.transport.options.max_attempts
        )
        expired = self.store.drop_expired()
        if expired:
            logger.info(
                "dropped %d messages whose TTL ran out", expired, extra={"action": "expire"}
            )
        queues, dropped = self.store.expire_queues()
        if queues:
            logger.info(
                "deleted %d queues unused for longer than their x-expires (%d messages)",
                queues,
                dropped,
                extra={"action": "expire_queues"},
            )
        if requeued or failed or forgotten:
            logger.info(
                "sweeper: %d messages of dead consumers requeued, %d failed, %d consumers "
                "forgotten",
                requeued,
                failed,
                forgotten,
                extra={"action": "sweep"},
            )


class Transport(virtual.Transport):
    """The ``pgskip://`` transport."""

    Channel = Channel

    can_parse_url = True
    default_port = 5432
    driver_type = "pgskip"
    driver_name = "psycopg"
    polling_interval = 1.0

    implements = virtual.Transport.implements.extend(
        # Celery's worker then runs its event loop (as with Redis and RabbitMQ): the consumer
        # thread never blocks on a busy prefork pool, so remote control, heartbeats and events
        # keep flowing while every pool process is busy.
        asynchronous=True,
        # Producer.batch(): many publishes, one INSERT (Channel.create_publish_batch).
        batch_publish=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = (
        *virtual.Transport.connection_errors,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    channel_errors = virtual.Transport.channel_errors

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = Options.from_transport_options(dict(client.transport_options or {}))
        super().__init__(client, **kwargs)
        self.polling_interval = self.options.polling_interval
        self.url = self._client_url(client)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._consumers: list[PgChannel] = []
        self._listener: psycopg.Connection[Any] | None = None
        self._heartbeat: _Heartbeat | None = None
        self._next_promote = 0.0
        # Self-pipe: acks on pool threads free prefetch credit and wake the consumer thread,
        # which would otherwise sleep until the next notification or poll.
        # Created when this transport first waits (consumers only).
        self._wake_pair: tuple[socket.socket, socket.socket] | None = None
        self._waiting = False
        # The kombu event loop (Celery's worker hub) this transport is registered with, the
        # file descriptors it watches for us, and a drain already queued on it.
        self._loop: Any = None
        self._loop_fds: list[int] = []
        self._fetch_fds: dict[int, AsyncFetcher] = {}
        self._poll_timer: Any = None
        self._drain_queued = False
        # A small refill put off until more prefetch credit is free (see _async_drain).
        self._refill_deferred = False
        self._refill_queued = False
        self._more_due = False
        # Outside an event loop: the last drain_events delivered a batch that drained the
        # queues, so the next one waits for a notification before fetching.
        self._drained = False
        self._poll_at = 0.0  # outside an event loop: when to fetch for want of a notification
        # Outside an event loop: whether, lately, a notification came within ACK_FLUSH_DELAY
        # of a drain_events call that had acks to write (then they wait to ride along), and
        # when this call first read one.
        self._ack_wait_pays = True
        self._notified_at: float | None = None
        # A wake-up that asks for a fetch (not only for acks to be written), and an ack
        # flush already scheduled on the loop (see Channel._ack_queued).
        self._fetch_wanted = False
        self._ack_flush_queued = False
        # Counts notifications for consumed queues: one that arrives while a fetch is in
        # flight (its snapshot may predate the message) calls for another fetch after it.
        self._wake_seq = 0
        # When the loop last sent a fetch, and a notified fetch already put off until the
        # fetch_cooldown since then has passed.
        self._last_fetch = 0.0
        self._cooldown_queued = False
        self._cooldown = Cooldown(self.options.fetch_cooldown, self.options.fetch_cooldown_max)

    def __repr__(self) -> str:
        return f"<pgskip Transport {mask_url(self.url)}>"

    @staticmethod
    def _client_url(client: Any) -> str:
        hostname = client.hostname or "localhost"
        if "://" in hostname:
            url = hostname
        else:
            url = build_url(
                hostname=hostname,
                port=client.port,
                userid=client.userid,
                password=client.password,
                virtual_host=client.virtual_host,
            )
        to_conninfo(url)  # raises InvalidURL with a message that says what is expected
        return url

    @cached_property
    def store(self) -> Store:
        """Publishing, declarations, operators' queries: every commit is durable (unless
        ``durable_publish`` is False: then commits return before the WAL flush)."""
        return Store(
            self.url,
            schema=self.options.schema,
            check=self.options.check_schema,
            asynchronous_commit=not self.options.durable_publish,
            notify_after_commit=self.options.notify_after_commit,
            **self.options.connect_kwargs,
        )

    @cached_property
    def consumer_store(self) -> Store:
        """Fetches, acks, requeues and leases, on a connection of their own.

        Unless ``synchronous_acks`` is set, these commit asynchronously: losing one in a
        PostgreSQL crash can only make a message run again (its row is still ``pending`` or
        ``running`` and the sweeper returns it), never lose it; publishes stay durable.
        """
        return Store(
            self.url,
            schema=self.options.schema,
            check=self.options.check_schema,
            asynchronous_commit=not self.options.synchronous_acks,
            keep_completed=self.options.keep_completed,
            **self.options.connect_kwargs,
        )

    def driver_version(self) -> str:
        return psycopg.__version__

    # -- connection lifecycle -------------------------------------------------------------------

    def establish_connection(self) -> Transport:
        result: Transport = super().establish_connection()
        return result

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            self._stop_background()
            self.store.close()
            if "consumer_store" in self.__dict__:
                self.consumer_store.close()

    def _stop_background(self) -> None:
        hb, self._heartbeat = self._heartbeat, None
        if hb is not None and self._pid == os.getpid():
            hb.stop_event.set()
        self._waiting = False
        self._drained = False  # a new connection fetches at once
        self._leave_event_loop()
        pair, self._wake_pair = self._wake_pair, None
        if pair is not None and self._pid == os.getpid():
            for sock in pair:
                sock.close()
        listener, self._listener = self._listener, None
        if listener is not None and self._pid == os.getpid():
            try:
                listener.close()
            except Exception:
                logger.debug("error closing listener", exc_info=True)

    def _track_consumer(self, channel: PgChannel) -> None:
        with self._lock:
            if channel not in self._consumers:
                self._consumers.append(channel)
            if self._heartbeat is None or not self._heartbeat.is_alive():
                self._heartbeat = _Heartbeat(self)
                self._heartbeat.start()

    def _forget_consumer(self, channel: PgChannel) -> None:
        with self._lock:
            if channel in self._consumers:
                self._consumers.remove(channel)

    def _consumer_channels(self) -> list[PgChannel]:
        with self._lock:
            return [c for c in self._consumers if c._registered and not c.closed]

    def _wakeup_consumers(self, *, fetch: bool = True) -> None:
        """Wake the consumer (any thread); ``fetch=False`` from the event loop's point of
        view only asks for queued acks to be written soon."""
        if self._waiting or self._loop is not None:
            if fetch:
                self._fetch_wanted = True
            try:
                if self._wake_pair is not None:
                    self._wake_pair[1].send(b"!")
            except OSError:
                pass  # full (the consumer thread wakes anyway) or closed

    # -- consuming --------------------------------------------------------------------------------

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Deliver the next batch of messages, waiting up to ``timeout`` seconds for one.

        Waits on LISTEN (or sleeps, in poll-only mode) between polls; wakes early for a
        notification on a consumed queue and when a scheduled message falls due.

        Once a fetch has taken less than it asked for (the queues are drained), the next one
        is sent for a notification (once ``fetch_cooldown`` has passed), a scheduled message
        falling due, a wake-up from another thread, or the poll, as in the event loop: not at
        the start of every call. The acks of the batch just delivered ride along with that
        fetch, or with one sent ``ACK_FLUSH_DELAY`` after the call began; when notifications
        have lately come further apart than that, they go at once, with a fetch.
        """
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._listener = None
            self._heartbeat = None
            self._drained = False
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        fetch_at: float | None = start  # when to fetch; None: at a wake-up or the poll
        learning = False  # whether this call tells if holding its acks back pays
        if self._drained:
            fetch_at = None
            if self._pending():
                self._drained = False  # owed to the notification even if this call times out
                fetch_at = start + max(0.0, self._cooldown_left())
            elif self._acks_waiting():
                learning = True
                if not self._ack_wait_pays:
                    # Lately no notification came within ACK_FLUSH_DELAY of a call: messages
                    # come further apart than that, so the acks go at once, with a fetch.
                    fetch_at = start
        ack_due = start + ACK_FLUSH_DELAY
        self._notified_at = None
        while True:
            now = time.monotonic()
            if now >= self._next_promote and self._promote(now):
                fetch_at = now
            if now >= self._poll_at:
                fetch_at = now
            if fetch_at is not None and now >= fetch_at:
                delivered = self._deliver_batch()
                self._drained = (
                    self.options.listen
                    and not self._more_due
                    and not any(c._starved for c in self.channels if not c.closed)
                )
                now = time.monotonic()
                self._poll_at = now + self.options.polling_interval
                if delivered:
                    return
                fetch_at = None
            wait = min(self._poll_at, self._next_promote) - now
            if fetch_at is not None:
                wait = min(wait, fetch_at - now)
            acks_waiting = self._acks_waiting()
            if acks_waiting:
                wait = min(wait, ack_due - now)
            if deadline is not None:
                if now >= deadline:
                    raise TimeoutError()
                wait = min(wait, deadline - now)
            woken = self._wait(max(0.0, wait))
            now = time.monotonic()
            if learning and (self._notified_at is not None or now >= ack_due):
                # Did a notification come while the acks could wait for its fetch? (When it
                # came, not when the cooldown let its fetch go.)
                notified_at = self._notified_at
                self._ack_wait_pays = notified_at is not None and notified_at <= ack_due
                learning = False
            if woken or (acks_waiting and now >= ack_due):
                fetch_at = now  # a fetch carries the waiting acks too

    def _pending(self) -> bool:
        """Whether notifications for consumed queues came in since the last wait; read
        without waiting."""
        listener = self._listener
        if listener is None or listener.closed:
            return False
        queues, _scheduled = self._notified(
            listener, self._consumed_queues(), scheduled_channel(self.options.schema)
        )
        return bool(queues)  # a scheduled message's due time only moves _next_promote

    def _acks_waiting(self) -> bool:
        return any(c._pending_acks for c in self.channels if not c.closed)

    def _deliver_batch(self, only: set[str] | None = None, *, eager: bool = True) -> bool:
        """Fetch and deliver one batch per consuming channel (those consuming ``only``).

        Unless ``eager``, a channel may put a small refill off (see ``Channel._fetch_batch``);
        ``self._refill_deferred`` then says so.
        """
        delivered = False
        deferred = False
        more = False
        # Channels with no-ack consumers first: remote control (a revoke, a rate limit) is
        # handled before task messages published after it, as Celery expects.
        for channel in sorted(self.channels, key=lambda c: not c._no_ack_queues):
            if channel.closed:
                continue
            if not channel._consumers or (
                only is not None and only.isdisjoint(channel._active_queues)
            ):
                channel.flush_acks()
                continue
            # A callback that raises leaves its message running under this consumer: the
            # channel's restore on close, or the sweeper, returns it to the queue.
            for row in channel._fetch_batch(eager=eager):
                delivered = True
                self._deliver_row(channel, row)
            deferred = deferred or channel._refill_deferred
            more = more or channel._more_due
        self._refill_deferred = deferred
        self._more_due = more
        return delivered

    def _deliver_row(self, channel: PgChannel, row: FetchedRow) -> None:
        """Hand a fetched row to its consumer, or fail it if its body cannot be decoded."""
        message = to_message(row)
        problem = decode_problem(message)
        if problem is not None:
            channel._fail_undecodable(row, problem)
            return
        self._deliver(message, row.queue)

    def _promote(self, now: float) -> int:
        """Promote due scheduled messages; returns how many."""
        promoted, next_in = self.store.promote_scheduled()
        if promoted:
            logger.debug("promoted %d scheduled messages", promoted, extra={"action": "promote"})
        poll = self.options.polling_interval
        delay = poll * 5 if next_in is None else min(max(next_in, 0.0), poll * 5)
        self._next_promote = now + delay
        return int(promoted)

    def _ensure_listener(self) -> tuple[psycopg.Connection[Any] | None, bool]:
        """The LISTEN connection (None in poll-only mode), and whether it was just opened."""
        if not self.options.listen:
            return None, False
        if self._listener is None or self._listener.closed:
            conn = connect(self.url, **self.options.connect_kwargs)
            schema = self.options.schema
            for chan in (notify_channel(schema), scheduled_channel(schema)):
                conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(chan)))
            self._listener = conn
            return conn, True
        return self._listener, False

    def _ensure_wake_pair(self) -> tuple[socket.socket, socket.socket]:
        if self._wake_pair is None:
            pair = socket.socketpair()
            for sock in pair:
                sock.setblocking(False)
            self._wake_pair = pair
        return self._wake_pair

    def _wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True if woken for a fetch (a notification, once the
        cooldown has passed; the wake pipe), False at the time or when a scheduled message
        announced an earlier due time."""
        listener, opened = self._ensure_listener()
        if opened:
            # A message that arrived between the last fetch and the LISTEN sent no
            # notification we could see: fetch once more before sleeping (a `celery inspect`
            # reply can arrive within milliseconds of the request).
            return True
        wake = self._ensure_wake_pair()[0]
        fds: list[Any] = [wake] if listener is None else [wake, listener.pgconn.socket]
        end = time.monotonic() + seconds
        wanted = self._consumed_queues()
        sched = scheduled_channel(self.options.schema)
        notified = False
        self._waiting = True
        try:
            while True:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return notified
                readable, _, _ = select.select(fds, [], [], remaining)
                if not readable:
                    return notified
                if wake in readable:
                    self._drain_wake_pipe(wake)
                    return True
                if listener is None:
                    continue
                queues, scheduled = self._notified(listener, wanted, sched)
                if scheduled and not queues:
                    return notified  # its due time moved _next_promote: wait anew until then
                if queues:
                    # As in the event loop: a notification's fetch waits until the cooldown
                    # after the previous fetch, and takes what was announced meanwhile too.
                    left = self._cooldown_left()
                    if left <= 0:
                        return True
                    notified = True
                    end = min(end, time.monotonic() + left)
        finally:
            self._waiting = False

    @staticmethod
    def _drain_wake_pipe(wake: socket.socket) -> None:
        try:
            while wake.recv(4096):
                pass
        except OSError:
            pass

    def _notified(
        self, listener: psycopg.Connection[Any], wanted: set[str], sched: str
    ) -> tuple[set[str], bool]:
        """Consume pending notifications: (wanted queues that got messages, scheduled due).

        Notifications for wanted queues count in ``_wake_seq`` (a fetch sent after them is a
        notified one: ``Cooldown``) and set ``_notified_at`` if unset (``drain_events``)."""
        pgconn = listener.pgconn
        pgconn.consume_input()  # raises OperationalError if the server went away
        queues: set[str] = set()
        scheduled = False
        while (note := pgconn.notifies()) is not None:
            channel = note.relname.decode()
            payload = note.extra.decode()
            if channel == sched:
                try:
                    due_in = float(payload) - time.time()
                except ValueError:
                    continue
                self._next_promote = min(self._next_promote, time.monotonic() + due_in)
                scheduled = True
            elif payload in wanted:
                queues.add(payload)
        if queues:
            self._wake_seq += 1
            if self._notified_at is None:
                self._notified_at = time.monotonic()
            for channel in self.channels:
                if channel._no_ack_queues and not channel._no_ack_queues.isdisjoint(queues):
                    channel._noack_due = True
        return queues, scheduled

    # -- Celery's event loop (kombu hub) -------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Deliver from the worker's event loop instead of blocking ``drain_events`` calls.

        The loop watches the LISTEN connection (a notification for a consumed queue triggers a
        fetch) and a self-pipe (prefetch credit freed by an ack, a new consumer), and polls
        every ``polling_interval`` as the fallback; fetches run on the loop's thread.
        """
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._listener = None
            self._heartbeat = None
            self._wake_pair = None
        self._leave_event_loop()
        self._loop = loop
        wake = self._ensure_wake_pair()[0]
        loop.add_reader(wake.fileno(), self._on_wake_readable)
        self._loop_fds = [wake.fileno()]
        listener, _ = self._ensure_listener()
        if listener is not None:
            fd = listener.pgconn.socket
            loop.add_reader(fd, self._on_listener_readable)
            self._loop_fds.append(fd)
        self._poll_timer = loop.call_repeatedly(self.options.polling_interval, self._on_poll_tick)
        self._noack_all_due()  # what came while nobody listened
        self._queue_drain()

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self._leave_event_loop()

    def _leave_event_loop(self) -> None:
        loop, self._loop = self._loop, None
        fds, self._loop_fds = self._loop_fds, []
        self._fetch_fds = {}
        if self._pid == os.getpid():
            for channel in list(self.channels):
                if channel._fetcher is not None and channel._fetcher.in_flight:
                    channel._release_fetch()  # nobody will read its reply from this loop
        timer, self._poll_timer = self._poll_timer, None
        if timer is not None:
            timer.cancel()  # otherwise every reconnect would leave one more poll timer behind
        self._drain_queued = False
        self._refill_queued = False
        self._ack_flush_queued = False
        self._cooldown_queued = False
        if loop is None or self._pid != os.getpid():
            return
        for fd in fds:
            try:
                loop.remove(fd)
            except Exception:
                logger.debug("could not remove fd %s from the event loop", fd, exc_info=True)

    def _queue_drain(self) -> None:
        if self._loop is not None and not self._drain_queued:
            self._drain_queued = True
            self._loop.call_soon(self._async_drain)

    def _on_wake_readable(self) -> None:
        pair = self._wake_pair
        if pair is not None:
            self._drain_wake_pipe(pair[0])
        if self._fetch_wanted:
            self._fetch_wanted = False
            self._async_drain()
        else:
            self._queue_ack_flush()

    def _queue_ack_flush(self) -> None:
        if self._loop is not None and not self._ack_flush_queued:
            self._ack_flush_queued = True
            self._loop.call_later(ACK_FLUSH_DELAY, self._flush_tick)

    def _flush_tick(self) -> None:
        """Write acks still waiting ``ACK_FLUSH_DELAY`` after the first was queued (with a
        fetch, which also takes whatever arrived)."""
        self._ack_flush_queued = False
        if any(c._pending_acks for c in self.channels if not c.closed):
            self._async_drain()

    def _on_listener_readable(self) -> None:
        listener = self._listener
        if listener is None or self._loop is None:
            return
        try:
            queues, scheduled = self._notified(
                listener, self._consumed_queues(), scheduled_channel(self.options.schema)
            )
        except psycopg.Error:
            # The server went away: stop watching the dead socket; the error reaches Celery,
            # which reconnects (and registers this transport with its loop again).
            self._leave_event_loop()
            self._listener = None
            _close_quietly(listener)
            raise
        if scheduled:
            delay = max(0.0, self._next_promote - time.monotonic())
            self._loop.call_later(delay, self._async_drain)
        if queues and self._cooldown_left() <= 0:
            self._async_drain(queues)

    def _cooldown_left(self) -> float:
        """Seconds until a notified fetch may be sent (``fetch_cooldown`` after the previous
        fetch was sent); while messages stream in, one fetch is set for then, to take those of
        that moment together."""
        wait = self._last_fetch + self._cooldown.value - time.monotonic()
        if wait > 0 and not self._cooldown_queued and self._loop is not None:
            self._cooldown_queued = True
            self._loop.call_later(wait, self._cooled_down)
        return wait

    def _cooled_down(self) -> None:
        self._cooldown_queued = False
        self._async_drain()

    def _watch_fetch(self, channel: PgChannel, fetcher: AsyncFetcher) -> None:
        fd = fetcher.fileno()
        if self._loop is None or self._fetch_fds.get(fd) is fetcher:
            return
        self._loop.add_reader(fd, self._on_fetch_readable, channel)
        self._fetch_fds[fd] = fetcher
        self._loop_fds.append(fd)

    def _unwatch_fetch(self, fetcher: AsyncFetcher) -> None:
        for fd, known in list(self._fetch_fds.items()):
            if known is fetcher:
                del self._fetch_fds[fd]
                if fd in self._loop_fds:
                    self._loop_fds.remove(fd)
                if self._loop is not None and self._pid == os.getpid():
                    try:
                        self._loop.remove(fd)
                    except Exception:
                        logger.debug("could not remove fd %s from the event loop", fd)

    def _on_fetch_readable(self, channel: PgChannel) -> None:
        fetcher = channel._fetcher
        if fetcher is None or self._loop is None:
            return
        try:
            result = fetcher.poll()
        except psycopg.Error:
            # The connection went away: as with the LISTEN socket, stop watching and let the
            # error reach Celery, which reconnects. The rows of a lost fetch, if it ran, are
            # returned with this consumer's lease.
            self._unwatch_fetch(fetcher)
            channel._fetcher = None
            self._leave_event_loop()
            raise
        if result is None:
            return
        rows = channel._fetched_async(result)
        if channel._notified_fetch:
            self._cooldown.observe(len(rows))
        if channel.closed:  # closed meanwhile: never delivered
            if rows:
                channel._settle("requeue", [make_tag(r.id, r.delivery) for r in rows])
            return
        if fetcher.urgent:
            # Remote control committed before some of these rows: handled first, as when
            # every fetch began with it (a revoke, then at once the task it names).
            self._deliver_urgent()
        for row in rows:
            self._deliver_row(channel, row)
        if channel._more_due:
            self._queue_drain()  # the fetch filled its limit: more may be due now
        elif channel._sent_wake_seq != self._wake_seq:
            # A notification arrived after the statement was sent (its message may have
            # committed after the fetch's snapshot): fetch again once cooled down.
            if self._cooldown_left() <= 0:
                self._queue_drain()
        elif channel._pending_acks:
            # Acks that came in during the fetch (their flush may have fired while it ran).
            self._queue_ack_flush()

    def _on_poll_tick(self) -> None:
        if self._loop is not None:
            self._noack_all_due()  # the fallback poll covers every queue
            self._async_drain()

    def _async_drain(
        self, only: set[str] | None = None, max_batches: int = 10, *, eager: bool = False
    ) -> None:
        """Promote due messages and deliver, up to ``max_batches`` batches per loop turn.

        Acks queued since the last turn are written with the first fetch (or on their own).
        A small refill put off by a channel is retried, eagerly, ``REFILL_DELAY`` later.
        """
        self._drain_queued = False
        if self._loop is None:
            return
        now = time.monotonic()
        if now >= self._next_promote:
            if self._promote(now):
                self._noack_all_due()
            only = None
            due_in = self._next_promote - time.monotonic()
            if due_in < self.options.polling_interval:
                # Due before the next poll: come back on time.
                self._loop.call_later(max(0.0, due_in), self._async_drain)
        for _ in range(max_batches):
            delivered = self._deliver_batch(only, eager=eager)
            if self._refill_deferred and not self._refill_queued:
                self._refill_queued = True
                self._loop.call_later(REFILL_DELAY, self._refill)
            if not delivered or not self._more_due:
                # Nothing, or less than asked for: the queues are drained for now, and what
                # was delivered reaches the pool before any further round trip.
                return
            only = None
        self._queue_drain()  # more to fetch: go on after the loop has served others

    def _refill(self) -> None:
        self._refill_queued = False
        self._async_drain(eager=True)

    def _skips_noack(self) -> bool:
        """Whether a fetch may leave the no-ack queues (remote control, events) out unless
        they are due (``Channel._noack_due``: a notification for one, the poll, a promotion,
        a new consumer, or a task fetch that saw a message waiting in one). Only in the event
        loop, notified, with task fetches that tell (``AsyncFetcher.urgent``): fetching them
        every time costs the loop a round trip per fetch (about a quarter of a worker's rate
        with Celery's default remote control, docs/performance.md)."""
        return self._loop is not None and self.options.listen and self.options.async_fetch

    def _urgent_queues(self) -> list[str]:
        """The no-ack queues a task fetch looks into when :meth:`_skips_noack`."""
        if not self._skips_noack():
            return []
        queues: set[str] = set()
        for channel in self.channels:
            if not channel.closed:
                queues.update(channel._no_ack_queues)
        return list(queues)

    def _noack_all_due(self) -> None:
        for channel in self.channels:
            if channel._no_ack_queues:
                channel._noack_due = True

    def _deliver_urgent(self) -> None:
        """Fetch and deliver the no-ack queues now (a task fetch saw a message in one). Should
        a control command raise (``celery control shutdown``), the task fetch's rows are not
        delivered: they stay running under the consumer, whose close returns them."""
        for channel in list(self.channels):
            if channel.closed or not channel._no_ack_queues or not channel._consumers:
                continue
            channel._noack_due = True
            for row in channel._fetch_batch(eager=True):
                self._deliver_row(channel, row)

    def _consumed_queues(self) -> set[str]:
        queues: set[str] = set()
        for channel in self.channels:
            if not channel.closed:
                queues.update(channel._active_queues)
        return queues

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": "localhost"}


__all__ = ["Channel", "Options", "QoS", "Transport", "mask_url"]
