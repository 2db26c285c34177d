"""The kombu channel: kombu's calls, translated into the store's operations.

Publishing (``basic_publish``, ``_put``, buffered batches), declarations and bindings (stored
in the database so that every process routes through every other's bindings), consuming
(``basic_consume``, ``basic_get``) and settling (acks, rejects, restores). Fetching and
delivering belong to the transport's :class:`~kombu_pgskip.dispatch.Dispatcher`; the acks
waiting to be written, to the channel's :class:`~kombu_pgskip.acks.AckBatcher`.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from queue import Empty
from typing import TYPE_CHECKING, Any

from amqp.protocol import queue_declare_ok_t
from celery import current_task
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from . import exceptions
from .acks import AckBatcher
from .envelope import (
    parse_tag,
    to_message,
    to_routed_row,
    to_row,
    validate_queue_name,
)
from .fetcher import AsyncFetcher
from .policy import ChannelState
from .store import FetchedRow, NewMessage, Store, refuse_unique_keys

if TYPE_CHECKING:
    from .options import Options
    from .transport import Transport

logger = logging.getLogger(__name__)


@dataclass
class Collected:
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
        channel = self.channel
        if channel.batching_acks():
            # Written with the next fetch, together with every other ack that arrived
            # meanwhile: one statement instead of one per message (kombu_pgskip.acks).
            first = channel.acks.add(delivery_tag)
            self._quick_ack(delivery_tag)
            transport = channel.connection
            if transport is not None:
                if channel.limited_rows:
                    transport.dispatcher.settled(channel, delivery_tag)
                transport.dispatcher.ack_queued(channel, first=first)
            return
        channel.settle("ack", [delivery_tag])
        self._quick_ack(delivery_tag)
        channel.credit_freed(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if self.channel.connection is None:
            self._settle_after_close("requeue" if requeue else "reject", delivery_tag)
            return
        self.channel.settle("requeue" if requeue else "fail", [delivery_tag])
        self._quick_ack(delivery_tag)
        self.channel.credit_freed(delivery_tag)

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
                self.channel.settle("requeue", tags)
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
        self.acks = AckBatcher(self.consumer_id)
        self.fetch_state = ChannelState()
        #: The messages of limited queues delivered and not yet settled: row id -> queue.
        self.limited_rows: dict[int, str] = {}
        # The fetch connection (kombu_pgskip.dispatch), opened at the first fetch.
        self.fetcher: AsyncFetcher | None = None
        self._collected: list[Collected] | None = None
        self._registered = False
        self.no_ack_queues: set[str] = set()
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
            refuse_unique_keys((row,))
            self._collected.append(Collected(row))
            return
        if self.store.publish(row) is not None:
            return
        # Celery's retry (or a task publishing itself again) while its message, which holds
        # the key, still runs: the new message takes the key over.
        retried = row.task_id is not None and row.task_id == _current_task_id()
        if retried and self.store.take_over_unique_key(row) is not None:
            return
        raise exceptions.DuplicateTask(
            f"not published: another message of queue {queue!r} holds unique key "
            f"{row.unique_key!r} (pending, scheduled or running); the task it stands for is "
            "already on its way",
            queue=queue,
            key=str(row.unique_key),
        )

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

    def _write_collected(self, collected: list[Collected]) -> list[int]:
        rows = list(self._rows_of(collected))
        return self.store.publish_many(rows) if rows else []

    def write_streamed(self, collected: Iterable[Collected]) -> list[int]:
        """Write publishes that are still being made (``collected`` builds them lazily) in one
        transaction: :meth:`~kombu_pgskip.store.Store.publish_stream`."""
        return self.store.publish_stream(self._rows_of(collected))

    def _rows_of(self, collected: Iterable[Collected]) -> Iterator[NewMessage]:
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
        self.ensure_registered([queue])
        rows = self._take_one(queue)
        if not rows:
            raise Empty()
        return to_message(rows[0])

    def _take_one(self, queue: str, *, no_ack: bool = False) -> list[FetchedRow]:
        """One message of ``queue`` (``basic_get``): the normal fetch, or, for a queue this
        process knows to be limited (``pgskip limit``), the limited fetch, which keeps to its
        limits and leaves the message counted as running until it is settled."""
        store = self.consumer_store
        transport = self.connection
        if no_ack or transport is None or queue not in transport.dispatcher.limits.queues:
            return store.fetch([queue], 1, self.consumer_id, no_ack=no_ack)
        rows = store.fetch_limited(queue, 1, self.consumer_id).rows
        for row in rows:
            self.limited_rows[row.id] = queue
        return rows

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
        if row.unique_key is not None:
            raise exceptions.ConfigurationError(
                f"a unique key ({row.unique_key!r}) on a message to exchange {exchange!r}: a "
                "unique key holds within one queue, so publish the task to its queue (Celery "
                "does for a direct exchange, its default); nothing was written"
            )
        local = self._local_targets(exchange, routing_key or "")
        if self._collected is not None:
            self._collected.append(Collected(row, exchange, routing_key or "", tuple(local)))
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
        self.ensure_registered([queue])
        rows = self._take_one(queue, no_ack=no_ack)
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
            self.no_ack_queues.add(queue)
            self.fetch_state.noack_due = True
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self._registered = False  # re-register with the new queue list
        self.connection.dispatcher.consumers_changed()  # a new queue: fetch from it at once
        return result

    def basic_qos(
        self, prefetch_size: int = 0, prefetch_count: int = 0, apply_global: bool = False
    ) -> None:
        super().basic_qos(prefetch_size, prefetch_count, apply_global)
        if self.connection is not None:
            self.connection.dispatcher.consumers_changed()  # a larger window: fetch more now

    def basic_cancel(self, consumer_tag: str) -> Any:
        if self.owned_by_this_process and not self.closed:
            self.flush_acks()  # later acks are written one by one once nothing is consumed
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self.no_ack_queues.discard(queue)
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
        if not was_closed and transport is not None:
            transport.dispatcher.release(self)
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
        transport.forget_consumer(self)

    # -- consuming ---------------------------------------------------------------------------

    def ensure_registered(self, queues: list[str]) -> None:
        """Register this channel's consumer (its lease row) with ``queues``, once."""
        if self._registered:
            return
        self.store.register_consumer(
            self.consumer_id,
            hostname=socket.gethostname(),
            queues=queues,
            lease=self.options.lease_seconds,
        )
        self._registered = True
        self.connection.track_consumer(self)

    def own_fetcher(self) -> AsyncFetcher | None:
        """The channel's fetch connection: ``ack_fetch`` prepared once with a generic plan,
        sent without waiting from the event loop, waited for from ``drain_events``. None
        (the transport's consumer connection fetches) with ``async_fetch=False`` and for a
        channel with no-ack consumers (remote control)."""
        transport = self.connection
        if (
            transport is None
            or not self.options.async_fetch
            or self.no_ack_queues
            or not self.owned_by_this_process
            or self.closed
        ):
            return None
        if self.fetcher is None:
            self.fetcher = AsyncFetcher(
                transport.url,
                schema=self.options.schema,
                asynchronous_commit=not self.options.synchronous_acks,
                prepared=self.options.prepared_statements,
                keep_completed=self.options.keep_completed,
                max_bytes=self.options.fetch_max_bytes,
                **self.options.connect_kwargs,
            )
        return self.fetcher

    def lease_lost(self) -> None:
        """The consumer's lease ran out (it was declared dead): register anew at the next
        fetch, with a lease of its own; the acks of what it held change nothing."""
        self._registered = False

    def batching_acks(self) -> bool:
        """Acks wait for the next fetch (or flush) while this channel consumes in this process.

        They are written by the next fetch: the event loop's, or a ``drain_events`` call's
        (sent within ``ACK_FLUSH_DELAY`` of the call's start); else by the channel's close, or
        at the latest the heartbeat thread's next beat. An ack lost in a crash before it is
        written only causes a redelivery.
        """
        return self.owned_by_this_process and not self.closed and bool(self._consumers)

    def flush_acks(self, store: Store | None = None) -> int:
        """Write the acks queued since the last flush, in one statement; returns how many.

        ``store``: on that connection instead of the consumer connection. If the statement
        fails, the acks are queued again for the next flush (see :mod:`~kombu_pgskip.acks`).
        """
        return self.acks.flush(store or self.connection.consumer_store)

    def fail_undecodable(self, row: FetchedRow, reason: str) -> None:
        """Move a message no consumer could decode to ``failed`` with ``reason`` (fenced)."""
        if row.queue not in self.no_ack_queues:
            self.consumer_store.fail([row.tag], self.consumer_id, reason)
        logger.error(
            "message %s of queue %r moved to failed: %s",
            row.id,
            row.queue,
            reason,
            extra={"action": "undecodable", "message_id": row.id},
        )

    def credit_freed(self, delivery_tag: object = None) -> None:
        """A delivered message was settled (``delivery_tag``): its prefetch credit, and its
        slot if its queue is limited, are free."""
        transport = self.connection
        if transport is not None:
            if delivery_tag is not None and self.limited_rows:
                transport.dispatcher.settled(self, delivery_tag)
            transport.dispatcher.wakeup()

    def settle(self, how: str, tags: list[Any]) -> None:
        """Write ``how`` (ack, requeue, fail) for ``tags`` now, fenced by this consumer."""
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
        self._items: list[Collected] = []

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


def _current_task_id() -> str | None:
    """The id of the Celery task this thread is running, if any."""
    task: Any = current_task
    return str(task.request.id) if task else None
