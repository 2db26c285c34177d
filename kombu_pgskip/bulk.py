"""Publish many messages with one statement: kombu batches, Celery ``apply_many``.

.. code-block:: python

    from kombu_pgskip import apply_many, apply_many_in, batch, publish_many

    # Celery: 10,000 tasks, one INSERT and one durable commit (chunked by 5,000, one transaction)
    results = apply_many(add.s(i, i) for i in range(10_000))

    # ... or inside your own transaction, on your own connection (as apply_async_in)
    with psycopg.connect(dsn) as conn, conn.transaction():
        create_orders(conn, orders)
        apply_many_in(conn, [ship.s(o.id) for o in orders])

    # kombu: every publish in the block is buffered and written at its end
    with Connection("pgskip://...") as conn:
        producer = conn.Producer()
        with batch(producer):
            for item in items:
                producer.publish(item, routing_key="work", declare=[queue])
        publish_many(producer, items, routing_key="work")  # the same, for a list of bodies

What is written is exactly what the same ``publish``/``apply_async`` calls would have written one
by one (they *are* those calls; only the INSERT is deferred): same headers, properties, routing,
priorities, ETAs (far ones stored as ``scheduled``), signals. ``publish_many`` makes the full call
for its first body only: the options are the same for every body, so each further body is
serialized as ``publish`` would and spliced into the first message's row, and the rows go down a
pipeline a hundred at a time while the next are built. The difference is atomicity and cost:
all messages become visible together at the commit, or none does (an exception inside the block,
or a failing statement, writes nothing), and the commit (an fsync) is paid once.

Routing through an exchange is resolved when the block ends, once per (exchange, routing key),
from the bindings every process stored plus this process's own.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import current_app
from celery.canvas import Signature, maybe_signature
from celery.result import AsyncResult

from . import exceptions
from .channel import Channel, Collected
from .envelope import Rebodied, describe_destination
from .publish import _check_options, _enqueue_on, _refuse_chords

logger = logging.getLogger(__name__)


def _channel_of(target: Any) -> Channel:
    """The pgskip channel behind a kombu ``Producer``, ``Channel`` or ``Connection``."""
    channel = target
    if hasattr(target, "default_channel") and not isinstance(target, Channel):
        channel = target.default_channel  # a kombu Connection
    elif hasattr(target, "channel") and not isinstance(target, Channel):
        channel = target.channel  # a Producer (resolves its channel promise)
    if not isinstance(channel, Channel):
        raise exceptions.ConfigurationError(
            f"batch() needs a kombu Producer, Channel or Connection of the pgskip transport, "
            f"got {target!r}; use broker_url = 'pgskip://user:password@host:5432/dbname'"
        )
    return channel


@contextmanager
def batch(target: Any) -> Iterator[list[int]]:
    """Buffer every message published through ``target``'s channel; write them at the end.

    ``target`` is a kombu ``Producer``, ``Channel`` or ``Connection`` (its default channel)
    of the pgskip transport (:class:`~kombu_pgskip.exceptions.ConfigurationError`
    otherwise). Yields a list that holds the new rows' ids once the block has ended. An
    exception in the block writes nothing. Without a caller's connection the messages are
    written by one autocommit statement (or, above 5,000 messages or 16 MB, several in one
    transaction), so they become visible together.

    .. code-block:: python

        with batch(producer):
            producer.publish({"order": 1}, routing_key="orders")
            producer.publish({"invoice": 1}, routing_key="invoices")
    """
    channel = _channel_of(target)
    with channel.collecting() as ids:
        yield ids
    logger.debug("batch of %d messages written", len(ids), extra={"action": "publish_many"})


def publish_many(producer: Any, bodies: Iterable[Any], **publish_options: Any) -> list[int]:
    """``producer.publish(body, **publish_options)`` for every body, in one transaction.

    Returns the ids of the rows written (one per body and target queue); inside a
    :func:`batch` block, the block writes them (and its list gets the ids).

    The first body goes through ``producer.publish`` (declarations, routing, headers and
    properties, as always). As the options are the same for every body, the next messages
    differ from it only in their body and delivery tag: each further body is serialized (and
    compressed) as ``publish`` would, and spliced into the first message's row
    (:class:`~kombu_pgskip.envelope.Rebodied`), skipping kombu's per-message work. A body
    that serializes to another content type (a ``str`` or ``bytes`` body among dicts) takes
    the full ``publish``. The rows are written a hundred at a time down a pipeline while the
    next ones are built (:meth:`~kombu_pgskip.store.Store.publish_stream`), all in one
    transaction: an error in any body writes nothing.
    """
    channel = _channel_of(producer)
    publishes = _publishes(producer, channel, bodies, publish_options)
    if channel._collected is not None:  # inside batch(): that block writes
        channel._collected.extend(publishes)
        return []
    # The first publish (its declarations included) is made before the transaction starts.
    first = next(publishes, None)
    if first is None:
        return []
    ids = channel.write_streamed(itertools.chain((first,), publishes))
    logger.debug("%d messages written", len(ids), extra={"action": "publish_many"})
    return ids


def _publishes(
    producer: Any, channel: Channel, bodies: Iterable[Any], options: dict[str, Any]
) -> Iterator[Collected]:
    """The buffered publish of each body, built as it is taken (see :func:`publish_many`)."""
    like: _Like | None = None
    for body in bodies:
        item = None if like is None else like.item(body)
        if item is None:
            item = _published(producer, channel, body, options)
            if like is None:
                like = _Like.of(producer, channel, item, options)
        yield item


def _published(producer: Any, channel: Channel, body: Any, options: dict[str, Any]) -> Collected:
    """``producer.publish(body, **options)``, buffered: what it would write."""
    outer, channel._collected = channel._collected, []
    try:
        producer.publish(body, **options)
        (item,) = channel._collected
    finally:
        channel._collected = outer
    return item


class _Like:
    """Buffered publishes like a first one of the same ``publish_many`` call (see there)."""

    def __init__(
        self, producer: Any, channel: Channel, first: Collected, options: dict[str, Any]
    ) -> None:
        self.rows = Rebodied(
            first.row,
            describe_destination(queue=first.row.queue, exchange=first.exchange),
            max_message_size=channel.options.max_message_size,
        )
        self.first = first
        self.prepare = producer._prepare  # kombu's serialization (and compression) of a body
        self.encode_body = channel.encode_body
        self.next_tag = channel._next_delivery_tag
        self.serializer = options.get("serializer")
        self.content_type = options.get("content_type")
        self.content_encoding = options.get("content_encoding")
        compression = options.get("compression")
        self.compression = producer.compression if compression is None else compression

    @classmethod
    def of(
        cls, producer: Any, channel: Channel, first: Collected, options: dict[str, Any]
    ) -> _Like | None:
        """The template of ``first``, or ``None`` where splicing does not apply (then every
        body takes the full ``publish``)."""
        if not hasattr(producer, "_prepare") or channel.body_encoding is None:
            return None
        try:
            return cls(producer, channel, first, options)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def item(self, body: Any) -> Collected | None:
        """The buffered publish of ``body``, or ``None`` if it is not like the first."""
        data, content_type, content_encoding = self.prepare(
            body,
            self.serializer,
            self.content_type,
            self.content_encoding,
            self.compression,
            {},
        )
        if (content_type, content_encoding) != self.rows.content:
            return None
        encoded, body_encoding = self.encode_body(data, self.rows.body_encoding)
        if not isinstance(encoded, str) or body_encoding != self.rows.body_encoding:
            return None
        first = self.first
        row = self.rows.with_body(encoded, self.next_tag())
        return Collected(row, first.exchange, first.routing_key, first.local)


def _signatures(tasks: Iterable[Any], app: Any) -> list[Signature]:
    sigs: list[Signature] = []
    for task in tasks:
        sig = maybe_signature(task, app=app)
        if not isinstance(sig, Signature):
            raise TypeError(f"apply_many needs Celery signatures (task.s(...)), got {task!r}")
        sigs.append(sig)
    return sigs


def _app_of(sigs: list[Signature], app: Any) -> Any:
    """``app``, else the app of the first signature (a group: of its first task)."""
    if app is not None:
        return app
    return sigs[0].app if sigs else current_app


def apply_many(tasks: Iterable[Any], *, app: Any = None, **options: Any) -> list[AsyncResult]:
    """``sig.apply_async(**options)`` for every signature, written by one durable commit.

    ``tasks`` are signatures (``add.s(2, 2)``, ``add.si(...).set(queue=...)``, groups and
    chains too). ``options`` apply to every one. Returns what each ``apply_async`` returned.
    The messages are published through ``app``'s broker (by default the app of the first
    signature), which must be ``pgskip://``
    (:class:`~kombu_pgskip.exceptions.ConfigurationError` otherwise). They become visible
    together at the commit; nothing is written if any of them raises.

    .. code-block:: python

        results = apply_many(resize.s(image_id) for image_id in image_ids)
    """
    task_list = list(tasks)
    sigs = _signatures(task_list, app)
    app = _app_of(sigs, app)
    for name in ("connection", "producer", "publisher"):
        if options.get(name) is not None:
            raise TypeError(
                f"apply_many publishes through the app's broker; {name}= is not allowed"
            )
    opts = dict(options)
    with app.producer_or_acquire() as producer, batch(producer):
        return [sig.apply_async(producer=producer, **opts) for sig in sigs]


def apply_many_in(conn: object, tasks: Iterable[Any], **options: Any) -> list[AsyncResult]:
    """:func:`apply_many` inside the caller's transaction, on the caller's connection.

    As :func:`~kombu_pgskip.apply_async_in` (same connection types, same errors, never
    commits, rolls back or closes ``conn``): commit, and every job exists; roll back, and none
    does. Returns what each ``apply_async`` returned.

    .. code-block:: python

        with psycopg.connect(dsn) as conn, conn.transaction():
            apply_many_in(conn, [ship.s(order_id) for order_id in order_ids])
    """
    task_list = list(tasks)
    sigs = _signatures(task_list, None)
    if not sigs:
        return []
    app = _app_of(sigs, None)
    opts = _check_options(options, "apply_many_in")
    for sig in sigs:
        _refuse_chords(sig, app)
    with _enqueue_on(conn, app) as (kconn, producer), batch(producer):
        return [
            sig.apply_async(connection=kconn, producer=producer, retry=False, **opts)
            for sig in sigs
        ]


__all__ = ["apply_many", "apply_many_in", "batch", "publish_many"]
