"""Health checks a worker runs in the background: who holds the xmin horizon back, who stops
the ring of ``jobs``' slots being emptied, and whether pg_cron's jobs run.

Every row version a fetch or an ack leaves behind can only be vacuumed once no snapshot can
still see it. One transaction that keeps an old snapshot open (a session ``idle in
transaction`` under REPEATABLE READ, a forgotten ``BEGIN`` in psql, a prepared transaction
nobody commits, a replication slot of a standby that is gone) holds that horizon for the whole
database: ``jobs`` and its indexes then grow with every message and the dequeue slows down,
although the queue itself stays short.

:class:`HorizonMonitor` finds those holders (``health.sql``: ``pg_stat_activity``,
``pg_prepared_xacts``, ``pg_replication_slots``) and logs a WARNING naming each one that has
held the horizon longer than the ``xmin_horizon_warning`` transport option (pid, user,
application, state, for how long, and the query when this role may see it). It is called from
the worker's heartbeat thread, at most every ``min(threshold / 2, 60)`` seconds, and repeats the
warning for the same holder at most once per threshold. Failures of the check are logged and
never disturb lease renewal.

The same monitor reads ``jobs_rotation.blocked_since`` (``health.sql``: ``ring_blocked``): once
rotations have been refused a slot's lock for the threshold, it logs a WARNING naming the
sessions and prepared transactions that hold a lock on a slot other than the current one and
began before the first refusal or over a second ago. A transaction that read ``jobs`` holds
those locks until it ends, with or without a snapshot: a READ COMMITTED session idle in
transaction holds no xmin, and only this check sees it.

How long a horizon has been held is a lower bound: the server's clock where this role may read
it (``state_change`` of an idle transaction, ``query_start`` of an active one, ``prepared`` of a
prepared transaction), and otherwise how long this monitor has seen the same holder keep the
same xmin.

:class:`CronRunMonitor` reads ``cron.job_run_details`` for this database's and schema's pg_cron
jobs (``pgskip:<database>:<schema>:fire``, ``...:sweep``...) and logs a WARNING for a job whose
last runs all failed: what no longer happens (periodic tasks are not sent, old messages are not
pruned) and what to change (for ``connection failed``: background workers, a ``.pgpass`` or a
``trust`` line, see :func:`kombu_pgskip.cron.connection_remedy`). It checks
:data:`CRON_FIRST_CHECK_S` seconds after the worker starts and then every :data:`CRON_CHECK_S`
seconds, in a short-lived thread of its own so that a
slow connection to pg_cron's database never delays a lease renewal, and repeats the warning for
the same job at most every :data:`CRON_REPEAT_S` seconds. pg_cron shows a role only the runs of
its own jobs: the worker sees them when it connects as the role that ran ``beat-sync`` (or as a
superuser). Where pg_cron is not installed, or this role may not read it, the monitor stops,
saying why at DEBUG level.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import cron
from .sql import queries_in
from .store import Store

logger = logging.getLogger(__name__)

#: At most this many holders are read per check (the oldest ones).
MAX_HOLDERS = 10
#: Longest query text quoted in a warning.
MAX_QUERY_CHARS = 200


@dataclass(frozen=True)
class HorizonHolder:
    """One thing that keeps the xmin horizon of the database back."""

    kind: str  # "session", "prepared transaction" or "replication slot"
    who: str  # pid, gid or slot name
    user: str | None
    application_name: str | None
    state: str | None
    xmin: str
    xmin_age: int  # transactions since its xmin
    held_seconds: float | None  # lower bound from the server's clock; None when not visible
    xact_seconds: float | None  # how long its transaction has been open, when visible
    query: str | None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.who, self.xmin)

    def describe(self, held_for: float) -> str:
        """One line naming the holder, for the warning."""
        if self.kind == "session":
            text = f"backend pid {self.who}"
        elif self.kind == "prepared transaction":
            text = f"prepared transaction {self.who!r}"
        else:
            text = f"replication slot {self.who!r}"
        details = [f"user={self.user}" if self.user else None]
        if self.kind == "session":
            details.append(f"application_name={self.application_name or ''!r}")
        details.append(f"state={self.state or 'unknown (not visible to this role)'}")
        details.append(f"held for at least {held_for:.0f}s")
        if self.xact_seconds is not None and self.kind == "session":
            details.append(f"transaction open {self.xact_seconds:.0f}s")
        details.append(f"xmin {self.xmin} ({self.xmin_age} transactions old)")
        details.append(_last_query(self.query))
        return f"{text} ({', '.join(d for d in details if d)})"


def _last_query(query: str | None) -> str | None:
    """The session's query, shortened, for a warning; None when this role may not see it."""
    if not query or query.startswith("<insufficient privilege>"):
        return None
    text = " ".join(query.split())
    if len(text) > MAX_QUERY_CHARS:
        text = text[: MAX_QUERY_CHARS - 3] + "..."
    return f"last query: {text!r}"


