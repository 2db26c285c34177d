"""The maintenance jobs do their work, are installed like the firing job, and the failed-message
commands list, retry and purge with filters."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from kombu_pgskip import cron
from kombu_pgskip.__main__ import main
from kombu_pgskip.maintenance import (
    MaintenanceConfig,
    install,
    maintenance_jobs,
    remove_all_jobs,
)
from tests.helpers import make_url


def _job(
    conn: psycopg.Connection[Any],
    status: str,
    *,
    queue: str = "q",
    task: str = "app.task",
    finished_ago: timedelta | None = None,
    run_in: timedelta = timedelta(0),
    locked_by: uuid.UUID | None = None,
    attempts: int = 0,
    error: str | None = None,
) -> int:
    row = conn.execute(
        "INSERT INTO pgskip.jobs (queue, status, run_at, payload, task_name, task_id, attempts,"
        " locked_by, locked_at, finished_at, last_error)"
        " VALUES (%s, %s::pgskip.job_status, now() + %s, '{}', %s, %s, %s, %s,"
        " CASE WHEN %s::uuid IS NOT NULL THEN now() END, now() - %s::interval, %s) RETURNING id",
        (queue, status, run_in, task, str(uuid.uuid4()), attempts, locked_by, locked_by,
         finished_ago, error),
    ).fetchone()  # fmt: skip
    assert row is not None
    return int(row[0])


def _statuses(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return {r[0]: r[1] for r in conn.execute("SELECT id, status::text FROM pgskip.jobs")}


def test_sweep_returns_dead_consumers_rows_and_promotes_due_ones(db_url: str) -> None:
    dead, alive = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.consumers (id, hostname, pid, lease_until) VALUES"
            " (%s, 'gone', 1, now() - interval '1 minute'),"
            " (%s, 'here', 2, now() + interval '1 minute')",
            (dead, alive),
        )
        lost = _job(conn, "running", locked_by=dead, attempts=1)
        exhausted = _job(conn, "running", locked_by=dead, attempts=20)
        held = _job(conn, "running", locked_by=alive, attempts=1)
        due = _job(conn, "scheduled", run_in=timedelta(seconds=-1))
        later = _job(conn, "scheduled", run_in=timedelta(hours=1))
        conn.execute(  # published an hour before its ETA
            "UPDATE pgskip.jobs SET created_at = run_at - interval '1 hour' WHERE id = %s", (due,)
        )
        row = conn.execute("SELECT * FROM pgskip.sweep(20)").fetchone()
        assert row == (1, 1, 1, 1)  # requeued, failed, consumers forgotten, promoted
        assert _statuses(conn) == {
            lost: "pending", exhausted: "failed", held: "running", due: "pending",
            later: "scheduled",
        }  # fmt: skip
        assert conn.execute(
            "SELECT redelivered FROM pgskip.jobs WHERE id = %s", (lost,)
        ).fetchone() == (True,)
        # Promoted to its place in the queue: its publish, not its ETA (migration 0020).
        assert conn.execute(
            "SELECT run_at = created_at FROM pgskip.jobs WHERE id = %s", (due,)
        ).fetchone() == (True,)


def test_prune_keeps_each_status_for_its_retention(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        old_done = _job(conn, "completed", finished_ago=timedelta(days=2))
        new_done = _job(conn, "completed", finished_ago=timedelta(hours=1))
        old_failed = _job(conn, "failed", finished_ago=timedelta(days=20))
        new_failed = _job(conn, "failed", finished_ago=timedelta(days=1))
        pending = _job(conn, "pending")
        row = conn.execute("SELECT * FROM pgskip.prune('1 day', NULL)").fetchone()
        assert row == (1, 0, 0)
        row = conn.execute("SELECT * FROM pgskip.prune('1 day', '14 days')").fetchone()
        assert row == (0, 1, 0)
        assert set(_statuses(conn)) == {new_done, new_failed, pending}
        assert old_done not in _statuses(conn) and old_failed not in _statuses(conn)


def test_prune_reads_only_the_rows_it_deletes(db_url: str) -> None:
    """prune() finds old completed rows through the jobs_completed index instead of reading
    the whole table (a day of completed messages with the default retention)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
            " SELECT 'q', 'completed', '{}', now() - i * interval '1 second'"
            " FROM generate_series(1, 20000) AS i"
        )
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, payload)"
            " SELECT 'q', '{}' FROM generate_series(1, 5000)"
        )
        conn.execute("ANALYZE pgskip.jobs")
        with conn.transaction():
            row = conn.execute("SELECT * FROM pgskip.prune('19000 seconds', NULL)").fetchone()
            scans = conn.execute(
                "SELECT pg_stat_get_xact_numscans('pgskip.jobs_completed_1'::regclass),"
                " pg_stat_get_xact_numscans('pgskip.jobs_1'::regclass)"
            ).fetchone()
        assert row is not None and 1000 <= row[0] <= 1010, row  # 1,000 and the clock's tick
        # (the rows are in the current slot, jobs_1)
        assert scans == (1, 0), "one scan of jobs_completed_1, no sequential scan of jobs_1"
        left = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FROM pgskip.jobs"
        ).fetchone()
        assert left == (20000 - row[0], 25000 - row[0])


