"""``pgskip doctor``'s operational checks against the real server: each passes on a freshly
migrated database and each goes WARN or FAIL, saying what to do, when provoked (a schema
version row removed or added, a reset storage parameter, an invalid index, a held snapshot, a
transaction holding the slots of jobs, failed pg_cron runs); ``--json`` and the exit status.

pg_cron's runs are rows inserted into ``cron.job_run_details`` for a job scheduled once a year:
no test waits for pg_cron's minute tick."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from kombu_pgskip.__main__ import main
from kombu_pgskip.doctor import FAIL, OK, WARN, Check, Doctor, run_doctor
from kombu_pgskip.migrate import latest_version
from kombu_pgskip.store import Store
from kombu_pgskip.urls import connect
from tests.helpers import finished_slot_behind, make_url
from tests.safety_support import as_role

OPERATIONS = (
    "schema version",
    "autovacuum settings of jobs",
    "indexes valid",
    "xmin horizon",
    "jobs ring",
)
CRON = "pg_cron runs the schema's jobs"


def _checks(db_url: str, **options: Any) -> dict[str, Check]:
    options.setdefault("cron", False)
    return {c.name: c for c in run_doctor(db_url, "pgskip", **options)}


def _run(db_url: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["doctor", "--url", db_url, *args])
    return result.exit_code, result.stdout, result.stderr


def _sql(db_url: str, *statements: str | sql.Composable) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def test_a_freshly_migrated_schema_passes_every_check(db_url: str) -> None:
    checks = _checks(db_url)
    assert set(OPERATIONS) <= set(checks)
    assert {n: c.line() for n, c in checks.items() if c.status != OK} == {}
    assert checks["schema version"].detail.startswith(f"{latest_version():04d}, as this")
    assert "autovacuum_vacuum_scale_factor=0.02" in checks["autovacuum settings of jobs"].detail
    code, out, err = _run(db_url, "--no-cron", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["schema"], report["failed"], report["warnings"]) == ("pgskip", 0, 0)
    assert [c["name"] for c in report["checks"]][: len(OPERATIONS) + 1] == [
        "schema",
        *OPERATIONS,
    ]
    assert {c["status"] for c in report["checks"]} == {"ok"}


def test_the_schema_version_says_migrate_when_behind_and_upgrade_when_newer(db_url: str) -> None:
    latest = latest_version()
    newer = latest + 1
    cases = [
        (
            ["DELETE FROM pgskip.migrations WHERE version = (SELECT max(version) FROM"
             " pgskip.migrations) RETURNING version"],
            FAIL,
            [f"is at version {latest - 1}", f"needs {latest}", "celery -A proj pgskip migrate"],
        ),
        (
            [f"INSERT INTO pgskip.migrations (version, name, checksum, compatible_with)"
             f" VALUES ({newer}, 'from_a_newer_release', 'x', {newer})"],
            FAIL,
            [f"newer than this kombu-pgskip knows ({latest})",
             "upgrade the kombu-pgskip package"],
        ),
        (
            [f"INSERT INTO pgskip.migrations (version, name, checksum, compatible_with)"
             f" VALUES ({newer}, 'from_a_newer_release', 'x', {latest})"],
            WARN,
            [f"{newer:04d}, newer than this kombu-pgskip's {latest:04d}",
             "upgrade the kombu-pgskip package"],
        ),
        (
            ["DELETE FROM pgskip.migrations WHERE version = 5"],
            FAIL,
            ["0005_routing_epoch not recorded", "would run them again"],
        ),
    ]  # fmt: skip
    with psycopg.connect(db_url, autocommit=True) as conn:
        saved = conn.execute("SELECT * FROM pgskip.migrations").fetchall()
    for provoke, status, phrases in cases:
        _sql(db_url, *provoke)
        check = _checks(db_url)["schema version"]
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("DELETE FROM pgskip.migrations")
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO pgskip.migrations VALUES (%s, %s, %s, %s, %s)", saved)
        assert check.status == status, (provoke, check.line())
        for phrase in phrases:
            assert phrase in check.detail, (phrase, check.line())
    assert _checks(db_url)["schema version"].status == OK


def test_the_storage_parameters_of_jobs_fail_when_reset_and_the_fix_restores_them(
    db_url: str,
) -> None:
    name = "autovacuum settings of jobs"
    # (the partition vacuum looks after: the slots are emptied whole)
    _sql(db_url, "ALTER TABLE pgskip.jobs_kept RESET (autovacuum_vacuum_scale_factor, fillfactor)")
    reset = _checks(db_url)[name]
    assert reset.status == FAIL, reset.line()
    assert "fillfactor, autovacuum_vacuum_scale_factor no longer set" in reset.detail
    fix = reset.detail.split("`")[1]
    assert fix == (
        'ALTER TABLE "pgskip".jobs_kept'
        " SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);"
    )
    _sql(db_url, fix)
    assert _checks(db_url)[name].status == OK

    _sql(db_url, "ALTER TABLE pgskip.jobs_kept SET (autovacuum_vacuum_scale_factor = 0.1)")
    changed = _checks(db_url)[name]
    assert changed.status == WARN, changed.line()
    assert "autovacuum_vacuum_scale_factor=0.1 (the migrations set 0.02)" in changed.detail

    _sql(db_url, "ALTER TABLE pgskip.jobs_kept SET (autovacuum_enabled = off)")
    off = _checks(db_url)[name]
    assert off.status == FAIL, off.line()
    assert "RESET (autovacuum_enabled)" in off.detail and "autovacuum is off" in off.detail


def test_an_invalid_index_fails_naming_it_and_its_rebuild(db_url: str) -> None:
    name = "indexes valid"
    _sql(
        db_url,
        "INSERT INTO pgskip.jobs (queue, payload) VALUES ('mail', '{}'), ('mail', '{}')",
    )
    # A unique build over duplicates fails and leaves its index behind, INVALID.
    with pytest.raises(psycopg.errors.UniqueViolation):
        # (on the current slot, which holds the rows: a partitioned table has no concurrent
        # builds)
        _sql(db_url, "CREATE UNIQUE INDEX CONCURRENTLY jobs_one_per_queue ON pgskip.jobs_1 (queue)")
    failed_build = _checks(db_url)[name]
    assert failed_build.status == FAIL, failed_build.line()
    assert failed_build.detail.startswith("pgskip.jobs_one_per_queue on pgskip.jobs_1 INVALID")
    assert "`REINDEX INDEX CONCURRENTLY pgskip.jobs_one_per_queue;`" in failed_build.detail
    assert "remove the duplicate rows first" in failed_build.detail
    _sql(db_url, "DROP INDEX CONCURRENTLY pgskip.jobs_one_per_queue")

    # As a superuser, in this database of the test's own: one of the migrations' indexes.
    _sql(
        db_url,
        "UPDATE pg_index SET indisvalid = false"
        " WHERE indexrelid = 'pgskip.jobs_dequeue_1'::regclass",
    )
    marked = _checks(db_url)[name]
    assert marked.status == FAIL and "pgskip.jobs_dequeue_1 on pgskip.jobs_1" in marked.detail
    _sql(db_url, marked.detail.split("`")[1])  # the REINDEX it names
    assert _checks(db_url)[name].status == OK


@contextmanager
def _held_snapshot(db_url: str, application: str) -> Iterator[int]:
    """A session idle in a REPEATABLE READ transaction that has read ``jobs``: its pid."""
    with psycopg.connect(db_url, application_name=application) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM pgskip.jobs")
        yield conn.info.backend_pid
        conn.rollback()


def test_a_held_snapshot_warns_past_the_threshold_naming_its_session(db_url: str) -> None:
    name = "xmin horizon"
    assert _checks(db_url)[name].detail == (
        "no session, prepared transaction or replication slot holds it back"
    )
    with _held_snapshot(db_url, "nightly-report") as pid:
        under = _checks(db_url)[name]
        over = _checks(db_url, xmin_threshold=0)[name]
        code, out, _err = _run(db_url, "--no-cron", "--xmin-threshold", "0")
    assert under.status == OK, under.line()
    assert f"the oldest: backend pid {pid} (application_name='nightly-report')" in under.detail
    assert over.status == WARN, over.line()
    for phrase in (
        f"held back by backend pid {pid}",
        "application_name='nightly-report'",
        "state=idle in transaction",
        f"SELECT pg_terminate_backend({pid})",
        "idle_in_transaction_session_timeout",
    ):
        assert phrase in over.detail, phrase
    # A warning leaves the exit status 0.
    assert code == 0 and f"WARN  xmin horizon: held back by backend pid {pid}" in out


def test_a_transaction_holding_the_slots_warns_past_the_threshold_naming_it(db_url: str) -> None:
    """READ COMMITTED, idle in transaction after reading jobs: no snapshot is held, so the xmin
    check has nothing to say, but the lock it holds on every slot stops the ring emptying any."""
    name = "jobs ring"
    assert (
        _checks(db_url)[name].line()
        == "ok    jobs ring: rotations get the locks of the slots they empty"
    )
    store = Store(db_url)
    try:
        finished_slot_behind(store, db_url)
        with psycopg.connect(db_url, application_name="django-shell") as shell:
            shell.execute("SELECT count(*) FROM pgskip.jobs")
            pid = shell.info.backend_pid
            assert store.rotate() == (0, 0, 2)  # slot 1's lock refused
            under = _checks(db_url)[name]
            over = _checks(db_url, xmin_threshold=0)
            code, out, _err = _run(db_url, "--no-cron", "--xmin-threshold", "0")
        assert store.rotate() == (1, 0, 2)
        after = _checks(db_url, xmin_threshold=0)[name]
    finally:
        store.close()
    assert over["xmin horizon"].status == OK, over["xmin horizon"].line()
    assert under.status == OK and "(under 300s): the ring waits for it" in under.detail
    ring = over[name]
    assert ring.status == WARN, ring.line()
    for phrase in (
        "rotations of \"pgskip\".jobs' slots have been refused a slot's lock for 0s",
        f"held by backend pid {pid}",
        "application_name='django-shell'",
        "state=idle in transaction",
        "last query: 'SELECT count(*) FROM pgskip.jobs'",
        f"SELECT pg_terminate_backend({pid})",
    ):
        assert phrase in ring.detail, phrase
    assert code == 0 and "WARN  jobs ring: rotations of" in out
    assert after.status == OK, after.line()


@pytest.fixture
def cron_job(db_url: str, pg_server_dsn: str, pg_cron_database: str) -> Iterator[tuple[str, int]]:
    """A pg_cron job of this database's schema, scheduled once a year so that pg_cron never
    runs it during the test: (superuser URL of pg_cron's database, its jobid)."""
    dbname = db_url.rsplit("/", 1)[1]
    cron_url = make_url(pg_server_dsn, pg_cron_database)
    with psycopg.connect(cron_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT cron.schedule_in_database(%s, '0 0 1 1 *', 'SELECT 1', %s)",
            (f"pgskip:{dbname}:pgskip:sweep", dbname),
        ).fetchone()
        assert row is not None
        jobid = int(row[0])
        try:
            yield cron_url, jobid
        finally:
            conn.execute("DELETE FROM cron.job_run_details WHERE jobid = %s", (jobid,))
            conn.execute("SELECT cron.unschedule(%s::bigint)", (jobid,))


def _cron_run(cron_url: str, jobid: int, status: str, message: str, ago: str = "0") -> None:
    with psycopg.connect(cron_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO cron.job_run_details (jobid, database, username, command, status,"
            " return_message, start_time, end_time)"
            " SELECT j.jobid, j.database, j.username, j.command,"
            "        %s, %s, now() - %s::interval, now() - %s::interval"
            " FROM cron.job AS j WHERE j.jobid = %s",
            (status, message, f"{ago} seconds", f"{ago} seconds", jobid),
        )


def test_pg_cron_without_jobs_warns_and_elsewhere_says_it_is_missing(
    db_url: str, pg_cron_database: str
) -> None:
    check = _checks(db_url, cron=True)[CRON]
    assert check.status == WARN, check.line()
    assert f"in database {pg_cron_database!r} has no job named pgskip:" in check.detail
    assert "pgskip beat-sync` installs them" in check.detail
    # Looked for in a database without the extension (--cron-database).
    dbname = db_url.rsplit("/", 1)[1]
    missing = _checks(db_url, cron=True, cron_database=dbname)[CRON]
    assert missing.status == WARN, missing.line()
    assert f"the pg_cron extension is not in database '{dbname}'" in missing.detail
    assert "pgskip tick` runs every minute" in missing.detail


def test_pg_cron_fails_on_a_failed_run_saying_what_to_change(
    db_url: str, cron_job: tuple[str, int]
) -> None:
    cron_url, jobid = cron_job
    dbname = db_url.rsplit("/", 1)[1]
    pending = _checks(db_url, cron=True)[CRON]
    assert pending.status == OK, pending.line()
    assert f"not run yet: pgskip:{dbname}:pgskip:sweep" in pending.detail

    _cron_run(cron_url, jobid, "succeeded", "1 row", ago="120")
    _cron_run(cron_url, jobid, "failed", "connection failed")
    failed = _checks(db_url, cron=True)[CRON]
    assert failed.status == FAIL, failed.line()
    assert failed.detail.endswith(
        f"the latest run of pgskip:{dbname}:pgskip:sweep failed: connection failed"
    )
    assert failed.advice is not None
    for phrase in ("cron.use_background_workers = on", ".pgpass", "pg_hba.conf", dbname):
        assert phrase in failed.advice, phrase
    code, out, err = _run(db_url)
    assert code == 1, out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("FAIL  " + CRON + ": "))
    assert lines[at + 1].startswith("      pg_cron runs each job over a new connection")
    assert "1 of " in err and "checks failed" in err

    _cron_run(cron_url, jobid, "succeeded", "1 row")
    assert _checks(db_url, cron=True)[CRON].status == OK


def test_pg_cron_warns_about_an_inactive_job_and_a_minutely_one_that_stopped(
    db_url: str, cron_job: tuple[str, int]
) -> None:
    cron_url, jobid = cron_job
    _sql(cron_url, f"SELECT cron.alter_job({jobid}, active := false)")
    inactive = _checks(db_url, cron=True)[CRON]
    assert inactive.status == WARN, inactive.line()
    assert f"SELECT cron.alter_job({jobid}, active := true);" in inactive.detail
    # Every minute, its last run ten minutes ago. pg_cron runs it on the next minute: stay
    # clear of that.
    if time.gmtime().tm_sec >= 55:
        time.sleep(61 - time.gmtime().tm_sec)
    _sql(cron_url, f"SELECT cron.alter_job({jobid}, schedule := '* * * * *', active := true)")
    _cron_run(cron_url, jobid, "succeeded", "1 row", ago="600")
    stale = _checks(db_url, cron=True)[CRON]
    _sql(cron_url, f"SELECT cron.alter_job({jobid}, schedule := '0 0 1 1 *')")
    assert stale.status == WARN, stale.line()
    assert "has not run pgskip:" in stale.detail and "in the last 5 minutes" in stale.detail


@contextmanager
def _login_role(server_dsn: str, *databases: str) -> Iterator[tuple[str, str]]:
    """A LOGIN role with a password: (name, password); dropped afterwards, with what it was
    granted in ``databases``."""
    name, password = f"doctor_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    ident = sql.Identifier(name)
    _sql(
        server_dsn, sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(ident, sql.Literal(password))
    )
    try:
        yield name, password
    finally:
        for dbname in databases:
            _sql(make_url(server_dsn, dbname), sql.SQL("DROP OWNED BY {}").format(ident))
        _sql(server_dsn, sql.SQL("DROP ROLE {}").format(ident))


def test_pg_cron_a_role_may_not_read_says_what_to_grant(
    db_url: str, pg_server_dsn: str, pg_cron_database: str
) -> None:
    dbname = db_url.rsplit("/", 1)[1]
    with _login_role(pg_server_dsn, dbname, pg_cron_database) as (role, password):
        url = as_role(db_url, role, password)
        with connect(url) as conn:
            denied = Doctor(conn, "pgskip", url=url).pg_cron()
        assert denied.status == WARN, denied.line()
        grant = f"GRANT USAGE ON SCHEMA cron TO {role};"
        assert f"`{grant}` in database {pg_cron_database!r}" in denied.detail
        _sql(make_url(pg_server_dsn, pg_cron_database), grant)
        with connect(url) as conn:
            granted = Doctor(conn, "pgskip", url=url).pg_cron()
        assert granted.status == WARN and "has no job named" in granted.detail, granted.line()
