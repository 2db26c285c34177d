"""Fleet-wide limits of a queue (``pgskip limit``, migration 0025): how they are written, and
what a consuming process learns of them.

A limit is a row of ``queue_limits``: at most ``max_running`` of the queue's messages running
at once, at most ``max_running_per_key`` per concurrency key, at most ``rate`` started per
second, counted across every worker by the limited fetch
(:meth:`~kombu_pgskip.store.Store.fetch_limited`). The normal fetch skips a limited queue, so a
limit holds whatever a worker knows; what a worker knows decides only when it sends the
limited fetches (:class:`~kombu_pgskip.policy.LimitGate`).

:class:`LimitWatch` runs in the worker's background thread after each lease renewal (every
``lease_seconds / 3``): it reads which of the queues the process consumes are limited, tells
the dispatcher (which starts or stops their limited fetches) and logs an INFO line when one
becomes limited or is no longer.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import exceptions

if TYPE_CHECKING:
    import uuid

    from .store import Store

logger = logging.getLogger(__name__)

_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:/\s*([smh]))?\s*$")
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(text: str | float) -> float:
    """A rate as Celery writes a task's ``rate_limit`` (``"10/s"``, ``"100/m"``,
    ``"1000/h"``) or a number of messages per second (``"2.5"``), in messages per second.
    Raises :class:`~kombu_pgskip.exceptions.ConfigurationError` for anything else, or a rate
    that is not positive."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _RATE.match(str(text))
        if match is None:
            raise exceptions.ConfigurationError(
                f"rate {text!r}: write it as Celery's rate_limit does, a number per second, "
                "minute or hour (10/s, 100/m, 1000/h), or a number per second (2.5)"
            )
        value = float(match.group(1)) / _PER[match.group(2) or "s"]
    if not 0 < value < math.inf:
        raise exceptions.ConfigurationError(f"rate {text!r}: a rate must be above 0")
    return value


def format_rate(rate: float) -> str:
    """``rate`` (per second) as a person reads it: ``10/s``, ``2/m``, ``0.5/s``."""
    for unit in ("s", "m", "h"):
        n = rate * _PER[unit]
        if n >= 1 and abs(n - round(n)) < 1e-9:
            return f"{round(n)}/{unit}"
    return f"{rate:g}/s"


@dataclass(frozen=True)
class Limit:
    queue: str
    max_running: int | None
    max_running_per_key: int | None
    rate: float | None
    burst: int | None

    def describe(self) -> str:
        """``at most 5 running, 1 running per key, 10/s (burst 10)``."""
        parts = []
        if self.max_running is not None:
            parts.append(f"at most {self.max_running} running")
        if self.max_running_per_key is not None:
            parts.append(f"{self.max_running_per_key} running per key")
        if self.rate is not None:
            parts.append(f"{format_rate(self.rate)} (burst {self.burst})")
        return ", ".join(parts)


class LimitWatch:
    """Tells the dispatcher which queues this process consumes are limited, and logs it."""

    def __init__(self, on_change: Callable[[set[str]], None] | None = None) -> None:
        #: The limited queues of this process the last check found, by name.
        self.limited: dict[str, Limit] = {}
        self.on_change = on_change

    def check(self, store: Store, consumers: Sequence[uuid.UUID]) -> None:
        found = {
            str(r[0]): Limit(str(r[0]), r[1], r[2], r[3], r[4])
            for r in store.execute("limited_for", {"ids": list(consumers)})
        }
        for name in sorted(found):
            if self.limited.get(name) != found[name]:
                logger.info(
                    "queue %r is limited across every worker: %s",
                    name,
                    found[name].describe(),
                    extra={"action": "queue_limited", "queue": name},
                )
        for name in sorted(self.limited.keys() - found.keys()):
            logger.info(
                "queue %r is no longer limited",
                name,
                extra={"action": "queue_unlimited", "queue": name},
            )
        self.limited = found
        if self.on_change is not None:
            self.on_change(set(found))