@dataclass(frozen=True)
class SlotHolder:
    """A session or prepared transaction holding the lock of a slot of ``jobs`` that a
    rotation would empty."""

    kind: str  # "session" or "prepared transaction"
    who: str  # pid or gid
    user: str | None
    application_name: str | None
    state: str | None
    xact_seconds: float | None  # how long its transaction has been open, when visible
    query: str | None

    def describe(self) -> str:
        """One line naming the holder."""
        if self.kind == "session":
            text = f"backend pid {self.who}"
            details = [
                f"user={self.user}" if self.user else None,
                f"application_name={self.application_name or ''!r}",
                f"state={self.state or 'unknown (not visible to this role)'}",
            ]
        else:
            text = f"prepared transaction {self.who!r}"
            details = [f"user={self.user}" if self.user else None]
        if self.xact_seconds is not None:
            details.append(f"transaction open {self.xact_seconds:.0f}s")
        details.append(_last_query(self.query))
        return f"{text} ({', '.join(d for d in details if d)})"

    def remedy(self) -> str:
        if self.kind == "prepared transaction":
            return f"COMMIT PREPARED or ROLLBACK PREPARED {self.who!r}"
        if self.application_name == "pg_dump":
            return (
                "let the dump finish; take logical dumps from a standby, or physical backups "
                "(pg_basebackup, WAL archiving), which lock nothing on the primary"
            )
        return _end_transaction(self.who)


@dataclass(frozen=True)
class RingBlock:
    """Rotations of ``jobs``' slots refused a slot's lock: since how long, and who holds one."""

    seconds: float  # since a rotation was first refused a slot's lock, continuously since
    holders: list[SlotHolder]  # oldest transaction first; empty when none is visible now

    def describe(self, schema: str) -> str:
        """What is held, by whom, what it costs and what to do."""
        if self.holders:
            first = self.holders[0]
            more = f"; and {len(self.holders) - 1} more" if len(self.holders) > 1 else ""
            by = f"held by {first.describe()}{more}"
            remedy = first.remedy()
        else:
            by = "held by a session this role cannot name (or one that just ended)"
            remedy = (
                f"look for long transactions holding locks on the slots of {schema}.jobs in "
                "pg_locks as a superuser or a role with pg_read_all_stats"
            )
        return (
            f"rotations of {schema}.jobs' slots have been refused a slot's lock for "
            f"{self.seconds:.0f}s, {by}: no slot is emptied while it lasts, so the table grows "
            f"with every message published. To fix: {remedy}"
        )


def _end_transaction(pid: str) -> str:
    return (
        f"end that transaction (commit, roll back, or SELECT pg_terminate_backend({pid})) and "
        "set idle_in_transaction_session_timeout"
    )


def _remedy(holder: HorizonHolder) -> str:
    if holder.kind == "session":
        return _end_transaction(holder.who)
    if holder.kind == "prepared transaction":
        return f"COMMIT PREPARED or ROLLBACK PREPARED {holder.who!r}"
    return (
        f"reconnect the standby using it, or SELECT pg_drop_replication_slot({holder.who!r}) "
        "if it is gone"
    )


def read_ring_block(store: Store, limit: int = MAX_HOLDERS) -> RingBlock | None:
    """Whether rotations of ``jobs``' slots are refused a slot's lock, and who holds one;
    None while they get their locks."""
    return ring_block(
        store.run(queries_in("health.sql", store.schema)["ring_blocked"], {"limit": limit})
    )


def ring_block(rows: Sequence[Sequence[Any]]) -> RingBlock | None:
    """The rows of ``health.sql``'s ``ring_blocked`` as a :class:`RingBlock`."""
    if not rows or rows[0][0] is None:
        return None
    holders = [
        SlotHolder(
            kind=str(r[1]),
            who=str(r[2]),
            user=r[3],
            application_name=r[4],
            state=r[5],
            xact_seconds=r[6],
            query=r[7],
        )
        for r in rows
        if r[1] is not None
    ]
    return RingBlock(seconds=float(rows[0][0]), holders=holders)


