"""pg_cron: finding it, checking what the current role may do with it, and managing our jobs.

pg_cron runs in one database of the server (``cron.database_name``, usually ``postgres``) and
runs each job in the database the job names. Our jobs are named
``pgskip:<database>:<schema>:<what>``, so several apps (databases, schemas) share one pg_cron
without touching each other's jobs; scheduling a job under an existing name updates it.

Every failure to use pg_cron raises a :class:`PgCronError` whose message says what to do:
:class:`PgCronMissing` names the package, the ``shared_preload_libraries`` line or the
``CREATE EXTENSION`` to run, and the fallback (``pgskip tick`` from an outside scheduler);
:class:`PgCronPermissionDenied` gives the ``GRANT`` statements that fix it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from . import exceptions
from .sql import queries_in
from .urls import Connection, connect, mask_url, with_dbname

logger = logging.getLogger(__name__)

FALLBACK = (
    "Without pg_cron, run `celery -A proj pgskip tick` (or `python -m kombu_pgskip tick --url "
    "...`) every minute from cron, a systemd timer or a Kubernetes CronJob: it fires the same "
    "slots exactly once"
)


class PgCronError(exceptions.PgSkipError):
    """pg_cron cannot be used for periodic tasks and maintenance."""


class PgCronMissing(PgCronError):
    """pg_cron is not available on this PostgreSQL server."""


class PgCronPermissionDenied(PgCronError, exceptions.PermissionDenied):
    """The database role may not schedule pg_cron jobs."""


@dataclass(frozen=True)
class CronServer:
    """Where pg_cron lives, as seen from the app's database."""

    app_database: str
    cron_database: str
    user: str
    version: str

    @property
    def version_tuple(self) -> tuple[int, ...]:
        parts = []
        for p in self.version.replace("-", ".").split("."):
            if not p.isdigit():
                break
            parts.append(int(p))
        return tuple(parts)

    @property
    def supports_seconds(self) -> bool:
        """pg_cron 1.5 added schedules such as ``'10 seconds'``."""
        return self.version_tuple >= (1, 5)

    @property
    def same_database(self) -> bool:
        return self.app_database == self.cron_database


def job_prefix(database: str, schema: str) -> str:
    return f"pgskip:{database}:{schema}:"


def _q(schema: str = "pgskip") -> dict[str, Any]:
    return queries_in("periodic.sql", schema)


def _install_hint(server_major: int) -> str:
    return (
        f"install it (Debian/Ubuntu: apt-get install postgresql-{server_major}-cron; RHEL: "
        f"dnf install pg_cron_{server_major}; managed services: enable the pg_cron extension "
        "in the instance's parameters)"
    )


def _preload_hint(cron_db: str) -> str:
    return (
        "add to postgresql.conf (or the managed service's parameters)\n"
        "    shared_preload_libraries = 'pg_cron'    # keep any libraries already listed\n"
        f"    cron.database_name = '{cron_db}'\n"
        "and restart PostgreSQL"
    )


def _grant_hint(server: CronServer | None, user: str, cron_db: str, app_db: str) -> str:
    lines = [
        f"connect to database {cron_db!r} as a superuser and run:",
        f"    GRANT USAGE ON SCHEMA cron TO {user};",
    ]
    if server is None or not server.same_database:
        lines.append(
            "    GRANT EXECUTE ON FUNCTION "
            f"cron.schedule_in_database(text,text,text,text,text,boolean) TO {user};"
        )
    lines.append(
        f"(and {user} needs CONNECT on database {app_db!r}, which it has if it can run the broker)"
    )
    return "\n".join(lines)


def locate(url: str, cron_database: str | None = None) -> CronServer:
    """Find pg_cron for the database of ``url`` and check that the role may schedule jobs.

    pg_cron lives in the database named by ``cron.database_name``, which only superusers (and
    members of ``pg_read_all_stats``, who see pg_cron's launcher) can read; for other roles the
    databases ``postgres`` and the app's own are tried, or pass ``cron_database``.
    Raises :class:`PgCronMissing` or :class:`PgCronPermissionDenied` with the remedy.
    """
    q = _q()
    with connect(url) as conn:
        row = conn.execute(q["cron_probe"]).fetchone()
    assert row is not None
    app_db, user, launcher_db, available, version_num, sees_workers = row
    app_db, user = str(app_db), str(user)
    major = int(version_num) // 10000
    if not available:
        raise PgCronMissing(
            f"pg_cron is not installed on the PostgreSQL server of {mask_url(url)}: "
            f"{_install_hint(major)}; then {_preload_hint('postgres')}; then run "
            f"`CREATE EXTENSION pg_cron;` in database 'postgres' as a superuser. {FALLBACK}."
        )
    if sees_workers and launcher_db is None and cron_database is None:
        raise PgCronMissing(
            f"pg_cron is installed but not loaded on the server of {mask_url(url)}: "
            f"{_preload_hint('postgres')}, then run `CREATE EXTENSION pg_cron;` in database "
            f"'postgres' as a superuser. {FALLBACK}."
        )
    if cron_database:
        candidates = [cron_database]
    elif launcher_db is not None:
        candidates = [str(launcher_db)]
    else:
        candidates = list(dict.fromkeys(["postgres", app_db]))
    refused: list[str] = []
    for candidate in candidates:
        try:
            with _cron_connection(url, candidate) as cron_conn:
                ext = cron_conn.execute(q["cron_extension"]).fetchone()
                if ext is None:
                    continue
                server = CronServer(
                    app_database=app_db, cron_database=candidate, user=user, version=str(ext[0])
                )
                usage = bool((cron_conn.execute(q["cron_usage"]).fetchone() or (False,))[0])
                can_schedule, can_schedule_elsewhere = (
                    cron_conn.execute(q["cron_privileges"]).fetchone() or (False, False)
                    if usage
                    else (False, False)
                )
        except exceptions.ConnectionFailed as exc:
            refused.append(f"{candidate!r} ({exc})")
            continue
        allowed = usage and (can_schedule if server.same_database else can_schedule_elsewhere)
        if not allowed:
            raise PgCronPermissionDenied(
                f"role {user} may not schedule pg_cron jobs"
                f"{'' if server.same_database else f' in database {app_db!r}'}. To fix, "
                f"{_grant_hint(server, user, candidate, app_db)}"
            )
        return server
    looked = ", ".join(repr(c) for c in candidates)
    if refused:
        raise PgCronPermissionDenied(
            f"cannot connect as {user} to the database where pg_cron may live: "
            f"{'; '.join(refused)}. To fix, connect as a superuser and run\n"
            + "\n".join(f'    GRANT CONNECT ON DATABASE "{c}" TO {user};' for c in candidates)
            + f"\n{_grant_hint(None, user, candidates[0], app_db)}"
        )
    raise PgCronMissing(
        f"the pg_cron extension was not found in database {looked}: pg_cron runs in the "
        "database named by cron.database_name; connect to it as a superuser and run "
        "`CREATE EXTENSION pg_cron;` (if it is already there under another name, pass "
        f"--cron-database NAME). If pg_cron is not loaded yet, {_preload_hint('postgres')}. "
        f"{FALLBACK}."
    )


