"""End to end without celery beat, on pg_cron's real minute ticks.

Celery's periodic-tasks example (``add_periodic_task(10.0, ...)``), synced with `celery -A
beatapp pgskip beat-sync` and run by two `celery worker` processes across two ticks: one run
every 10 seconds from one interval after the sync, each slot run once. In the same minutes, the
maintenance prune job (every minute here) runs its `CALL`, which commits after each batch; and
on two servers whose pg_hba.conf asks pg_cron's connection for a password, `beat-sync` finds in
the first tick that pg_cron cannot connect and says what to change (with background workers, it
can).

pg_cron 1.4 ticks on the minute, so this waits for two ticks: 70 to 130 seconds. The suite's
other wait for a tick, the demo's, overlaps it (the acceptance conftest starts the demo early).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from kombu_pgskip.health import CronRunMonitor
from kombu_pgskip.maintenance import MaintenanceConfig, install, remove_all_jobs
from kombu_pgskip.testing.embedded import EmbeddedPostgres
from tests.acceptance.conftest import APPS_DIR, wait_until
from tests.helpers import REPO_ROOT, CeleryWorker, make_url
from tests.periodic_support import asking_for_a_password, celery, finish, gaps, reap, start_celery

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]

TEN_S = timedelta(seconds=10)
_ADVICE_TEST = "test_beat_sync_finds_pg_cron_cannot_connect_and_says_what_to_change"


@dataclass
class PasswordSyncs:
    """`beat-sync` running on a server whose pg_hba.conf asks role app for a password, and on
    one that also has cron.use_background_workers = on."""

    server: EmbeddedPostgres
    url: str
    syncing: subprocess.Popen[str]
    with_workers: subprocess.Popen[str]


@pytest.fixture(scope="module")
def password_syncs() -> Iterator[Future[PasswordSyncs]]:
    """Started in a thread of its own: the test that starts first goes on meanwhile."""
    with contextlib.ExitStack() as stack:

        def start() -> PasswordSyncs:
            pg, url = stack.enter_context(asking_for_a_password())
            _, workers_url = stack.enter_context(
                asking_for_a_password(**{"cron.use_background_workers": "on"})
            )
            # Both wait for pg_cron's next minute, side by side.
            syncing = start_celery(["beat-sync"], url, "tick")
            stack.callback(reap, syncing)
            with_workers = start_celery(["beat-sync"], workers_url, "tick")
            stack.callback(reap, with_workers)
            return PasswordSyncs(pg, url, syncing, with_workers)

        # Leaving the pool waits for the thread; then the stack stops what it started.
        with ThreadPoolExecutor(max_workers=1) as pool:
            yield pool.submit(start)


@pytest.fixture(scope="module", autouse=True)
def _password_syncs_first(request: pytest.FixtureRequest) -> None:
    """Start them with the module when their test runs: their wait for pg_cron's tick then
    overlaps the first test's."""
    if any(item.name == _ADVICE_TEST for item in request.session.items):
        request.getfixturevalue("password_syncs")


def _env(broker_url: str, schedule: str) -> dict[str, str]:
    env = dict(os.environ, PGSKIP_BROKER_URL=broker_url, PGSKIP_BEAT_SCHEDULE=schedule)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _runs(db_url: str) -> list[tuple[str, datetime, int, str]]:
    """(task id, start, worker pid, event) of each run of the 'hello' entry, by start."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT hostname, at, pid, event FROM test_runs WHERE key = 'hello' ORDER BY at"
        ).fetchall()
    return [(str(r[0]), r[1], int(r[2]), str(r[3])) for r in rows]


def _fire_ticks(
    db_url: str, pg_cron_database: str, jobname: str, after: datetime
) -> list[datetime]:
    """When pg_cron's successful runs of the job started after ``after``."""
    with psycopg.connect(make_url(db_url, pg_cron_database)) as conn:
        rows = conn.execute(
            "SELECT d.start_time FROM cron.job_run_details AS d JOIN cron.job AS j USING (jobid)"
            " WHERE j.jobname = %s AND d.status = 'succeeded' AND d.start_time > %s"
            " ORDER BY d.start_time",
            (jobname, after),
        ).fetchall()
    return [r[0] for r in rows]


