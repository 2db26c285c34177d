"""The maintenance that keeps the queue healthy, run by pg_cron, and the dead-letter operations.

Jobs (installed by ``celery -A proj pgskip maintenance`` and by ``beat-sync``; each is one
pg_cron job calling one SQL function of the schema):

``sweep`` (every minute)
    ``<schema>.sweep(max_attempts)``: rows held by dead consumers (whose lease ran out, or
    whose process's session lock an earlier sweep found released, see
    :mod:`~kombu_pgskip.leases`) go back to ``pending`` (or to ``failed`` after
    ``max_attempts`` deliveries), those consumers are forgotten, due ``scheduled`` rows are
    promoted. Live workers do the same; this job covers the time when none runs. Also
    ``<schema>.expire_queues()`` where the schema has it.
``prune`` (hourly)
    ``CALL <schema>.prune_in_batches(completed, failed, batch)``: deletes ``completed`` rows
    finished more than ``completed_retention`` ago (default 1 day), ``prune_batch`` (10,000)
    per transaction so that no long transaction holds vacuum back, then the claims of unique
    keys no message holds any more (as many per transaction), then ``failed`` rows older than
    ``failed_retention`` (default 14 days; ``None`` keeps them) and old fired-slot records.
    (``<schema>.prune()``, one transaction, on a schema from before migration 0007.)
``cron-history`` (daily, in pg_cron's database)
    deletes this schema's jobs' rows of ``cron.job_run_details`` older than
    ``cron_history_retention`` (default 7 days): pg_cron logs every run, 1,440 a day per
    minutely job. There is no function of ours in pg_cron's database to call, so this job's
    command is a fixed ``DELETE`` whose values are quoted literals.

Configure with ``app.conf.pgskip_maintenance = {"completed_retention": 3600, ...}`` (seconds or
``timedelta``; schedules are cron expressions) or the command's options.

Failed messages (the dead-letter state): :func:`list_failed`, :func:`retry_failed` (back to
``pending`` with a fresh attempt count; workers are woken) and :func:`purge_failed`, each
filtered by queue, task name (``*`` wildcards), age and a limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql

from . import cron, exceptions
from .sql import queries_in
from .store import notify_channel
from .urls import Connection, connect, mask_url

logger = logging.getLogger(__name__)


PRUNE_BATCH = 10_000  # completed rows deleted per transaction by prune_in_batches()
_INTEGERS = ("max_attempts", "prune_batch")


@dataclass(frozen=True)
class MaintenanceConfig:
    """What the maintenance jobs do and when. ``None`` retention: keep forever (no job)."""

    sweep_schedule: str = "* * * * *"
    max_attempts: int = 20
    prune_schedule: str = "17 * * * *"
    completed_retention: timedelta | None = timedelta(days=1)
    failed_retention: timedelta | None = timedelta(days=14)
    prune_batch: int = PRUNE_BATCH
    cron_history_schedule: str = "27 3 * * *"
    cron_history_retention: timedelta | None = timedelta(days=7)

    @classmethod
    def from_app(cls, app: Any, **overrides: Any) -> MaintenanceConfig:
        """``app.conf.pgskip_maintenance`` (a dict), ``max_attempts`` from the transport
        options, then ``overrides`` (values that are None are ignored)."""
        values: dict[str, Any] = {}
        transport = app.conf.broker_transport_options or {}
        if "max_attempts" in transport:
            values["max_attempts"] = transport["max_attempts"]
        values.update(app.conf.get("pgskip_maintenance") or {})
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.build(values)

    @classmethod
    def build(cls, values: dict[str, Any]) -> MaintenanceConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise exceptions.ConfigurationError(
                f"unknown pgskip_maintenance settings {sorted(unknown)}; known: {sorted(known)}"
            )
        converted: dict[str, Any] = {}
        for name, value in values.items():
            if name.endswith("_retention"):
                converted[name] = parse_duration(value, name)
            elif name in _INTEGERS:
                if isinstance(value, bool):
                    raise exceptions.ConfigurationError(f"{name} must be an integer")
                try:
                    converted[name] = int(value)
                except (TypeError, ValueError):
                    raise exceptions.ConfigurationError(f"{name} must be an integer") from None
            else:
                converted[name] = str(value)
        config = cls(**converted)
        for name in _INTEGERS:
            if getattr(config, name) < 1:
                raise exceptions.ConfigurationError(f"{name} must be >= 1")
        return config


def parse_duration(value: Any, what: str = "duration") -> timedelta | None:
    """Seconds, a timedelta, or text such as ``30s``, ``15m``, ``2h``, ``7d``; ``None``/``"never"``
    mean no limit."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("never", "none")):
        return None
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = timedelta(seconds=value)
    elif isinstance(value, str):
        text = value.strip().lower()
        units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
        try:
            if text and text[-1] in units:
                result = timedelta(seconds=float(text[:-1]) * units[text[-1]])
            else:
                result = timedelta(seconds=float(text))
        except ValueError:
            raise exceptions.ConfigurationError(
                f"{what}={value!r}: expected seconds or a number with s, m, h, d or w"
            ) from None
    else:
        raise exceptions.ConfigurationError(f"{what}={value!r}: expected a duration")
    if result < timedelta(0):
        raise exceptions.ConfigurationError(f"{what} must not be negative")
    return result


