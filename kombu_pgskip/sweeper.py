"""A live worker's share of the maintenance, every ``sweep_interval``: the sweep.

Calls of the schema's ``sweep()`` function (the one the pg_cron ``sweep`` job runs, see
:mod:`~kombu_pgskip.maintenance`): rows held by dead consumers (whose lease ran out, or whose
process's session lock a sweep found released ``LOCK_GRACE_S`` earlier and still finds so, see
:mod:`~kombu_pgskip.leases`) go back to ``pending`` (to ``failed`` after ``max_attempts``
deliveries), those consumers are forgotten, due scheduled rows are promoted. A sweep that finds
a lock released tells its caller to sweep again once the grace is over. Then messages whose TTL
ran out are dropped, and queues whose ``x-expires`` ran out are deleted. Every worker does it,
so the queue stays healthy without pg_cron.

Every worker of a fleet runs this, so none of it waits for another: rows and consumers another
session has locked are skipped (``SKIP LOCKED``), and left for the next sweep. Each statement
works on a bounded batch, and with a ``deadline`` each one waits for locks and runs only as long
as is left before it, and none starts after it: a lock held on ``jobs`` (an index build, a table
rewrite) then costs a skipped sweep, not the background thread's next lease renewal.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from .store import DROP_EXPIRED_BATCH, SWEEP_BATCH

if TYPE_CHECKING:
    from .store import Store

logger = logging.getLogger(__name__)

#: Less time than this left before the deadline: the next statement is left for later.
MIN_STATEMENT_S = 0.05
#: A worker's sweep reads every running message, for those of consumers no longer known (left
#: by a sweep that reached its batch limit, or deleted by hand), where the database's last such
#: read began this long ago or more, or left rows behind (migration 0030). The read walks every
#: row version that became running since vacuum last passed (while a snapshot is held, all of
#: them): made at every sweep of every worker, it cost a fleet of N workers N such walks every
#: ``sweep_interval``. The rows of consumers a sweep takes for dead it reads at once, whatever
#: this says.
ORPHAN_SCAN_EVERY_S = 60.0


class OutOfTime(Exception):
    """The sweep's deadline came before its work was done; the rest is left for the next."""


def bounded(store: Store, deadline: float | None) -> AbstractContextManager[None]:
    """Where a housekeeping statement runs: bounded by the time left before ``deadline``
    (``time.monotonic()``), or as it is without one. Raises :class:`OutOfTime` if too little
    is left."""
    if deadline is None:
        return nullcontext()
    left = deadline - time.monotonic()
    if left < MIN_STATEMENT_S:
        raise OutOfTime()
    return store.bounded(left)


class Sweeper:
    def __init__(self, *, interval: float, max_attempts: int) -> None:
        self.interval = interval
        self.max_attempts = max_attempts

    def __call__(self, store: Store, *, deadline: float | None = None) -> bool:
        """One sweep; True if a consumer was found without its session lock and not yet taken
        for dead: a sweep ``LOCK_GRACE_S`` later takes it for dead if its lock is still
        released."""
        suspects = False
        try:
            suspects = self._dead_consumers(store, deadline)
            self._expired(store, deadline)
        except OutOfTime:
            logger.info(
                "sweep not finished in the time it had; the next one goes on with it",
                extra={"action": "sweep_out_of_time"},
            )
        return suspects

    def _dead_consumers(self, store: Store, deadline: float | None) -> bool:
        requeued = failed = forgotten = 0
        try:
            while True:
                with bounded(store, deadline):
                    r, f, c = store.sweep(
                        max_attempts=self.max_attempts, scan_every=ORPHAN_SCAN_EVERY_S
                    )
                requeued, failed, forgotten = requeued + r, failed + f, forgotten + c
                if r + f < SWEEP_BATCH:
                    break
        finally:
            if requeued or failed or forgotten:
                logger.info(
                    "sweeper: %d messages of dead consumers requeued, %d failed, %d consumers "
                    "forgotten",
                    requeued,
                    failed,
                    forgotten,
                    extra={"action": "sweep"},
                )
        with bounded(store, deadline):
            return store.suspected_consumers() > 0

    def _expired(self, store: Store, deadline: float | None) -> None:
        expired = 0
        try:
            while True:
                with bounded(store, deadline):
                    n = store.drop_expired(DROP_EXPIRED_BATCH)
                expired += n
                if n < DROP_EXPIRED_BATCH:
                    break
        finally:
            if expired:
                logger.info(
                    "dropped %d messages whose TTL ran out", expired, extra={"action": "expire"}
                )
        with bounded(store, deadline):
            queues, dropped = store.expire_queues()
        if queues:
            logger.info(
                "deleted %d queues unused for longer than their x-expires (%d messages)",
                queues,
                dropped,
                extra={"action": "expire_queues"},
            )
