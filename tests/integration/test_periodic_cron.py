"""pg_cron problems come with the fix: missing or not loaded (what to install, the preload line,
the fallback and the `beat-sync --no-cron` step it needs), a role without privileges (the
GRANTs, which then work), and jobs pg_cron cannot run: beat-sync judges by their runs and says
what to change, and workers warn while the runs keep failing. Without pg_cron, `beat-sync
--dry-run` still prints the plan and `cron-remove` has nothing to remove.

A real pg_cron run that cannot connect (pg_hba.conf asks for a password) is in
tests/acceptance/test_cron_tick.py, where it shares the minute tick it waits for."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from urllib.parse import urlsplit

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from kombu_pgskip import cron
from kombu_pgskip.__main__ import main
from kombu_pgskip.health import CronRunMonitor
from kombu_pgskip.migrate import migrate
from kombu_pgskip.periodic import beat_sync
from kombu_pgskip.testing.embedded import EmbeddedPostgres
from tests.helpers import make_url
from tests.periodic_support import celery, local_binaries, make_app


@pytest.fixture
def limited_role(db_url: str, pg_cron_database: str) -> Iterator[tuple[str, str]]:
    """(role name, broker URL as that role): may use the app's schema, nothing of pg_cron."""
    role = f"app_{uuid.uuid4().hex[:8]}"
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT ALL ON SCHEMA pgskip TO {}").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT ALL ON ALL TABLES IN SCHEMA pgskip TO {}").format(sql.Identifier(role))
        )
        # beat-sync is the owner's: it computes the first slots with the schema's functions.
        conn.execute(
            sql.SQL("GRANT EXECUTE ON ALL ROUTINES IN SCHEMA pgskip TO {}").format(
                sql.Identifier(role)
            )
        )
    url = db_url.replace("postgres@", f"{role}@", 1)
    try:
        yield role, url
    finally:
        cron_url = make_url(db_url, pg_cron_database)
        with psycopg.connect(cron_url, autocommit=True) as conn:
            conn.execute("SELECT cron.unschedule(jobid) FROM cron.job WHERE username = %s", (role,))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
        del dbname


def test_role_without_privileges_gets_the_grants_that_fix_it(
    db_url: str, pg_cron_database: str, limited_role: tuple[str, str]
) -> None:
    role, url = limited_role
    with pytest.raises(cron.PgCronPermissionDenied) as info:
        cron.locate(url)
    message = str(info.value)
    assert f"GRANT USAGE ON SCHEMA cron TO {role};" in message
    grant_fn = (
        "GRANT EXECUTE ON FUNCTION cron.schedule_in_database(text,text,text,text,text,boolean) "
        f"TO {role};"
    )
    assert grant_fn in message
    # Nothing was stored: pg_cron is checked before the transaction.
    with pytest.raises(cron.PgCronPermissionDenied):
        beat_sync(make_app({"e": {"task": "x.y", "schedule": 60}}), url, "pgskip")
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM pgskip.beat_entries").fetchone() == (0,)

    # Run exactly the statements the message gives, as a superuser of pg_cron's database.
    with psycopg.connect(make_url(db_url, pg_cron_database), autocommit=True) as conn:
        for line in message.splitlines():
            if line.strip().startswith("GRANT"):
                conn.execute(line.strip().encode())
    result = beat_sync(make_app({"e": {"task": "x.y", "schedule": 60}}), url, "pgskip")
    assert [c.sign for c in result.changes] == ["+"] and result.cron_changes
    with psycopg.connect(make_url(db_url, pg_cron_database)) as conn:
        owner = conn.execute(
            "SELECT username FROM cron.job WHERE jobname = %s",
            (f"pgskip:{db_url.rsplit('/', 1)[1]}:pgskip:fire",),
        ).fetchone()
    assert owner == (role,)


@pytest.fixture(scope="module")
def server_without_pg_cron() -> Iterator[str]:
    local_binaries()
    with EmbeddedPostgres(fsync=False, pg_cron=False) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
        url = pg.dsn("app")
        migrate(url)
        yield url


def test_missing_pg_cron_names_the_preload_line_and_the_fallback(
    server_without_pg_cron: str,
) -> None:
    with pytest.raises(cron.PgCronMissing) as info:
        beat_sync(
            make_app({"e": {"task": "x.y", "schedule": 60}}), server_without_pg_cron, "pgskip"
        )
    message = str(info.value)
    assert "shared_preload_libraries = 'pg_cron'" in message
    assert "cron.database_name = 'postgres'" in message
    assert "CREATE EXTENSION pg_cron" in message
    assert "pgskip tick" in message  # the fallback, and the step it needs first:
    assert "`celery -A proj pgskip beat-sync --no-cron`" in message
    with psycopg.connect(server_without_pg_cron) as conn:
        assert conn.execute("SELECT count(*) FROM pgskip.beat_entries").fetchone() == (0,)
    # The fallback works: store without pg_cron, fire from outside.
    result = beat_sync(
        make_app({"e": {"task": "x.y", "schedule": 60}}), server_without_pg_cron, "pgskip",
        use_cron=False,
    )  # fmt: skip
    assert [c.sign for c in result.changes] == ["+"]
    with psycopg.connect(server_without_pg_cron, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pgskip.fire_due(%s)", (datetime.now(timezone.utc).replace(year=2100),)
        ).fetchone()
    # One run stands for the slots missed until 2100 (the newest is within the grace), and the
    # next comes a minute later, within the lookahead.
    assert row == (2,)