def _has_routine(conn: Connection, schema: str, signature: str) -> bool:
    row = conn.execute(
        queries_in("periodic.sql", schema)["has_routine"],
        {"signature": sql.SQL("{}.").format(sql.Identifier(schema)).as_string(conn) + signature},
    ).fetchone()
    return bool(row and row[0])


def _has_batches(conn: Connection, schema: str) -> bool:
    """Whether the schema has prune_in_batches() (migration 0007)."""
    return _has_routine(
        conn, schema, "prune_in_batches(interval, interval, integer, bigint, bigint, bigint)"
    )


def _interval_literal(delta: timedelta) -> str:
    text = f"{delta.total_seconds():.6f}".rstrip("0").rstrip(".")
    return f"{text} seconds"


def maintenance_jobs(
    server: cron.CronServer,
    schema: str,
    config: MaintenanceConfig,
    conn: Connection,
    app_conn: Connection,
) -> list[cron.Job]:
    """The pg_cron jobs for ``config`` (commands call our functions with quoted literals)."""
    ident = sql.Identifier(schema)
    prefix = cron.job_prefix(server.app_database, schema)
    jobs: list[cron.Job] = []
    sweep = sql.SQL("SELECT {}.sweep({})").format(ident, sql.Literal(config.max_attempts))
    if _has_routine(app_conn, schema, "expire_queues()"):
        sweep = sql.SQL("{}; SELECT {}.expire_queues()").format(sweep, ident)
    if _has_routine(app_conn, schema, "rotate()"):
        sweep = sql.SQL("{}; SELECT {}.rotate()").format(sweep, ident)
    jobs.append(
        cron.Job(
            prefix + "sweep", config.sweep_schedule, sweep.as_string(conn), server.app_database
        )
    )
    if config.completed_retention is not None or config.failed_retention is not None:
        retention = [
            sql.Literal(None if kept is None else _interval_literal(kept))
            for kept in (config.completed_retention, config.failed_retention)
        ]
        if _has_batches(app_conn, schema):
            # A lone CALL: pg_cron runs it outside a transaction block, so it can commit.
            prune = sql.SQL("CALL {}.prune_in_batches({}::interval, {}::interval, {})").format(
                ident, *retention, sql.Literal(config.prune_batch)
            )
        else:
            if config.prune_batch != PRUNE_BATCH:
                logger.warning(
                    "prune_batch is ignored: schema %r has no prune_in_batches() (migration "
                    "0007) and prunes in one transaction; run `celery -A proj pgskip migrate`",
                    schema,
                    extra={"action": "prune_batch_ignored", "schema": schema},
                )
            prune = sql.SQL("SELECT {}.prune({}::interval, {}::interval)").format(ident, *retention)
        jobs.append(
            cron.Job(
                prefix + "prune", config.prune_schedule, prune.as_string(conn), server.app_database
            )
        )
    if config.cron_history_retention is not None:
        history = sql.SQL(
            "DELETE FROM cron.job_run_details WHERE end_time < now() - {}::interval"
            " AND jobid IN (SELECT jobid FROM cron.job WHERE starts_with(jobname, {}))"
        ).format(sql.Literal(_interval_literal(config.cron_history_retention)), sql.Literal(prefix))
        jobs.append(
            cron.Job(
                prefix + "cron-history",
                config.cron_history_schedule,
                history.as_string(conn),
                server.cron_database,
            )
        )
    return jobs


MAINTENANCE_JOBS = ("sweep", "prune", "cron-history")


