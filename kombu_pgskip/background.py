"""The consuming process's background thread and its duties, on a connection of its own.

One thread per transport that consumes, started with its first consumer. Every
``lease_seconds / 3`` it runs what is due: the lease renewal (:mod:`~kombu_pgskip.leases`,
which first writes acks left waiting), the sweep every ``sweep_interval``
(:mod:`~kombu_pgskip.sweeper`; the first one at a point of the interval that depends on the
process id, so that a fleet started together does not sweep together), and the check of the
xmin horizon (:class:`~kombu_pgskip.health.HorizonMonitor`, throttled by itself). A failing
duty logs a warning and its connection is reopened at the next beat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .health import HorizonMonitor
from .leases import Leaseholder, LeaseRenewal
from .store import Store
from .sweeper import Sweeper

if TYPE_CHECKING:
    from .options import Options

logger = logging.getLogger(__name__)


class Background(threading.Thread):
    def __init__(
        self, url: str, options: Options, holders: Callable[[], Sequence[Leaseholder]]
    ) -> None:
        super().__init__(name="pgskip-heartbeat", daemon=True)
        self.stop_event = threading.Event()
        self.store = Store(
            url,
            schema=options.schema,
            check=False,
            keep_completed=options.keep_completed,  # it writes acks
            **options.connect_kwargs,
        )
        self.leases = LeaseRenewal(holders, options.lease_seconds)
        self.sweeper = Sweeper(interval=options.sweep_interval, max_attempts=options.max_attempts)
        self.horizon = HorizonMonitor(self.store, options.xmin_horizon_warning)

    def run(self) -> None:
        interval = self.leases.interval
        next_sweep = time.monotonic() + self.sweeper.interval * (0.5 + (os.getpid() % 100) / 200)
        while not self.stop_event.wait(interval):
            try:
                self.leases(self.store)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.sweeper.interval
                    self.sweeper(self.store)
                self.horizon.maybe_check()  # throttled; logs its own failures
            except Exception as exc:
                logger.warning(
                    "lease renewal failed: %s", exc, extra={"action": "heartbeat_failed"}
                )
                self.store.close()
        self.store.close()

    def stop(self) -> None:
        self.stop_event.set()
