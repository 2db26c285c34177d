"""pg_cron: finding it, checking what the current role may do with it, and managing our jobs.

pg_cron runs in one database of the server (``cron.database_name``, usually ``postgres``) and
runs each job in the database the job names. Our jobs are named
``pgskip:<database>:<schema>:<what>``, so several apps (databases, schemas) share one pg_cron
without touching each other's jobs; scheduling a job under an existing name updates it.

Every failure to use pg_cron raises a :class:`PgCronError` whose message says what to do:
:class:`PgCronMissing` names the package, the ``shared_preload_libraries`` line or the
``CREATE EXTENSION`` to run, and the fallback (``pgskip beat-sync --no-cron``, then ``pgskip
tick`` from an outside scheduler); :class:`PgCronPermissionDenied` gives the ``GRANT``
statements that fix it.

Whether pg_cron can actually run our jobs shows only in ``cron.job_run_details``: unless
``cron.use_background_workers`` is on, pg_cron runs a job over a new libpq connection to
``cron.host`` (default ``localhost``) as the job's role, without a password, so a
``pg_hba.conf`` that asks that connection for one makes every run fail with ``connection
failed``. :func:`check_runs` (run by ``beat-sync``) reads the runs of our jobs, waiting for the
first one when none tells yet, and :func:`explain_failure` says what to change.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from . import exceptions
from .sql import queries_in
from .urls import Connection, connect, mask_url, with_dbname

logger = logging.getLogger(__name__)

FALLBACK = (
    "Without pg_cron, store the schedule with `celery -A proj pgskip beat-sync --no-cron`, then "
    "run `celery -A proj pgskip tick` (or `python -m kombu_pgskip tick --url ...`) every minute "
    "from cron, a systemd timer or a Kubernetes CronJob: it fires the same slots exactly once"
)


class PgCronError(exceptions.PgSkipError):
    """pg_cron cannot be used for periodic tasks and maintenance."""


class PgCronMissing(PgCronError):
    """pg_cron is not available on this PostgreSQL server.

    ``context["reason"]`` says it in a few words, without the remedy."""


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


def locate(url: str, cron_database: str | None = None, *, schedule: bool = True) -> CronServer:
    """Find pg_cron for the database of ``url`` and check that the role may schedule jobs.

    pg_cron lives in the database named by ``cron.database_name``, which only superusers (and
    members of ``pg_read_all_stats``, who see pg_cron's launcher) can read; for other roles the
    databases ``postgres`` and the app's own are tried, or pass ``cron_database``.
    Raises :class:`PgCronMissing` or :class:`PgCronPermissionDenied` with the remedy.
    ``schedule=False`` only finds pg_cron (for reading its jobs' runs): a role that may not
    schedule jobs is not refused.
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
            f"`CREATE EXTENSION pg_cron;` in database 'postgres' as a superuser. {FALLBACK}.",
            reason="pg_cron is not installed on this PostgreSQL server",
        )
    if sees_workers and launcher_db is None and cron_database is None:
        raise PgCronMissing(
            f"pg_cron is installed but not loaded on the server of {mask_url(url)}: "
            f"{_preload_hint('postgres')}, then run `CREATE EXTENSION pg_cron;` in database "
            f"'postgres' as a superuser. {FALLBACK}.",
            reason="pg_cron is not loaded on this PostgreSQL server",
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
        if schedule and not allowed:
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
        f"{FALLBACK}.",
        reason=f"the pg_cron extension is not in database {looked}",
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


# -- whether pg_cron can run our jobs -----------------------------------------------------------

SUCCEEDED = "succeeded"
FAILED = "failed"
#: A successful run at most this old shows that pg_cron can run the jobs.
RECENT = timedelta(minutes=5)
#: How long a check waits, once a run has finished, for the other runs of the same minute.
SAME_TICK_S = 10.0
#: ``return_message`` of a run that could not open its connection.
CONNECTION_FAILURES = ("connection failed", "job startup timeout")


@dataclass(frozen=True)
class CronSettings:
    """How pg_cron runs jobs; ``None`` where this role may not read it (the ``cron.*``
    settings are readable by superusers and members of ``pg_read_all_settings`` only)."""

    host: str | None
    port: str | None
    background_workers: bool | None
    log_run: bool | None


def read_settings(conn: Connection) -> CronSettings:
    rows = {str(r[0]): str(r[1]) for r in conn.execute(_q()["cron_settings"]).fetchall()}

    def flag(name: str) -> bool | None:
        return None if name not in rows else rows[name] == "on"

    return CronSettings(
        host=rows.get("cron.host"),
        port=rows.get("port"),
        background_workers=flag("cron.use_background_workers"),
        log_run=flag("cron.log_run"),
    )


@dataclass(frozen=True)
class Run:
    """One run of one of our jobs, from ``cron.job_run_details``."""

    job: str
    run_id: int
    status: str
    message: str
    database: str
    user: str
    ended_at: datetime | None  # None while it runs, and when it never connected
    age: float | None  # seconds since it ended

    @property
    def finished(self) -> bool:
        return self.status in (SUCCEEDED, FAILED)

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def _runs(rows: list[tuple[Any, ...]]) -> list[Run]:
    return [
        Run(
            job=str(r[0]),
            run_id=int(r[1]),
            status=str(r[2]),
            message=str(r[3] or ""),
            database=str(r[4]),
            user=str(r[5]),
            ended_at=r[6],
            age=None if r[7] is None else float(r[7]),
        )
        for r in rows
    ]


def run_mark(conn: Connection, prefix: str) -> int:
    """The newest run id of the jobs under ``prefix`` (0 when none): later runs have higher ids."""
    row = conn.execute(_q()["cron_run_mark"], {"prefix": prefix}).fetchone()
    return int(row[0]) if row else 0


def runs_after(conn: Connection, prefix: str, mark: int) -> list[Run]:
    """The runs (finished or not) of the jobs under ``prefix`` newer than ``mark``, newest
    first."""
    return _runs(conn.execute(_q()["cron_runs_after"], {"prefix": prefix, "mark": mark}).fetchall())


def recent_runs(conn: Connection, prefix: str, per_job: int = 1) -> list[Run]:
    """The latest ``per_job`` finished runs of each job under ``prefix``, newest first."""
    return _runs(
        conn.execute(_q()["cron_recent_runs"], {"prefix": prefix, "per_job": per_job}).fetchall()
    )


def _hba_name(name: str) -> str:
    keywords = {"all", "sameuser", "samerole", "samegroup", "replication"}
    if re.fullmatch(r"[a-z0-9_]+", name) and name not in keywords:
        return name
    return '"' + name.replace('"', '""') + '"'


def _pgpass_field(value: str) -> str:
    return value.replace("\\", "\\\\").replace(":", "\\:")


def connection_remedy(database: str, user: str, settings: CronSettings) -> str:
    """Why pg_cron could not connect to run a job as ``user`` in ``database``, and the three
    ways to fix it."""
    host = settings.host or "localhost"
    port = settings.port or "5432"
    db, role = _hba_name(database), _hba_name(user)
    if host.startswith("/"):
        hba = [f"local  {db}  {role}  trust"]
    elif host in ("localhost", "127.0.0.1", "::1"):
        hba = [f"host  {db}  {role}  127.0.0.1/32  trust", f"host  {db}  {role}  ::1/128  trust"]
    else:
        hba = [f"host  {db}  {role}  <address of {host}>/32  trust"]
    pgpass = ":".join(_pgpass_field(v) for v in (host, port, database, user)) + ":PASSWORD"
    host_note = "" if settings.host is not None else " (cron.host, by default localhost)"
    return (
        f"pg_cron runs each job over a new connection to {host}{host_note} port {port}, "
        f"database {database!r}, as role {user!r}, without a password, unless "
        "cron.use_background_workers is on; the server refused that connection (pg_hba.conf "
        "asks it for a password, or rejects it). Do one of these, then run `celery -A proj "
        "pgskip beat-sync` again:\n"
        "  - run jobs in background workers, which need no connection: in postgresql.conf set\n"
        "        cron.use_background_workers = on\n"
        "    and keep max_worker_processes above cron.max_running_jobs (default 5), then "
        "restart PostgreSQL;\n"
        "  - give pg_cron the password: add the line\n"
        f"        {pgpass}\n"
        "    to the .pgpass file (mode 0600) in the home directory of the OS user that runs "
        "PostgreSQL (usually postgres; libpq reads it at each connection);\n"
        "  - trust that connection: in pg_hba.conf, above the lines that ask for a password, "
        "add\n" + "".join(f"        {line}\n" for line in hba) + "    then run SELECT "
        "pg_reload_conf();"
    )


def failure_remedy(run: Run, settings: CronSettings) -> str:
    """What a failed run's message means and what to change."""
    if run.message in CONNECTION_FAILURES:
        return connection_remedy(run.database, run.user, settings)
    if run.message.startswith("could not start background process"):
        return (
            "pg_cron runs jobs in background workers (cron.use_background_workers = on) and "
            "could not start one: raise max_worker_processes in postgresql.conf above "
            "cron.max_running_jobs and restart PostgreSQL; the server log says more."
        )
    return (
        "The job connected and its command failed; the server log and cron.job_run_details "
        f"(runid {run.run_id}) say more."
    )


def explain_failure(run: Run, settings: CronSettings) -> str:
    """The failed run, what it means and what to change."""
    what = f"pg_cron's run of job {run.job} failed: {run.message or 'no message'}"
    return f"{what}. {failure_remedy(run, settings)}"


def failure_advice(url: str, server: CronServer, prefix: str) -> str | None:
    """What to change when the latest run of a job under ``prefix`` failed, else None."""
    with cron_session(url, server) as conn:
        failed = [r for r in recent_runs(conn, prefix) if r.failed]
        return explain_failure(failed[0], read_settings(conn)) if failed else None


@dataclass(frozen=True)
class RunCheck:
    """What the runs of our jobs say: ``ok`` is True when a run succeeded, False when a run
    failed or none came in time, None when nothing tells yet (or there is nothing to check)."""

    ok: bool | None
    message: str


def _verdict(runs: list[Run], settings: CronSettings) -> RunCheck:
    """Judge by each job's newest run (``runs`` are newest first): any failure fails."""
    newest: dict[str, Run] = {}
    for run in runs:
        newest.setdefault(run.job, run)
    failed = [r for r in newest.values() if r.failed]
    if failed:
        return RunCheck(False, explain_failure(failed[0], settings))
    return RunCheck(True, f"pg_cron can run these jobs: its run of {runs[0].job} succeeded")


def check_runs(
    url: str,
    server: CronServer,
    prefix: str,
    *,
    mark: int,
    wait: float,
    announce: Callable[[str], None] | None = None,
    poll: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RunCheck:
    """Whether pg_cron can run the jobs under ``prefix``, from their runs.

    A run newer than ``mark`` (:func:`run_mark`, read before the jobs were installed) decides;
    else the newest run, if it succeeded within :data:`RECENT`. Otherwise it waits up to
    ``wait`` seconds for the next run (pg_cron runs a minutely job on the minute), saying so
    through ``announce``; with ``wait`` 0 the newest run decides if it failed, else nothing
    does. A failure's message says what to change (:func:`explain_failure`).
    """
    with cron_session(url, server) as conn:
        if not any(j.active for j in list_jobs(conn, prefix)):
            return RunCheck(None, "")
        settings = read_settings(conn)
        if settings.log_run is False:
            return RunCheck(
                None,
                "pg_cron keeps no record of its runs (cron.log_run = off), so whether it can "
                "run these jobs was not checked",
            )
        latest = recent_runs(conn, prefix)
        newest = latest[0] if latest else None
        failed = newest if newest is not None and newest.failed else None
        fresh = [r for r in runs_after(conn, prefix, mark) if r.finished]
        if (
            not fresh
            and newest is not None
            and not newest.failed
            and newest.age is not None
            and newest.age <= RECENT.total_seconds()
        ):
            return _verdict([newest], settings)
        if not fresh and wait <= 0:
            if failed is not None:
                return RunCheck(False, explain_failure(failed, settings))
            when = "yet" if not latest else f"in the last {RECENT.total_seconds() / 60:.0f} minutes"
            return RunCheck(
                None,
                f"pg_cron has not run these jobs {when}, so whether it can was not checked: "
                "`celery -A proj pgskip beat-list` shows their last runs",
            )
        if not fresh and announce is not None:
            announce(
                "checking that pg_cron can run these jobs: waiting for its next run of them "
                f"(on the minute; at most {wait:.0f} s, --wait 0 skips this)"
            )
        deadline = clock() + wait
        settled = None
        while True:
            runs = runs_after(conn, prefix, mark)
            done = [r for r in runs if r.finished]
            if done:
                settled = clock() + SAME_TICK_S if settled is None else settled
                if len(done) == len(runs) or clock() >= settled:
                    return _verdict(done, settings)
            elif clock() >= deadline:
                break
            sleep(poll)
    if failed is not None:
        return RunCheck(False, explain_failure(failed, settings))
    return RunCheck(
        False,
        f"pg_cron did not run these jobs within {wait:.0f} s. Is its launcher running (SELECT "
        "pid FROM pg_stat_activity WHERE backend_type = 'pg_cron launcher')? Are all "
        "cron.max_running_jobs busy? Is cron.log_run off (then pg_cron keeps no record of its "
        "runs: pass --wait 0)? The server log says more.",
    )


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