def _entries(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT name FROM pgskip.beat_entries ORDER BY name")]


def test_dry_run_prints_the_plan_without_pg_cron(server_without_pg_cron: str) -> None:
    before = _entries(server_without_pg_cron)
    proc = celery(["beat-sync", "--dry-run"], server_without_pg_cron, "default")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "+ nightly-billing: billing.run crontab(0 0 * * *) [Europe/Berlin]" in proc.stdout
    assert "pg_cron cannot be used; without --dry-run, beat-sync would stop here" in proc.stdout
    assert "shared_preload_libraries = 'pg_cron'" in proc.stdout
    assert proc.stdout.rstrip().endswith("dry run: nothing was changed")
    assert _entries(server_without_pg_cron) == before
    # Without --dry-run it stops, and names the way without pg_cron.
    real = celery(["beat-sync"], server_without_pg_cron, "default")
    assert real.returncode == 1 and "beat-sync --no-cron" in real.stderr
    assert _entries(server_without_pg_cron) == before


def test_cron_remove_without_pg_cron_has_nothing_to_remove(server_without_pg_cron: str) -> None:
    for args in (["cron-remove"], ["maintenance", "--remove"]):
        result = CliRunner().invoke(main, [*args, "--url", server_without_pg_cron])
        assert result.exit_code == 0, result.output
        assert result.output.startswith("nothing to remove: pg_cron is not "), result.output
    installing = CliRunner().invoke(main, ["maintenance", "--url", server_without_pg_cron])
    assert installing.exit_code == 1 and "shared_preload_libraries" in installing.output


def test_tick_help_shows_only_the_options_tick_uses() -> None:
    result = CliRunner().invoke(main, ["tick", "--help"])
    assert result.exit_code == 0, result.output
    for used in ("--max-attempts", "--completed-retention", "--failed-retention",
                 "--prune-batch", "--url", "--schema"):  # fmt: skip
        assert used in result.output
    for unused in ("--sweep-schedule", "--prune-schedule", "--cron-history-schedule",
                   "--cron-history-retention", "--cron-database"):  # fmt: skip
        assert unused not in result.output
    assert "beat-sync --no-cron" in " ".join(result.output.split())


# -- whether pg_cron can run the jobs ------------------------------------------------------------


@pytest.fixture
def fake_job(db_url: str, pg_cron_database: str) -> Iterator[tuple[str, str]]:
    """(job name, URL of pg_cron's database): this database's and schema's firing job, scheduled
    for midnight on January 1st only; the tests write its runs themselves."""
    name = f"pgskip:{db_url.rsplit('/', 1)[1]}:pgskip:fire"
    cron_url = make_url(db_url, pg_cron_database)
    with psycopg.connect(cron_url, autocommit=True) as conn:
        conn.execute(
            "SELECT cron.schedule_in_database(%s, '0 0 1 1 *', 'SELECT 1', %s)",
            (name, db_url.rsplit("/", 1)[1]),
        )
    try:
        yield name, cron_url
    finally:
        with psycopg.connect(cron_url, autocommit=True) as conn:
            conn.execute(
                "DELETE FROM cron.job_run_details"
                " WHERE jobid IN (SELECT jobid FROM cron.job WHERE jobname = %s)",
                (name,),
            )
            conn.execute("SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname = %s", (name,))


def _add_run(cron_url: str, job: str, status: str, message: str) -> None:
    """A finished run of ``job``, as pg_cron records it: a run that could not connect has no
    start and end time."""
    connected = message not in cron.CONNECTION_FAILURES
    with psycopg.connect(cron_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO cron.job_run_details (jobid, runid, database, username, command, status,"
            " return_message, start_time, end_time)"
            " SELECT jobid, nextval('cron.runid_seq'), database, username, command, %s, %s,"
            " CASE WHEN %s THEN now() END, CASE WHEN %s THEN now() END"
            " FROM cron.job WHERE jobname = %s",
            (status, message, connected, connected, job),
        )


def _mark(url: str, server: cron.CronServer, prefix: str) -> int:
    with cron.cron_session(url, server) as conn:
        return cron.run_mark(conn, prefix)


class FakeTime:
    """A clock and a sleep for :func:`cron.check_runs`; ``on_sleep`` runs at each sleep."""

    def __init__(self, on_sleep: Callable[[], None] | None = None) -> None:
        self.now = 0.0
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep()


def test_check_runs_judges_by_the_jobs_runs_and_names_the_fix(
    db_url: str, fake_job: tuple[str, str]
) -> None:
    job, cron_url = fake_job
    dbname, port = db_url.rsplit("/", 1)[1], urlsplit(db_url).port
    server = cron.locate(db_url)
    prefix = cron.job_prefix(dbname, "pgskip")

    def check(
        wait: float = 0, announce: Callable[[str], None] | None = None, time: FakeTime | None = None
    ) -> cron.RunCheck:
        time = time or FakeTime()
        return cron.check_runs(
            db_url, server, prefix, mark=mark, wait=wait, announce=announce,
            clock=time.clock, sleep=time.sleep,
        )  # fmt: skip

    # No run yet: nothing to judge by; waiting for one that never comes fails.
    mark = _mark(db_url, server, prefix)
    assert check().ok is None and "has not run these jobs yet" in check().message
    announced: list[str] = []
    idle = FakeTime()
    late = check(5, announce=announced.append, time=idle)
    assert late.ok is False and "did not run these jobs within 5 s" in late.message
    assert announced and "at most 5 s" in announced[0] and "--wait 0" in announced[0]

    # A run since the mark that could not connect: the three ways out, for this job.
    _add_run(cron_url, job, "failed", "connection failed")
    failed = check()
    assert failed.ok is False
    text = failed.message
    assert f"pg_cron's run of job {job} failed: connection failed" in text
    assert f"new connection to localhost port {port}, database {dbname!r}" in text
    assert "cron.use_background_workers = on" in text
    assert f"localhost:{port}:{dbname}:postgres:PASSWORD" in text
    assert f"host  {dbname}  postgres  127.0.0.1/32  trust" in text
    assert "SELECT pg_reload_conf();" in text

    # The newest run decides: a success after the failure.
    _add_run(cron_url, job, "succeeded", "1 row")
    assert check().ok is True

    # After a new sync (mark), a recent success is enough, without waiting.
    mark = _mark(db_url, server, prefix)
    assert check(90).ok is True

    # A failure since: waiting, the next run decides.
    _add_run(cron_url, job, "failed", "connection failed")
    mark = _mark(db_url, server, prefix)
    assert check().ok is False  # --wait 0: the latest run failed
    then = FakeTime(on_sleep=lambda: _add_run(cron_url, job, "succeeded", "1 row"))
    assert check(30, time=then).ok is True

    # A command that fails is not a connection problem.
    mark = _mark(db_url, server, prefix)
    _add_run(cron_url, job, "failed", 'ERROR:  schema "pgskip" does not exist')
    broken = check()
    assert broken.ok is False and "The job connected and its command failed" in broken.message
    assert "pg_hba.conf" not in broken.message


def test_workers_warn_while_the_last_runs_of_a_job_fail(
    db_url: str, fake_job: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    job, cron_url = fake_job
    clock = FakeTime()
    monitor = CronRunMonitor(db_url, "pgskip", failed_runs=3, repeat=600, clock=clock.clock)
    caplog.set_level(logging.WARNING, logger="kombu_pgskip.health")
    _add_run(cron_url, job, "succeeded", "1 row")
    for _ in range(2):
        _add_run(cron_url, job, "failed", "connection failed")
    assert monitor.check() == []  # two failures after a success: not yet
    _add_run(cron_url, job, "failed", "connection failed")
    assert monitor.check() == [job]
    (record,) = [r for r in caplog.records if r.name == "kombu_pgskip.health"]
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert f"pg_cron's job {job} failed its last 3 runs (connection failed): periodic tasks" in text
    assert "cron.use_background_workers = on" in text and "pg_hba.conf" in text
    assert record.__dict__["action"] == "cron_job_failing"
    assert monitor.check() == []  # said once per `repeat`
    clock.now += 601
    assert monitor.check() == [job]
    _add_run(cron_url, job, "succeeded", "1 row")
    assert monitor.check() == []
    # From the heartbeat thread: maybe_check runs the check in a thread of its own.
    for _ in range(3):
        _add_run(cron_url, job, "failed", "connection failed")
    caplog.clear()
    monitor.maybe_check()
    assert monitor._thread is not None
    monitor._thread.join(timeout=30)
    (again,) = [r for r in caplog.records if r.name == "kombu_pgskip.health"]
    assert again.getMessage().startswith(f"pg_cron's job {job} failed its last 3 runs")


def test_workers_stop_checking_where_they_cannot_read_pg_cron(
    server_without_pg_cron: str, limited_role: tuple[str, str]
) -> None:
    for url in (server_without_pg_cron, limited_role[1]):
        monitor = CronRunMonitor(url, "pgskip", failed_runs=1)
        assert monitor.check() == [] and not monitor.enabled
