"""What a consuming process says about paused queues (``pgskip pause``, migration 0021).

A paused queue's messages are skipped by every fetch (``sql/consume.sql``), so a worker
consuming it runs nothing from it and says nothing by itself. :class:`PauseWatch` runs in the
worker's background thread after each lease renewal (every ``lease_seconds / 3``): it reads
which of the queues the process consumes are paused and logs a WARNING when one is found
paused (at start, or within one renewal of the pause), naming when, by which role and why,
and the command that resumes it; and an INFO line when it is resumed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uuid

    from .store import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pause:
    queue: str
    paused_at: datetime
    paused_by: str
    reason: str | None


class PauseWatch:
    """Logs when a queue this process consumes is paused or resumed."""

    def __init__(self) -> None:
        #: The paused queues of this process the last check found, by name.
        self.paused: dict[str, Pause] = {}

    def check(self, store: Store, consumers: Sequence[uuid.UUID]) -> None:
        found = {
            str(r[0]): Pause(str(r[0]), r[1], str(r[2]), r[3])
            for r in store.execute("paused_for", {"ids": list(consumers)})
        }
        for name in sorted(found.keys() - self.paused.keys()):
            pause = found[name]
            why = f" ({pause.reason})" if pause.reason else ""
            logger.warning(
                "queue %r is paused since %s by %s%s: this worker takes none of its messages "
                "until `celery -A proj pgskip resume %s`",
                name,
                pause.paused_at.isoformat(sep=" ", timespec="seconds"),
                pause.paused_by,
                why,
                name,
                extra={"action": "queue_paused", "queue": name, "reason": pause.reason},
            )
        for name in sorted(self.paused.keys() - found.keys()):
            logger.info(
                "queue %r is no longer paused",
                name,
                extra={"action": "queue_resumed", "queue": name},
            )
        self.paused = found