def install(
    url: str,
    schema: str,
    config: MaintenanceConfig,
    *,
    server: cron.CronServer | None = None,
    remove: bool = False,
    cron_database: str | None = None,
) -> list[str]:
    """Install, update (or with ``remove``, delete) the maintenance jobs; returns the changes."""
    server = server or cron.locate(url, cron_database)
    prefix = cron.job_prefix(server.app_database, schema)
    with connect(url) as app_conn, cron.cron_session(url, server) as conn:
        wanted = [] if remove else maintenance_jobs(server, schema, config, conn, app_conn)
        if not remove and _has_routine(app_conn, schema, "rotate()"):
            app_conn.execute(
                queries_in("maintenance.sql", schema)["set_rotation_retention"],
                {"completed_after": config.completed_retention},
            )
        return cron.ensure_jobs(
            conn, server, wanted, manage_prefixes=[prefix + name for name in MAINTENANCE_JOBS]
        )


def remove_all_jobs(url: str, schema: str, cron_database: str | None = None) -> list[str]:
    """Unschedule every pg_cron job of this database and schema (firing and maintenance)."""
    server = cron.locate(url, cron_database)
    with cron.cron_session(url, server) as conn:
        return cron.ensure_jobs(
            conn, server, [], manage_prefixes=[cron.job_prefix(server.app_database, schema)]
        )


def run_once(url: str, schema: str, config: MaintenanceConfig) -> dict[str, int]:
    """Sweep, rotate ``jobs``' slots and prune once, now (``pgskip tick``): what the pg_cron
    jobs do."""
    q = queries_in("periodic.sql", schema)
    with connect(url) as conn:
        sweep = conn.execute(q["sweep"], {"max_attempts": config.max_attempts}).fetchone()
        rotated = (0, 0)
        if _has_routine(conn, schema, "rotate()"):
            row = conn.execute(queries_in("maintenance.sql", schema)["rotate"]).fetchone()
            rotated = (int(row[0]), int(row[1])) if row else rotated
        prune = conn.execute(
            q["prune_in_batches" if _has_batches(conn, schema) else "prune"],
            {
                "completed_after": config.completed_retention,
                "failed_after": config.failed_retention,
                "batch": config.prune_batch,
            },
        ).fetchone()
    assert sweep is not None and prune is not None
    return {
        "requeued": int(sweep[0]),
        "failed": int(sweep[1]),
        "consumers_forgotten": int(sweep[2]),
        "promoted": int(sweep[3]),
        "pruned_completed": int(prune[0]),
        "pruned_failed": int(prune[1]),
        "pruned_slots": int(prune[2]),
        "slots_emptied": rotated[0],
        "moved_to_jobs_kept": rotated[1],
    }


# -- failed messages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FailedFilter:
    """Which failed messages an operation applies to; ``None`` means any."""

    queue: str | None = None
    task: str | None = None  # task name; ``*`` matches any characters
    older_than: timedelta | None = None
    limit: int | None = None

    def params(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "task": None if self.task is None else _like(self.task),
            "older_than": self.older_than,
            "limit": self.limit,
        }


def _like(pattern: str) -> str:
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%")


@dataclass(frozen=True)
class FailedMessage:
    id: int
    queue: str
    task_name: str | None
    task_id: str | None
    attempts: int
    failed_at: datetime | None
    error: str | None


def _run(url: str, schema: str, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with exceptions.translating(url_for_messages=mask_url(url)), connect(url) as conn:
        return conn.execute(queries_in("periodic.sql", schema)[name], params).fetchall()


def list_failed(url: str, schema: str, filt: FailedFilter) -> list[FailedMessage]:
    rows = _run(url, schema, "failed_list", filt.params())
    return [FailedMessage(int(r[0]), str(r[1]), r[2], r[3], int(r[4]), r[5], r[6]) for r in rows]


def retry_failed(url: str, schema: str, filt: FailedFilter) -> int:
    """Return matching failed messages to ``pending`` (attempts reset); returns how many."""
    rows = _run(url, schema, "failed_retry", {**filt.params(), "channel": notify_channel(schema)})
    count = int(rows[0][0])
    if count:
        logger.info(
            "%d failed %s returned to pending",
            count,
            "message" if count == 1 else "messages",
            extra={"action": "retry_failed"},
        )
    return count


def purge_failed(url: str, schema: str, filt: FailedFilter) -> int:
    """Delete matching failed messages; returns the exact number deleted."""
    count = int(_run(url, schema, "failed_purge", filt.params())[0][0])
    if count:
        logger.info(
            "%d failed %s deleted",
            count,
            "message" if count == 1 else "messages",
            extra={"action": "purge_failed"},
        )
    return count