@contextmanager
def _cron_connection(url: str, cron_db: str) -> Iterator[Connection]:
    conninfo = with_dbname(url, cron_db)
    try:
        conn = psycopg.connect(
            conninfo, autocommit=True, connect_timeout=10, application_name="kombu-pgskip"
        )
    except psycopg.OperationalError as exc:
        raise exceptions.ConnectionFailed(
            f"cannot connect to database {cron_db!r} on the server of {mask_url(url)}: {exc}"
        ) from None
    with conn:
        yield conn


@contextmanager
def cron_session(url: str, server: CronServer) -> Iterator[Connection]:
    """A connection to pg_cron's database; permission errors carry the GRANT that fixes them."""
    with _cron_connection(url, server.cron_database) as conn:
        try:
            yield conn
        except pg_errors.InsufficientPrivilege as exc:
            raise PgCronPermissionDenied(
                f"pg_cron refused: {exc}. To fix, "
                f"{_grant_hint(server, server.user, server.cron_database, server.app_database)}"
            ) from exc


@dataclass(frozen=True)
class Job:
    name: str
    schedule: str
    command: str
    database: str


@dataclass(frozen=True)
class InstalledJob:
    jobid: int
    name: str
    schedule: str
    command: str
    database: str
    active: bool


def list_jobs(conn: Connection, prefix: str) -> list[InstalledJob]:
    rows = conn.execute(_q()["cron_jobs"], {"prefix": prefix}).fetchall()
    return [
        InstalledJob(int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), bool(r[5]))
        for r in rows
    ]


def ensure_jobs(
    conn: Connection, server: CronServer, wanted: list[Job], *, manage_prefixes: list[str]
) -> list[str]:
    """Make the jobs under ``manage_prefixes`` exactly ``wanted``; return what changed.

    Idempotent: jobs already scheduled with the same schedule and command are left alone.
    """
    q = _q()
    changes: list[str] = []
    existing = {j.name: j for p in manage_prefixes for j in list_jobs(conn, p)}
    for job in wanted:
        have = existing.pop(job.name, None)
        if have and (have.schedule, have.command, have.database) == (
            job.schedule,
            job.command,
            job.database,
        ):
            continue
        if have and have.database != job.database:
            # pg_cron's upsert keeps the database: replace the job.
            conn.execute(q["cron_unschedule"], {"jobid": have.jobid})
        params = {
            "name": job.name,
            "schedule": job.schedule,
            "command": job.command,
            "database": job.database,
        }
        if job.database == server.cron_database:
            conn.execute(q["cron_schedule"], params)
        else:
            conn.execute(q["cron_schedule_in_database"], params)
        verb = "updated" if have else "installed"
        changes.append(f"pg_cron job {job.name} {verb}: {job.schedule!r} runs {job.command}")
        logger.info("pg_cron job %s %s", job.name, verb, extra={"action": "cron_job_" + verb})
    for stale in existing.values():
        conn.execute(q["cron_unschedule"], {"jobid": stale.jobid})
        changes.append(f"pg_cron job {stale.name} removed")
        logger.info("pg_cron job %s removed", stale.name, extra={"action": "cron_job_removed"})
    return changes


def last_runs(conn: Connection, prefix: str) -> dict[str, tuple[str, Any, str]]:
    """jobname -> (status, start time, message) of its latest run."""
    rows = conn.execute(_q()["cron_last_runs"], {"prefix": prefix}).fetchall()
    return {str(r[0]): (str(r[1]), r[2], str(r[3] or "")) for r in rows}


def tick_schedule(server: CronServer, shortest_period: float | None) -> tuple[str, int]:
    """The firing job's pg_cron schedule and its period in seconds.

    Every minute, which pg_cron 1.4 and older allow at most; sub-minute slots are inserted ahead
    of time (``scheduled`` with their exact ``run_at``). From pg_cron 1.5 on, an entry shorter
    than a minute makes the job run every ``N seconds`` (1 <= N <= 30) so rows are inserted
    closer to their time.
    """
    if server.supports_seconds and shortest_period is not None and shortest_period < 60:
        n = max(1, min(30, int(shortest_period)))
        return f"{n} seconds", n
    return "* * * * *", 60
