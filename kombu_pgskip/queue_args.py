"""The schema owner's deliberate change of a declared queue's arguments (``pgskip queue-args``).

A queue's first declaration fixes its settings (AMQP): a later declaration with another
``x-expires``, ``x-message-ttl``, ``x-max-priority`` or ``auto_delete`` fails with
:class:`~kombu_pgskip.exceptions.PreconditionFailed` and changes nothing, so that a publisher
cannot make a backlog expire, and two services that declare one queue differently find out
instead of taking turns. Only the schema's owner may change them, with this: workers and
publishers have no ``UPDATE`` on a queue's arguments (docs/security.md).

Messages already waiting keep the TTL they were published with; a new ``x-max-priority``
applies to messages published from then on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg

from . import exceptions
from .sql import queries_in
from .urls import connect, mask_url

logger = logging.getLogger(__name__)

#: Arguments with an effect here, each with the smallest value it takes.
TYPED_ARGUMENTS = {"x-max-priority": 0, "x-message-ttl": 0, "x-expires": 1}
_LIMITS = {"x-max-priority": 255}


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line: VALUE as JSON when it parses (numbers, ``true``,
    quoted strings), else as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise exceptions.ConfigurationError(
            f"--set expects KEY=VALUE (e.g. x-expires=60000), not {text!r}"
        )
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _checked(arguments: Mapping[str, Any]) -> dict[str, int | None]:
    """The typed columns for ``arguments``, or a ConfigurationError that names the bad one."""
    typed: dict[str, int | None] = {}
    for key, least in TYPED_ARGUMENTS.items():
        value = arguments.get(key)
        if value is None:
            typed[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise exceptions.ConfigurationError(
                f"{key} must be a whole number of "
                f"{'levels' if key == 'x-max-priority' else 'milliseconds'}, not {value!r}"
            )
        most = _LIMITS.get(key)
        if value < least or (most is not None and value > most):
            bounds = f"between {least} and {most}" if most is not None else f"at least {least}"
            raise exceptions.ConfigurationError(f"{key} must be {bounds}, not {value}")
        typed[key] = value
    return typed


def set_queue_arguments(
    url: str,
    schema: str,
    name: str,
    *,
    set: Mapping[str, Any] | None = None,
    unset: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Change queue ``name``'s arguments, as the schema's owner; returns (before, after).

    With nothing to set or unset, only reads them. One transaction: the queue's row is locked
    while it changes, and an invalid value changes nothing. Raises
    :class:`~kombu_pgskip.exceptions.ConfigurationError` when the queue does not exist or a
    value is invalid, and :class:`~kombu_pgskip.exceptions.PermissionDenied` for a role that
    is not the owner.
    """
    changes = dict(set or {})
    removed = list(unset)
    q = queries_in("admin.sql", schema)
    with (
        exceptions.translating(url_for_messages=mask_url(url)),
        connect(url, autocommit=False) as conn,
    ):
        try:
            row = conn.execute(q["queue_arguments"], {"name": name}).fetchone()
            if row is None:
                raise exceptions.ConfigurationError(
                    f"no queue {name!r} in schema {schema!r}: a queue exists once a "
                    "worker or publisher declared it"
                )
            before = dict(row[0] or {})
            after = {k: v for k, v in before.items() if k not in removed}
            after.update(changes)
            if after == before:
                conn.rollback()
                return before, after
            typed = _checked(after)
            conn.execute(
                q["set_queue_arguments"],
                {
                    "name": name,
                    "arguments": json.dumps(after),
                    "max_priority": typed["x-max-priority"],
                    "message_ttl": typed["x-message-ttl"],
                    "expires": typed["x-expires"],
                },
            )
            conn.commit()
        except psycopg.errors.InsufficientPrivilege as exc:
            raise exceptions.PermissionDenied(
                f"only the owner of schema {schema!r} may change a queue's arguments: "
                f"connect as the owner (--url) ({exc})"
            ) from exc
    logger.info(
        "queue %r arguments changed from %s to %s",
        name,
        before,
        after,
        extra={"action": "queue_args"},
    )
    return before, after


__all__ = ["TYPED_ARGUMENTS", "parse_assignment", "set_queue_arguments"]
