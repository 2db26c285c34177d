"""kombu/Celery message <-> row.

The row's ``payload`` is the kombu virtual-transport message (body encoded as the channel's
``body_encoding``, headers, properties), so what a worker receives is exactly what the publisher
sent. A few fields are lifted into columns: the queue, the priority, when it may be delivered (from
Celery's ``eta`` header), the task name and id (for operators), the TTL, and the message's keys
(:func:`message_keys`).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import uuid
from datetime import datetime, timedelta, timezone
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any

from kombu.compression import decompress
from kombu.utils.json import JSONEncoder, loads

from . import exceptions
from .store import FetchedRow, NewMessage

MAX_QUEUE_NAME_BYTES = 255
#: Upper bound of the max_message_size option: PostgreSQL refuses values over 1 GB, and the
#: server holds several copies of a parameter while inserting it.
MAX_MESSAGE_SIZE_LIMIT = 256 * 1024 * 1024


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it can name a queue, else raise :class:`InvalidQueueName`."""
    if not isinstance(name, str):
        raise exceptions.InvalidQueueName(f"queue name must be a string, got {name!r}")
    size = len(name.encode("utf-8", "surrogatepass"))
    if not 0 < size <= MAX_QUEUE_NAME_BYTES:
        shown = name if size <= 80 else name[:60] + "..."
        raise exceptions.InvalidQueueName(
            f"invalid queue name {shown!r} ({size} bytes): a queue name is 1 to "
            f"{MAX_QUEUE_NAME_BYTES} bytes of UTF-8"
        )
    if "\x00" in name:
        raise exceptions.InvalidQueueName(
            f"invalid queue name {name!r}: NUL characters are not allowed"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise exceptions.InvalidQueueName(
            f"invalid queue name {name!r}: not valid UTF-8 (lone surrogate)"
        ) from None
    return name


#: The message keys, as ``apply_async`` options and message headers: a unique key
#: (docs/unique.md) and the key a per-key concurrency limit counts by (docs/limits.md).
UNIQUE_KEY = "pgskip_unique"
CONCURRENCY_KEY = "pgskip_concurrency_key"
#: The longest key, in bytes of UTF-8: far below what one entry of a B-tree index can hold.
MAX_KEY_BYTES = 512


def message_keys(message: dict[str, Any]) -> tuple[str | None, str | None]:
    """The message's unique key and concurrency key (``None`` where it has none), which
    ``apply_async`` puts in the message's properties (an unknown ``apply_async`` option
    becomes one) and a retry carries in the headers. A key given as a property is moved
    into the headers, so that Celery's ``retry``, which copies the headers of the task it
    retries, publishes it again; raises
    :class:`~kombu_pgskip.exceptions.ConfigurationError` for a key that is not 1 to
    :data:`MAX_KEY_BYTES` bytes of text without NUL."""
    properties = message.get("properties")
    headers = message.get("headers")
    found: list[str | None] = []
    for name in (UNIQUE_KEY, CONCURRENCY_KEY):
        value = properties.pop(name, None) if properties else None
        if value is None:
            value = headers.get(name) if headers else None
        elif headers is None:
            headers = message["headers"] = {name: value}
        else:
            headers[name] = value
        found.append(None if value is None else _valid_key(name, value))
    return found[0], found[1]


def _valid_key(name: str, value: object) -> str:
    size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else -1
    if not 0 < size <= MAX_KEY_BYTES or "\x00" in value:  # type: ignore[operator]
        raise exceptions.ConfigurationError(
            f"{name}={value!r}: a key is 1 to {MAX_KEY_BYTES} bytes of text without NUL "
            "(for example f'invoice:{invoice.id}'); nothing was written"
        )
    return value  # type: ignore[return-value]


def _parse_eta(value: Any) -> datetime | None:
    if not value:
        return None
    if isinstance(value, datetime):
        eta = value
    else:
        try:
            eta = datetime.fromisoformat(str(value))
        except ValueError:
            return None  # Celery rejects it at the worker with a clear error; deliver now.
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return eta


def priority_of(message: dict[str, Any], max_priority: int = 9) -> int:
    """The message's priority property as an AMQP priority, 0 to ``max_priority``."""
    try:
        value = int(message.get("properties", {}).get("priority") or 0)
    except (TypeError, ValueError):
        return 0
    return max(0, min(value, max_priority))


def ttl_ms_of(message: dict[str, Any]) -> int | None:
    """Milliseconds the message may wait in its queue (its ``expiration``), or ``None``."""
    headers = message.get("headers") or {}
    if headers.get("task") is not None and headers.get("id") is not None:
        # A Celery task message (protocol 2): Celery turns ``expires`` into an ``expiration``
        # property too, but its workers expect to receive the expired message and mark the
        # task REVOKED (as they do with Redis), so the task is not left PENDING forever.
        return None
    expiration = message.get("properties", {}).get("expiration")
    if expiration in (None, ""):
        return None
    try:
        return max(0, int(float(expiration)))
    except (TypeError, ValueError):
        return None


def to_row(
    queue: str,
    message: dict[str, Any],
    *,
    eta_threshold: float,
    max_message_size: int,
    now: datetime | None = None,
) -> NewMessage:
    """The row for ``message`` published to ``queue``.

    A message whose ``eta`` is more than ``eta_threshold`` seconds away is stored as
    ``scheduled`` with ``run_at`` = eta: it waits in the database, not in a worker's memory.
    """
    validate_queue_name(queue)
    return _row(
        queue,
        describe_destination(queue=queue),
        message,
        eta_threshold=eta_threshold,
        max_message_size=max_message_size,
        now=now,
    )


def to_routed_row(
    exchange: str,
    message: dict[str, Any],
    *,
    eta_threshold: float,
    max_message_size: int,
    now: datetime | None = None,
) -> NewMessage:
    """The row for ``message`` published to ``exchange``; the database picks the queues.

    Its ``queue`` is empty: :meth:`~kombu_pgskip.store.Store.publish_routed` inserts one copy
    per queue the exchange routes the message to.
    """
    return _row(
        "",
        describe_destination(exchange=exchange),
        message,
        eta_threshold=eta_threshold,
        max_message_size=max_message_size,
        now=now,
    )


def describe_destination(*, queue: str = "", exchange: str | None = None) -> str:
    """Where a message goes, as errors name it: its exchange if it has one, else its queue."""
    return f"queue {queue!r}" if exchange is None else f"exchange {exchange!r}"


def _row(
    queue: str,
    destination: str,
    message: dict[str, Any],
    *,
    eta_threshold: float,
    max_message_size: int,
    now: datetime | None,
) -> NewMessage:
    unique_key, concurrency_key = message_keys(message)
    headers = message.get("headers") or {}
    body = message.get("body")
    if isinstance(body, (str, bytes)) and len(body) > max_message_size:
        # Refused before encoding a second copy of a huge body.
        raise _too_large(len(body), destination, max_message_size)
    payload = _encode(message)
    if len(payload) > max_message_size:
        raise _too_large(len(payload), destination, max_message_size)
    refuse_nul(payload)
    eta = _parse_eta(headers.get("eta"))
    status, run_at = "pending", None
    if eta is not None:
        current = now or datetime.now(timezone.utc)
        if eta - current > timedelta(seconds=eta_threshold):
            status, run_at = "scheduled", eta
    task_name = headers.get("task")
    task_id = headers.get("id")
    return NewMessage(
        queue=queue,
        priority=priority_of(message),
        status=status,
        run_at=run_at,
        payload=payload,
        task_name=str(task_name) if task_name is not None else None,
        task_id=str(task_id) if task_id is not None else None,
        ttl_ms=ttl_ms_of(message),
        unique_key=unique_key,
        concurrency_key=concurrency_key,
    )


class Rebodied:
    """Rows like ``row`` with other bodies, as publishing the same call again would write them.

    ``row`` is what :func:`to_row` or :func:`to_routed_row` built for one message. Only the
    body and the delivery tag (one per message) differ between messages of one
    ``publish_many`` call; every other part of the payload, and every column, is the same. So
    the payload is encoded once, around two markers, and each further message is the two
    pieces spliced in: the same JSON text, without kombu's message dict or a second encoding
    of its headers.
    """

    def __init__(self, row: NewMessage, destination: str, *, max_message_size: int) -> None:
        message = loads(row.payload)
        self.row = row
        self.destination = destination
        self.max_message_size = max_message_size
        self.body_encoding = (message.get("properties") or {}).get("body_encoding")
        self.content = (message.get("content-type"), message.get("content-encoding"))
        marker = f"pgskip-{uuid.uuid4().hex}"
        message["body"] = marker
        message["properties"]["delivery_tag"] = marker + "t"
        text = _encode(message)
        body_at = text.index(f'"{marker}"')
        tag_at = text.index(f'"{marker}t"')
        if body_at > tag_at:  # kombu puts the body first; anything else is not spliced
            raise ValueError("body after delivery tag")
        self._head = text[:body_at]
        self._middle = text[body_at + len(marker) + 2 : tag_at]
        self._tail = text[tag_at + len(marker) + 3 :]

    def with_body(self, body: str, delivery_tag: str) -> NewMessage:
        """The row for a message whose encoded body (``body_encoding`` applied) is ``body``."""
        encoded = _json_string(body)  # what dumps(body) gives for a str, without an encoder
        refuse_nul(encoded)
        payload = f"{self._head}{encoded}{self._middle}{_json_string(delivery_tag)}{self._tail}"
        if len(payload) > self.max_message_size:
            raise _too_large(len(payload), self.destination, self.max_message_size)
        return self.row.to(self.row.queue, payload)


def refuse_nul(payload: str) -> None:
    """Raise unless ``payload`` (JSON text: a whole payload, or one JSON string) is free of
    ``\\u0000``, the escape a U+0000 of the message becomes in JSON.

    The ``json`` column stores it, and the transport reads the payload back whole, but
    PostgreSQL refuses it everywhere else: every ``->`` or ``->>`` on that payload fails
    (operators' ``payload->'headers'->>'task'``, whatever the key), and so do a cast to
    ``jsonb`` and the text columns (``task_name`` and ``task_id`` come from the headers). The
    text ``\\u0000`` in a value is encoded ``\\\\u0000``, an escaped backslash followed by
    ``u0000``: accepted, like everything in a base64-encoded body, whose bytes may hold NULs.
    The JSON encoders used here escape every control character, so a U+0000 never appears
    unescaped.
    """
    at = payload.find("\\u0000")
    while at >= 0:
        # The escape's backslash is itself escaped when an odd number of backslashes precede it.
        start = at
        while start and payload[start - 1] == "\\":
            start -= 1
        if (at - start) % 2 == 0:
            raise exceptions.ConfigurationError(
                "message contains a NUL character (\\u0000), which PostgreSQL cannot store "
                "outside a base64-encoded body: strip NULs from the task name, headers and "
                "properties; Celery copies args and kwargs into the argsrepr and kwargsrepr "
                "headers, so pass apply_async(..., argsrepr=..., kwargsrepr=...) without NULs "
                "(the arguments themselves travel intact in the body)"
            )
        at = payload.find("\\u0000", at + 1)


def _too_large(size: int, destination: str, limit: int) -> exceptions.MessageTooLarge:
    return exceptions.MessageTooLarge(
        f"message of at least {size} bytes for {destination} exceeds max_message_size "
        f"({limit} bytes); nothing was written: pass large data by reference (a row id, an "
        "object store key) or raise the max_message_size transport option (at most "
        f"{MAX_MESSAGE_SIZE_LIMIT} bytes)"
    )


def _encode(message: dict[str, Any]) -> str:
    """The message as JSON.

    Custom properties (``Producer.publish(..., anything=value)``) are kept when they are JSON
    values; one that is not (an object passed along by mistake) is dropped, as an AMQP broker
    drops every property it does not know, instead of failing the publish. Headers and body
    must encode.
    """
    try:
        return str(_ENCODER.encode(message))
    except TypeError:
        properties = message.get("properties")
        if not isinstance(properties, dict):
            raise
        kept: dict[str, Any] = {}
        for key, value in properties.items():
            try:
                _ENCODER.encode(value)
            except TypeError:
                continue
            kept[key] = value
        return str(_ENCODER.encode({**message, "properties": kept}))


#: kombu's JSON encoder, made once: ``kombu.utils.json.dumps`` makes one per call, about a
#: quarter of the time to encode a Celery message. The same text, types registered with
#: kombu's ``register_type`` included (the encoder looks them up as it meets them).
_ENCODER = JSONEncoder()


def make_tag(row_id: int, delivery: int) -> str:
    """A delivery tag that carries the fencing token: the row and which delivery of it (the
    token its fetch stamped, :attr:`~kombu_pgskip.store.FetchedRow.delivery`, which no other
    delivery of the row carries)."""
    return f"{row_id}.{delivery}"


def parse_tag(tag: object) -> tuple[int, int]:
    """(row id, delivery token) of a tag made by :func:`make_tag`."""
    row_id, _, delivery = str(tag).partition(".")
    return int(row_id), int(delivery)


def to_message(row: FetchedRow) -> dict[str, Any]:
    """The raw kombu message a consumer receives for a fetched row."""
    message = row.payload
    props = message.setdefault("properties", {})
    props["delivery_tag"] = make_tag(row.id, row.delivery)
    delivery_info = props.setdefault("delivery_info", {})
    delivery_info["redelivered"] = row.redelivered
    delivery_info.setdefault("routing_key", row.queue)
    message["redelivered"] = row.redelivered
    return message


# Serializers whose bodies are checked before delivery: parsing them runs no code of the
# message's (pickle and yaml bodies are never deserialised here; Celery refuses them unless
# accepted, and then decodes them itself).
_PARSED_CONTENT_TYPES = frozenset({"application/json", "application/x-json"})
_BYTES_ENCODINGS = frozenset({"binary", "ascii-8bit"})


def decode_problem(message: dict[str, Any]) -> str | None:
    """Why the body of a fetched ``message`` cannot be decoded, or ``None`` if it can.

    Checks what every consumer would trip over: the transport's body encoding (base64), the
    ``content-encoding`` (an unknown codec, bytes invalid in it) and, for JSON, the JSON
    itself. Celery acknowledges a message it cannot decode (``on_decode_error``), or fails the
    task after acknowledging it, so the message would be *completed*; the transport marks it
    ``failed`` with this reason instead, where ``pgskip failed`` lists it.
    """
    body = message.get("body")
    if body is None:
        return None
    content_type = str(message.get("content-type") or "")
    content_encoding = str(message.get("content-encoding") or "utf-8").lower()
    body_encoding = (message.get("properties") or {}).get("body_encoding")
    try:
        raw = body.encode("utf-8") if isinstance(body, str) else bytes(body)
        if body_encoding == "base64":
            raw = base64.b64decode(raw, validate=True)
        compression = (message.get("headers") or {}).get("compression")
        if compression:  # as kombu's Message does, before decoding
            try:
                raw = decompress(raw, compression)
            except Exception as exc:  # each codec raises its own errors
                raise ValueError(f"cannot decompress {compression}: {exc!r}") from exc
        if content_encoding in _BYTES_ENCODINGS:
            return None
        text = codecs.decode(raw, content_encoding)
        if content_type in _PARSED_CONTENT_TYPES:
            loads(text)
    except (binascii.Error, LookupError, UnicodeError, ValueError, TypeError) as exc:
        return (
            f"undecodable message body (content-type {content_type or 'none'!r}, "
            f"content-encoding {content_encoding!r}): {type(exc).__name__}: {exc}"
        )
    return None