def _last_run(db_url: str, pg_cron_database: str, jobname: str) -> tuple[str, str] | None:
    """(status, return message) of the job's latest finished run, if any."""
    with psycopg.connect(make_url(db_url, pg_cron_database)) as conn:
        row = conn.execute(
            "SELECT d.status, d.return_message FROM cron.job_run_details AS d"
            " JOIN cron.job AS j USING (jobid) WHERE j.jobname = %s"
            " AND d.status IN ('succeeded', 'failed') ORDER BY d.start_time DESC LIMIT 1",
            (jobname,),
        ).fetchone()
    return None if row is None else (str(row[0]), str(row[1]))


def test_real_ticks_run_celerys_10_second_example_every_10_seconds_on_two_workers(
    broker_url: str, db_url: str, pg_cron_database: str
) -> None:
    dbname = db_url.rsplit("/", 1)[1]
    fire_job = f"pgskip:{dbname}:pgskip:fire"
    prune_job = f"pgskip:{dbname}:pgskip:prune"
    workers = [
        CeleryWorker(
            "beatapp", broker_url, cwd=APPS_DIR, extra_env={"PGSKIP_BEAT_SCHEDULE": "hello"}
        )
        for _ in range(2)
    ]
    try:
        # The workers first: the first run comes 10 s after the sync.
        for worker in workers:
            worker.start(wait_ready=False)
        for worker in workers:
            worker.wait_for_log(r"@\S+ ready\.", timeout=60)
        sync = subprocess.run(
            # --wait 0: the checks below wait for pg_cron's runs instead.
            [sys.executable, "-m", "celery", "-A", "beatapp", "pgskip", "beat-sync", "--wait", "0"],
            cwd=APPS_DIR, env=_env(broker_url, "hello"), capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert sync.returncode == 0, sync.stdout + sync.stderr
        assert "+ say hello every 10 s: beatapp.record every 10 seconds" in sync.stdout
        assert f"{fire_job} installed" in sync.stdout
        with psycopg.connect(db_url, autocommit=True) as conn:
            # The sync's transaction inserted the first slots itself.
            row = conn.execute("SELECT min(fired_at) FROM pgskip.beat_slots").fetchone()
            assert row is not None
            synced = row[0]
            old = conn.execute(
                "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
                " VALUES ('done', 'completed', '{}', now() - interval '2 hours') RETURNING id"
            ).fetchone()
        config = MaintenanceConfig(
            prune_schedule="* * * * *", completed_retention=timedelta(hours=1)
        )
        (change,) = install(db_url, "pgskip", config)  # beat-sync installed it hourly
        assert change.startswith(f"pg_cron job {prune_job} updated: '* * * * *' runs CALL ")

        # Until a run after pg_cron's second tick since the sync.
        def after_two_ticks() -> bool:
            ticks = _fire_ticks(db_url, pg_cron_database, fire_job, synced)
            runs = _runs(db_url)
            return len(ticks) >= 2 and bool(runs) and runs[-1][1] > ticks[1]

        wait_until(after_two_ticks, timeout=150, what="a run after two pg_cron ticks")
        wait_until(
            lambda: _last_run(db_url, pg_cron_database, prune_job) is not None,
            timeout=70,
            what="a pg_cron run of the prune job",
        )
        ticks = _fire_ticks(db_url, pg_cron_database, fire_job, synced)
        runs = _runs(db_url)
        prune_run = _last_run(db_url, pg_cron_database, prune_job)
    finally:
        for worker in workers:
            worker.stop()
        remove_all_jobs(db_url, "pgskip")

    starts = [at for _, at, _, _ in runs]
    # The first run one interval after the sync; then one every 10 s, at the ticks too.
    assert TEN_S - timedelta(seconds=1) <= starts[0] - synced <= TEN_S + timedelta(seconds=2)
    assert all(abs(gap - TEN_S) <= timedelta(seconds=1) for gap in gaps(starts)), gaps(starts)
    assert starts[-1] > ticks[1]
    # Each slot ran once, with beat's header, on one of the two workers.
    assert {event for *_, event in runs} == {"beat"}
    with psycopg.connect(db_url) as conn:
        slots = conn.execute(
            "SELECT task_id, fired_at FROM pgskip.beat_slots WHERE sent_at <= %s",
            (starts[-1],),
        ).fetchall()
    task_ids = [task_id for task_id, *_ in runs]
    assert sorted(task_ids) == sorted(str(t) for t, _ in slots)
    assert {pid for _, _, pid, _ in runs} <= {w.pid for w in workers}
    # Some of them were inserted by pg_cron's first tick, not by the sync.
    assert any(fired_at >= ticks[0] - timedelta(seconds=1) for _, fired_at in slots)

    assert prune_run is not None and prune_run[0] == "succeeded", prune_run
    with psycopg.connect(db_url) as conn:
        assert old is not None
        gone = conn.execute("SELECT id FROM pgskip.jobs WHERE id = %s", old).fetchone()
    assert gone is None, "the old completed message was pruned"


def test_beat_sync_finds_pg_cron_cannot_connect_and_says_what_to_change(
    password_syncs: Future[PasswordSyncs], caplog: pytest.LogCaptureFixture
) -> None:
    syncs = password_syncs.result(timeout=120)
    pg, url = syncs.server, syncs.url
    failed = finish(syncs.syncing, timeout=240)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    # What was done comes first; then what pg_cron's first run found.
    assert "+ every-minute: beatapp.record crontab(* * * * *)" in failed.stdout
    assert "pg_cron job pgskip:app:pgskip:fire installed" in failed.stdout
    err = failed.stderr
    assert "failed: connection failed" in err
    assert f"new connection to localhost (cron.host, by default localhost) port {pg.port}" in err
    assert "cron.use_background_workers = on" in err
    assert f"localhost:{pg.port}:app:app:PASSWORD" in err
    trust = [line.strip() for line in err.splitlines() if line.strip().startswith("host  app")]
    assert trust == ["host  app  app  127.0.0.1/32  trust", "host  app  app  ::1/128  trust"]

    listing = celery(["beat-list"], url, "tick")
    assert "failed (connection failed)" in listing.stdout, listing.stdout + listing.stderr
    assert "cron.use_background_workers = on" in listing.stdout  # and what to change

    # A worker connected as that role warns.
    caplog.set_level(logging.WARNING, logger="kombu_pgskip.health")
    warned = CronRunMonitor(url, "pgskip", failed_runs=1).check()
    assert "pgskip:app:pgskip:fire" in warned
    assert any("periodic tasks are not being sent" in r.getMessage() for r in caplog.records)

    # Background workers need no connection: the same pg_hba.conf, and pg_cron runs the jobs.
    workers = finish(syncs.with_workers, timeout=240)
    assert workers.returncode == 0, workers.stdout + workers.stderr
    assert "pg_cron can run these jobs: its run of pgskip:app:pgskip:" in workers.stdout

    # The trust lines it gives, above the password lines, let pg_cron's connection in: the one
    # it makes, to localhost as app without a password.
    passwordless = f"postgresql://app@127.0.0.1:{pg.port}/app"
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(passwordless, connect_timeout=10).close()
    hba = Path(pg.hba_path)
    hba.write_text("".join(line + "\n" for line in trust) + hba.read_text())
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    assert _connects(passwordless) == ("app",)


def _connects(url: str, timeout: float = 10) -> tuple[object, ...] | None:
    """``current_user`` over a new connection, once the server's reloaded pg_hba.conf lets it in."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(url, connect_timeout=10) as conn:
                return conn.execute("SELECT current_user").fetchone()
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