def read_holders(store: Store, limit: int = MAX_HOLDERS) -> list[HorizonHolder]:
    """The oldest holders of the database's xmin horizon, oldest first."""
    query = queries_in("health.sql", store.schema)["xmin_holders"]
    return [
        HorizonHolder(
            kind=str(r[0]),
            who=str(r[1]),
            user=r[2],
            application_name=r[3],
            state=r[4],
            xmin=str(r[5]),
            xmin_age=int(r[6]),
            held_seconds=r[7],
            xact_seconds=r[8],
            query=r[9],
        )
        for r in store.run(query, {"limit": limit})
    ]


class HorizonMonitor:
    """Warns, throttled, when something holds the xmin horizon longer than ``threshold`` s.

    ``threshold`` 0 disables it. Not thread-safe: one monitor per heartbeat thread.
    """

    def __init__(
        self,
        store: Store,
        threshold: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.threshold = threshold
        self.interval = min(threshold / 2.0, 60.0)
        self._clock = clock
        self._next_check = 0.0
        self._first_seen: dict[tuple[str, str, str], float] = {}
        self._last_warned: dict[tuple[str, str, str], float] = {}
        #: When the ring was last warned about, while its slots' locks stay refused.
        self._ring_warned: float | None = None

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def maybe_check(self) -> list[HorizonHolder]:
        """Check if the interval has passed; returns the holders warned about now."""
        if not self.enabled:
            return []
        now = self._clock()
        if now < self._next_check:
            return []
        self._next_check = now + self.interval
        try:
            self.check_ring(now)
        except Exception as exc:
            logger.warning(
                "could not check the rotation of jobs' slots (%s); will try again in %.0fs",
                exc,
                self.interval,
                extra={"action": "ring_check_failed"},
            )
        try:
            return self.check(now)
        except Exception as exc:
            logger.warning(
                "could not check the xmin horizon (%s); will try again in %.0fs",
                exc,
                self.interval,
                extra={"action": "xmin_horizon_check_failed"},
            )
            return []

    def check_ring(self, now: float) -> RingBlock | None:
        """Warn when rotations have been refused a slot's lock for ``threshold`` s or more,
        at most once per threshold; returns the block warned about now."""
        block = read_ring_block(self.store)
        if block is None or block.seconds < self.threshold:
            self._ring_warned = None
            return None
        if self._ring_warned is not None and now - self._ring_warned < self.threshold:
            return None
        self._ring_warned = now
        first = block.holders[0] if block.holders else None
        logger.warning(
            "%s",
            block.describe(self.store.schema),
            extra={
                "action": "ring_blocked",
                "blocked_seconds": round(block.seconds, 1),
                "holder_kind": first.kind if first else None,
                "holder": first.who if first else None,
                "holder_user": first.user if first else None,
            },
        )
        return block

    def check(self, now: float) -> list[HorizonHolder]:
        holders = read_holders(self.store)
        seen = {h.key for h in holders}
        for gone in set(self._first_seen) - seen:
            del self._first_seen[gone]
            self._last_warned.pop(gone, None)
        warned = []
        for holder in holders:
            first = self._first_seen.setdefault(holder.key, now)
            held_for = max(now - first, holder.held_seconds or 0.0)
            if held_for < self.threshold:
                continue
            last = self._last_warned.get(holder.key)
            if last is not None and now - last < self.threshold:
                continue
            self._last_warned[holder.key] = now
            warned.append(holder)
            logger.warning(
                "the xmin horizon of the broker's database is held back by %s: dead rows of "
                "%s.jobs cannot be vacuumed while it lasts, so the table and its indexes "
                "grow and fetches slow down. To fix: %s",
                holder.describe(held_for),
                self.store.schema,
                _remedy(holder),
                extra={"action": "xmin_horizon_held", **_fields(holder, held_for)},
            )
        return warned


def _fields(holder: HorizonHolder, held_for: float) -> dict[str, Any]:
    return {
        "holder_kind": holder.kind,
        "holder": holder.who,
        "holder_user": holder.user,
        "held_seconds": round(held_for, 1),
        "xmin_age": holder.xmin_age,
    }


#: Seconds from the start to the first check of the pg_cron jobs' runs.
CRON_FIRST_CHECK_S = 60.0
#: Seconds between two checks of the pg_cron jobs' runs.
CRON_CHECK_S = 300.0
#: A job whose last this many runs all failed is warned about.
CRON_FAILED_RUNS = 3
#: Seconds before the warning for the same failing job is repeated.
CRON_REPEAT_S = 1800.0

#: What stops happening while a job of ours fails, by the job name's last part.
_CONSEQUENCES = {
    "fire": "periodic tasks are not being sent",
    "sweep": "messages of dead workers return to their queues only while a worker runs",
    "prune": "completed and failed messages are not being pruned",
    "cron-history": "pg_cron's run history (cron.job_run_details) is not being pruned",
}


class CronRunMonitor:
    """Warns, throttled, when the last ``failed_runs`` runs of one of the schema's pg_cron jobs
    all failed. Call :meth:`maybe_check` often; it returns at once."""

    def __init__(
        self,
        url: str,
        schema: str,
        *,
        first_check: float = CRON_FIRST_CHECK_S,
        interval: float = CRON_CHECK_S,
        failed_runs: int = CRON_FAILED_RUNS,
        repeat: float = CRON_REPEAT_S,
        cron_database: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.schema = schema
        self.interval = interval
        self.failed_runs = failed_runs
        self.repeat = repeat
        self.cron_database = cron_database or os.environ.get("PGSKIP_CRON_DATABASE") or None
        self._clock = clock
        self._server: cron.CronServer | None = None
        self._disabled = False
        self._next_check = clock() + first_check
        self._last_warned: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return not self._disabled

    def maybe_check(self) -> None:
        """Start a check in a thread of its own if the interval has passed and none runs."""
        if self._disabled:
            return
        now = self._clock()
        if now < self._next_check or (self._thread is not None and self._thread.is_alive()):
            return
        self._next_check = now + self.interval
        self._thread = threading.Thread(
            target=self._check_quietly, name="pgskip-cron-check", daemon=True
        )
        self._thread.start()

    def _check_quietly(self) -> None:
        try:
            self.check()
        except Exception as exc:
            logger.debug(
                "could not read the runs of the pg_cron jobs (%s); will try again in %.0fs",
                exc,
                self.interval,
                extra={"action": "cron_runs_check_failed"},
            )

    def check(self) -> list[str]:
        """Check now; returns the jobs warned about."""
        if self._disabled:
            return []
        try:
            if self._server is None:
                self._server = cron.locate(self.url, self.cron_database, schedule=False)
            prefix = cron.job_prefix(self._server.app_database, self.schema)
            with cron.cron_session(self.url, self._server) as conn:
                runs = cron.recent_runs(conn, prefix, self.failed_runs)
                settings = cron.read_settings(conn) if any(r.failed for r in runs) else None
        except (cron.PgCronMissing, cron.PgCronPermissionDenied) as exc:
            self._disabled = True
            logger.debug(
                "not checking the runs of the pg_cron jobs: %s",
                exc,
                extra={"action": "cron_runs_check_off"},
            )
            return []
        by_job: dict[str, list[cron.Run]] = {}
        for run in runs:
            by_job.setdefault(run.job, []).append(run)
        now = self._clock()
        warned = []
        for job, job_runs in sorted(by_job.items()):
            if len(job_runs) < self.failed_runs or not all(r.failed for r in job_runs):
                self._last_warned.pop(job, None)
                continue
            last = self._last_warned.get(job)
            if last is not None and now - last < self.repeat:
                continue
            self._last_warned[job] = now
            warned.append(job)
            assert settings is not None
            latest = job_runs[0]
            consequence = _CONSEQUENCES.get(job[len(prefix) :], "it does nothing")
            logger.warning(
                "pg_cron's job %s failed its last %d runs (%s): %s. %s",
                job,
                len(job_runs),
                latest.message or "no message",
                consequence,
                cron.failure_remedy(latest, settings),
                extra={
                    "action": "cron_job_failing",
                    "cron_job": job,
                    "failed_runs": len(job_runs),
                    "cron_message": latest.message,
                },
            )
        return warned


__all__ = ["CronRunMonitor", "HorizonHolder", "HorizonMonitor", "read_holders"]
