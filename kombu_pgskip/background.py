"""The consuming process's background thread: leases first, then housekeeping.

One thread per transport that consumes, started with its first consumer, on two connections of
its own:

* the **lease connection** renews the leases (:mod:`~kombu_pgskip.leases`) every
  ``lease_seconds / 3`` and holds the process's session lock; it writes nothing but the
  ``consumers`` rows, so no lock on ``jobs`` or ``queues`` delays a renewal, and no failing
  housekeeping statement closes it (which would release the lock);
* the **housekeeping connection** runs what comes after each renewal: the acks consumers left
  waiting, the ``x-expires`` clocks of their queues, the sweep every ``sweep_interval``
  (:mod:`~kombu_pgskip.sweeper`), what is paused or limited among their queues
  (:class:`~kombu_pgskip.pausing.PauseWatch`, :class:`~kombu_pgskip.limits.LimitWatch`) and
  the check of the xmin horizon (:class:`~kombu_pgskip.health.HorizonMonitor`, throttled by
  itself), and the rotation of ``jobs``' slots every ``ROTATE_S`` (:meth:`Store.rotate`: one
  worker of the fleet at a time does it, the others find it taken and go on; after a failed
  one, twice as long each time, up to ``ROTATE_MAX_S``). Each of its statements waits for
  locks and runs only within a budget of half the renewal interval, so the next renewal is
  never late by more than that.

The thread also starts the check of the pg_cron jobs' runs
(:class:`~kombu_pgskip.health.CronRunMonitor`, throttled by itself), which runs in a thread and
on connections of its own.

The first beat runs as the thread starts, sweep included: a worker started in place of one that
was killed returns its predecessor's messages within seconds (the killed process's session lock
is gone; a sweep that finds a lock released sweeps again once ``LOCK_GRACE_S`` is over, see
:mod:`~kombu_pgskip.leases`). Later sweeps start at a point of the interval that depends on the
process id, so that a fleet started together does not sweep together.

Between beats the thread watches the lease connection: if the server ends that session, it
reconnects and takes its lock again at once, so that its consumers do not count as dead for
longer than that takes. It also renews at once a consumer registered since the last renewal, so
that a new consumer goes by the session lock within a fraction of a second rather than by its
lease until the next beat. A failing renewal is retried within a second, then less and less
often.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psycopg
from psycopg import pq

from .health import CronRunMonitor, HorizonMonitor
from .leases import Leaseholder, LeaseRenewal
from .limits import LimitWatch
from .pausing import PauseWatch
from .store import LOCK_GRACE_S, Store
from .sweeper import MIN_STATEMENT_S, Sweeper

if TYPE_CHECKING:
    import uuid

    from .options import Options

logger = logging.getLogger(__name__)

#: The first retry of a failed renewal; each further one waits twice as long, up to the
#: renewal interval.
RETRY_S = 0.5
#: How often each worker rotates ``jobs``' slots (migration 0027): often enough that a slot of
#: 20,000 ids is left soon after it fills at full speed, and emptied soon after its messages
#: finish.
ROTATE_S = 1.0
#: After a rotation that failed (its statement ran out of time, the connection broke), the next
#: one waits twice as long as the last, up to this: a move to ``jobs_kept`` that does not fit in
#: the housekeeping budget holds every fetch up while it runs, and is not to be retried every
#: second.
ROTATE_MAX_S = 60.0
#: How long after the grace a sweep that found a consumer without its lock sweeps again.
GRACE_MARGIN_S = 0.1
#: Longest wait between two looks at the stop flag and at the consumers to renew, while the
#: lease connection is watched: a consumer registered since the last renewal is renewed, and
#: so goes by the session lock, within this.
WATCH_S = 0.25
#: SQLSTATEs of housekeeping errors after which the connection is fine: a lock or the time
#: ran out (lock_timeout, statement_timeout).
_TIMED_OUT = frozenset({"55P03", "57014"})


def rotation_delay(failures: int) -> float:
    """Seconds until the next rotation after ``failures`` failed ones in a row."""
    return min(ROTATE_S * 2.0 ** min(failures, 16), ROTATE_MAX_S)


class Background(threading.Thread):
    def __init__(
        self,
        url: str,
        options: Options,
        holders: Callable[[], Sequence[Leaseholder]],
        on_limits: Callable[[set[str]], None] | None = None,
    ) -> None:
        """``on_limits`` is told, after each renewal, which of the queues consumed here are
        limited (``pgskip limit``)."""
        super().__init__(name="pgskip-heartbeat", daemon=True)
        self.stop_event = threading.Event()
        #: Renewals and the session lock, nothing else.
        self.lease_store = Store(url, schema=options.schema, check=False, **options.connect_kwargs)
        #: Housekeeping: acks left waiting, queues' clocks, the sweep, the horizon check.
        self.store = Store(
            url,
            schema=options.schema,
            check=False,
            keep_completed=options.keep_completed,  # it writes acks
            **options.connect_kwargs,
        )
        # listen=False is the mode for PgBouncer in transaction pooling: no session to lock in.
        self.leases = LeaseRenewal(holders, options.lease_seconds, session_lock=options.listen)
        self.sweeper = Sweeper(interval=options.sweep_interval, max_attempts=options.max_attempts)
        self.horizon = HorizonMonitor(self.store, options.xmin_horizon_warning)
        self.cron_runs = CronRunMonitor(url, options.schema)
        self.pauses = PauseWatch()
        self.limits = LimitWatch(on_limits)
        #: How long housekeeping may take after a renewal.
        self.budget = self.leases.interval / 2.0
        self._failures = 0
        #: The consumers the last renewal found alive.
        self._renewed: set[uuid.UUID] = set()
        #: Whether the last sweep found a consumer without its session lock.
        self._suspects = False
        #: Rotations that failed since the last one that did not.
        self._rotation_failures = 0

    def run(self) -> None:
        now = time.monotonic()
        renew_at = sweep_at = rotate_at = now
        first_sweep = True
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                deadline = now + self.budget
                if now >= renew_at:
                    alive = self._renew()
                    renew_at = time.monotonic() + self._next_renewal_in(alive is not None)
                    deadline = time.monotonic() + self.budget
                    self._housekeep("ack flush", self._flush_acks, deadline)
                    if alive:
                        self._housekeep("marking queues used", self._mark_queues(alive), deadline)
                        self._housekeep("paused queues", self._check_pauses(alive), deadline)
                        self._housekeep("limited queues", self._check_limits(alive), deadline)
                if now >= sweep_at:
                    if first_sweep:
                        first_sweep = False
                        spread = 0.5 + (os.getpid() % 100) / 200
                        sweep_at = now + self.sweeper.interval * spread
                    else:
                        sweep_at = now + self.sweeper.interval
                    self._suspects = False
                    self._housekeep("sweep", self._sweep, deadline)
                    if self._suspects:  # a consumer's lock is gone: dead once the grace is over
                        sweep_at = min(sweep_at, time.monotonic() + LOCK_GRACE_S + GRACE_MARGIN_S)
                if now >= rotate_at:
                    self._housekeep("rotation", self._rotate, time.monotonic() + self.budget)
                    rotate_at = time.monotonic() + rotation_delay(self._rotation_failures)
                self.horizon.maybe_check()  # throttled; logs its own failures
                self.cron_runs.maybe_check()  # throttled; runs in a thread of its own
                if self._wait(min(renew_at, sweep_at, rotate_at)):
                    renew_at = time.monotonic()
        finally:
            self.lease_store.close()
            self.store.close()

    def stop(self) -> None:
        self.stop_event.set()

    # -- leases -----------------------------------------------------------------------------------

    def _renew(self) -> list[uuid.UUID] | None:
        """Renew the leases; the consumers still alive, or None if the renewal failed."""
        try:
            alive = self.leases.renew(self.lease_store)
        except Exception as exc:
            self._failures += 1
            logger.warning("lease renewal failed: %s", exc, extra={"action": "heartbeat_failed"})
            if self._lease_session_ended():
                self._drop_lease_session()
            return None
        self._failures = 0
        self._renewed = set(alive)
        return alive

    def _next_renewal_in(self, renewed: bool) -> float:
        if renewed:
            return self.leases.interval
        return min(RETRY_S * 2.0 ** (self._failures - 1), self.leases.interval)

    def _drop_lease_session(self) -> None:
        self.lease_store.close()
        if self.leases.lock is not None:
            self.leases.lock.forget()

    def _lease_session_ended(self) -> bool:
        """Whether the server ended the session holding the lock (it closed the connection, or
        said why it ends it): reads what arrived on it without waiting."""
        lock = self.leases.lock
        conn = lock.connection if lock is not None else None
        if conn is None:
            return False
        if conn.closed:
            return True
        try:
            conn.pgconn.consume_input()
        except psycopg.Error:
            return True
        return conn.pgconn.status == pq.ConnStatus.BAD

    def _wait(self, until: float) -> bool:
        """Wait until ``until`` (``time.monotonic()``) or the stop; True if a renewal is due
        before that: the lease session ended (its connection is then closed), or a consumer
        registered since the last renewal, whose row is to say which lock it goes by."""
        while not self.stop_event.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return False
            lock = self.leases.lock
            if lock is None:
                self.stop_event.wait(left)
                continue
            if not self._failures and not self._renewed.issuperset(
                h.consumer_id for h in self.leases.holders()
            ):
                return True
            conn = lock.connection
            if conn is None or conn.closed:
                self.stop_event.wait(min(left, WATCH_S))
                continue
            try:
                readable, _, _ = select.select([conn.fileno()], [], [], min(left, WATCH_S))
            except (OSError, ValueError, psycopg.Error):
                readable = [True]
            if readable and self._lease_session_ended():
                logger.warning(
                    "the session holding this process's consumer lock ended; reconnecting",
                    extra={"action": "session_lock_lost"},
                )
                self._drop_lease_session()
                return True
        return False

    # -- housekeeping -----------------------------------------------------------------------------

    def _housekeep(self, what: str, step: Callable[[float], object], deadline: float) -> None:
        """Run ``step(deadline)`` on the housekeeping connection; a failure is logged, and the
        connection reopened next time unless only a lock or the time ran out."""
        if deadline - time.monotonic() < MIN_STATEMENT_S:
            return
        try:
            step(deadline)
        except Exception as exc:
            logger.warning(
                "%s failed: %s", what, exc, extra={"action": "housekeeping_failed", "step": what}
            )
            if getattr(exc, "sqlstate", None) not in _TIMED_OUT:
                self.store.close()

    def _flush_acks(self, deadline: float) -> None:
        self.leases.flush_acks(self.store, deadline - time.monotonic())

    def _mark_queues(self, consumers: list[uuid.UUID]) -> Callable[[float], object]:
        def mark(deadline: float) -> None:
            with self.store.bounded(deadline - time.monotonic()):
                self.store.mark_queues_used(consumers)

        return mark

    def _check_pauses(self, consumers: list[uuid.UUID]) -> Callable[[float], object]:
        def check(deadline: float) -> None:
            with self.store.bounded(deadline - time.monotonic()):
                self.pauses.check(self.store, consumers)

        return check

    def _check_limits(self, consumers: list[uuid.UUID]) -> Callable[[float], object]:
        def check(deadline: float) -> None:
            with self.store.bounded(deadline - time.monotonic()):
                self.limits.check(self.store, consumers)

        return check

    def _rotate(self, deadline: float) -> None:
        self._rotation_failures += 1
        with self.store.bounded(deadline - time.monotonic()):
            emptied, moved, current = self.store.rotate()
        self._rotation_failures = 0
        if moved:
            logger.info(
                "rotation: %d messages still to keep moved to jobs_kept (completed ones of the"
                " slots behind the current one, or any of a slot the ring came back to);"
                " slot %d current",
                moved,
                current,
                extra={"action": "rotate", "moved": moved, "slot": current},
            )
        elif emptied:
            logger.debug(
                "rotation: %d slots emptied, slot %d current",
                emptied,
                current,
                extra={"action": "rotate", "emptied": emptied, "slot": current},
            )

    def _sweep(self, deadline: float) -> None:
        self._suspects = self.sweeper(self.store, deadline=deadline)
