"""A live worker's share of the maintenance, every ``sweep_interval``: the sweep.

One call of the schema's ``sweep()`` function (the one the pg_cron ``sweep`` job runs, see
:mod:`~kombu_pgskip.maintenance`): rows held by consumers whose lease ran out go back to
``pending`` (to ``failed`` after ``max_attempts`` deliveries), those consumers are forgotten,
due scheduled rows are promoted. Then messages whose TTL ran out are dropped, and queues whose
``x-expires`` ran out are deleted. Every worker does it, so the queue stays healthy without
pg_cron; the statements skip what another worker is doing at the same moment.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import Store

logger = logging.getLogger(__name__)


class Sweeper:
    def __init__(self, *, interval: float, max_attempts: int) -> None:
        self.interval = interval
        self.max_attempts = max_attempts

    def __call__(self, store: Store) -> None:
        requeued, failed, forgotten = store.sweep(max_attempts=self.max_attempts)
        expired = store.drop_expired()
        if expired:
            logger.info(
                "dropped %d messages whose TTL ran out", expired, extra={"action": "expire"}
            )
        queues, dropped = store.expire_queues()
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