def test_prune_in_batches_commits_after_each_batch(db_url: str) -> None:
    """The prune job's procedure deletes completed rows ``batch`` at a time, each batch in a
    transaction of its own (no long transaction holding vacuum back), then failed rows; it
    refuses to run inside a transaction block, where it could not commit."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
            " SELECT 'q', 'completed', '{}', now() - i * interval '1 minute'"
            " FROM generate_series(1, 1000) AS i"
        )
        old_failed = _job(conn, "failed", finished_ago=timedelta(days=20))
        kept = _job(conn, "completed", finished_ago=timedelta(minutes=30))

        def xid() -> int:
            row = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
            assert row is not None
            return int(row[0])

        before = xid()
        row = conn.execute("CALL pgskip.prune_in_batches('100 minutes', '14 days', 100)").fetchone()
        transactions = xid() - before - 1
        assert row is not None and 900 <= row[0] <= 905 and row[1:] == (1, 0), row
        assert transactions >= 10, "nine full batches and the last, each committed"
        statuses = _statuses(conn)
        assert old_failed not in statuses and kept in statuses
        assert conn.execute(
            "SELECT count(*) FROM pgskip.jobs WHERE finished_at < now() - interval '101 minutes'"
        ).fetchone() == (0,)
        with pytest.raises(psycopg.errors.InvalidTransactionTermination), conn.transaction():
            conn.execute("CALL pgskip.prune_in_batches('1 minute', NULL, 10)")
        with pytest.raises(psycopg.errors.RaiseException, match="batch must be a positive"):
            conn.execute("CALL pgskip.prune_in_batches('1 minute', NULL, 0)")


def test_maintenance_jobs_are_installed_idempotently_and_their_commands_work(
    db_url: str, pg_cron_database: str
) -> None:
    dbname = db_url.rsplit("/", 1)[1]
    prefix = f"pgskip:{dbname}:pgskip:"
    config = MaintenanceConfig(
        completed_retention=timedelta(hours=1), failed_retention=None, prune_batch=250
    )
    cron_url = make_url(db_url, pg_cron_database)
    try:
        changes = install(db_url, "pgskip", config)
        assert [c.split(" ")[2] for c in changes] == [
            prefix + "sweep", prefix + "prune", prefix + "cron-history",
        ]  # fmt: skip
        assert install(db_url, "pgskip", config) == []
        with psycopg.connect(cron_url, autocommit=True) as conn:
            installed = {
                r[0]: (r[1], r[2])
                for r in conn.execute(
                    "SELECT jobname, command, database FROM cron.job"
                    " WHERE starts_with(jobname, %s)",
                    (prefix,),
                )
            }
            other = conn.execute(
                "SELECT cron.schedule(%s, '0 0 1 1 *', 'SELECT 1')", (f"other-{dbname}",)
            ).fetchone()
            assert other is not None
            mine = conn.execute(
                "SELECT jobid FROM cron.job WHERE jobname = %s", (prefix + "sweep",)
            ).fetchone()
            assert mine is not None
            for jobid in (mine[0], other[0]):
                conn.execute(
                    "INSERT INTO cron.job_run_details (jobid, runid, command, status, start_time,"
                    " end_time) VALUES (%s, nextval('cron.runid_seq'), 'x', 'succeeded',"
                    " now() - interval '30 days', now() - interval '30 days')",
                    (jobid,),
                )
            command, database = installed[prefix + "cron-history"]
            assert database == pg_cron_database
            conn.execute(command.encode())
            left = {
                r[0]
                for r in conn.execute(
                    "SELECT jobid FROM cron.job_run_details"
                    " WHERE end_time < now() - '29 days'::interval"
                )
            }
            assert mine[0] not in left and other[0] in left
            conn.execute("DELETE FROM cron.job_run_details WHERE jobid = %s", (other[0],))
            conn.execute("SELECT cron.unschedule(%s)", (f"other-{dbname}",))
        assert installed[prefix + "prune"] == (
            """CALL "pgskip".prune_in_batches('3600 seconds'::interval, NULL::interval, 250)""",
            dbname,
        )
        with psycopg.connect(db_url, autocommit=True) as conn:
            old = _job(conn, "completed", finished_ago=timedelta(hours=2))
            kept = _job(conn, "failed", finished_ago=timedelta(days=400))
            conn.execute(installed[prefix + "prune"][0].encode())
            conn.execute(installed[prefix + "sweep"][0].encode())
            assert set(_statuses(conn)) == {kept}
            assert old not in _statuses(conn)
        removed = install(db_url, "pgskip", config, remove=True)
        assert len(removed) == 3 and all(line.endswith("removed") for line in removed)
    finally:
        remove_all_jobs(db_url, "pgskip")
    server = cron.locate(db_url)
    with cron.cron_session(db_url, server) as conn:
        assert cron.list_jobs(conn, prefix) == []


def test_prune_job_on_a_schema_before_0007_calls_prune_and_says_prune_batch_is_ignored(
    db_url: str, pg_cron_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A schema without prune_in_batches() (before migration 0007) gets the one-transaction
    prune(); a prune_batch set for it is reported as ignored, with what to run."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "DROP PROCEDURE pgskip.prune_in_batches(interval, interval, integer, bigint,"
            " bigint, bigint)"
        )
    server = cron.locate(db_url)
    config = MaintenanceConfig(completed_retention=timedelta(hours=1), prune_batch=500)
    with (
        psycopg.connect(db_url) as app_conn,
        cron.cron_session(db_url, server) as conn,
        caplog.at_level("WARNING", logger="kombu_pgskip.maintenance"),
    ):
        made = maintenance_jobs(server, "pgskip", config, conn, app_conn)
    jobs = {job.name.rsplit(":", 1)[1]: job for job in made}
    assert jobs["prune"].command == (
        """SELECT "pgskip".prune('3600 seconds'::interval, '1209600 seconds'::interval)"""
    )
    assert [r.getMessage() for r in caplog.records] == [
        "prune_batch is ignored: schema 'pgskip' has no prune_in_batches() (migration 0007) and"
        " prunes in one transaction; run `celery -A proj pgskip migrate`"
    ]
    with psycopg.connect(db_url, autocommit=True) as conn:
        old = _job(conn, "completed", finished_ago=timedelta(hours=2))
        conn.execute(jobs["prune"].command.encode())
        assert old not in _statuses(conn)
    assert pg_cron_database == server.cron_database


def test_failed_messages_can_be_listed_retried_and_purged_with_filters(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        a1 = _job(conn, "failed", queue="a", task="billing.run", finished_ago=timedelta(days=3),
                  attempts=20, error="Traceback...\nValueError: card declined")  # fmt: skip
        a2 = _job(conn, "failed", queue="a", task="billing.refund", finished_ago=timedelta(hours=1),
                  error="rejected by consumer (requeue=False)")  # fmt: skip
        b1 = _job(conn, "failed", queue="b", task="reports.build", finished_ago=timedelta(days=9))
        _job(conn, "completed", queue="a", task="billing.run", finished_ago=timedelta(days=9))
    runner = CliRunner()
    base = ["--url", db_url]

    listing = runner.invoke(main, ["failed", *base, "--queue", "a"])
    assert listing.exit_code == 0, listing.output
    lines = listing.output.splitlines()
    assert lines[0].split() == ["id", "queue", "task", "task", "id", "attempts", "failed", "at",
                                "error"]  # fmt: skip
    assert [int(line.split()[0]) for line in lines[1:]] == [a1, a2]
    assert "ValueError: card declined" in listing.output and "Traceback" not in listing.output
    full = runner.invoke(main, ["failed", *base, "--task", "billing.*", "--full", "--limit", "1"])
    assert "Traceback" in full.output and len(full.output.splitlines()) == 3

    retried = runner.invoke(
        main, ["retry-failed", *base, "--task", "billing.*", "--older-than", "1d"]
    )
    assert retried.exit_code == 0 and "1 failed message returned to pending" in retried.output
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT status::text, attempts, finished_at FROM pgskip.jobs WHERE id = %s", (a1,)
        ).fetchone()
    assert row == ("pending", 0, None)

    purged = runner.invoke(main, ["purge-failed", *base, "--older-than", "2d", "--yes"])
    assert purged.exit_code == 0 and "1 failed message deleted" in purged.output
    with psycopg.connect(db_url) as conn:
        assert _statuses(conn).get(b1) is None and _statuses(conn)[a2] == "failed"

    nothing = runner.invoke(main, ["failed", *base, "--queue", "nope"])
    assert "(no failed messages)" in nothing.output


def test_tick_fires_and_maintains_once(db_url: str) -> None:
    result = CliRunner().invoke(main, ["tick", "--url", db_url])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("fired 0 periodic slots; requeued 0")
    assert "slots_emptied 0, moved_to_jobs_kept 0" in result.output


def test_tick_prunes_prune_batch_rows_per_transaction(db_url: str) -> None:
    """``--prune-batch`` (``pgskip_maintenance["prune_batch"]``) sets how many completed rows
    each of the prune's transactions deletes."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
            " SELECT 'q', 'completed', '{}', now() - interval '2 days' - i * interval '1 second'"
            " FROM generate_series(1, 300) AS i"
        )
        before = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        result = CliRunner().invoke(main, ["tick", "--url", db_url, "--prune-batch", "20"])
        assert result.exit_code == 0, result.output
        after = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        assert before is not None and after is not None
        assert "pruned_completed 300," in result.output, result.output
        # 15 batches of 20, each in a transaction of its own (plus the sweep's and the last).
        assert after[0] - before[0] >= 16, (before, after)
        assert conn.execute(
            "SELECT count(*) FROM pgskip.jobs WHERE status = 'completed'"
        ).fetchone() == (0,)
    refused = CliRunner().invoke(main, ["tick", "--url", db_url, "--prune-batch", "0"])
    assert refused.exit_code != 0 and "prune_batch must be >= 1" in refused.output
