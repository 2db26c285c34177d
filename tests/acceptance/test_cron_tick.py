"""End to end without celery beat: `celery -A beatapp pgskip beat-sync`, then a real pg_cron tick
inserts the message and a real `celery worker` runs it; in the same tick the maintenance prune
job (every minute here) runs its `CALL`, which commits after each batch.

pg_cron 1.4 ticks on the minute, so this waits up to about 70 seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import psycopg
import pytest

from kombu_pgskip.maintenance import MaintenanceConfig, install, remove_all_jobs
from tests.acceptance.conftest import APPS_DIR, wait_until
from tests.helpers import REPO_ROOT, CeleryWorker, make_url

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]


def _beat_runs(db_url: str) -> list[tuple[str, str]]:
    """(task id, event) of the runs logged by beatapp.record for the 'tick' entry."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT hostname, event FROM test_runs WHERE key = 'tick' ORDER BY id"
        ).fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


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


def test_a_real_pg_cron_tick_sends_a_message_a_real_worker_runs(
    broker_url: str, db_url: str, pg_cron_database: str
) -> None:
    env = dict(os.environ, PGSKIP_BROKER_URL=broker_url, PGSKIP_BEAT_SCHEDULE="tick")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    dbname = db_url.rsplit("/", 1)[1]
    try:
        sync = subprocess.run(
            # --wait 0: the worker below waits for pg_cron's first run instead.
            [sys.executable, "-m", "celery", "-A", "beatapp", "pgskip", "beat-sync", "--wait", "0"],
            cwd=APPS_DIR, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert sync.returncode == 0, sync.stdout + sync.stderr
        assert "+ every-minute: beatapp.record crontab(* * * * *)" in sync.stdout
        assert f"pgskip:{dbname}:pgskip:fire installed" in sync.stdout
        with psycopg.connect(db_url, autocommit=True) as conn:
            old = conn.execute(
                "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
                " VALUES ('done', 'completed', '{}', now() - interval '2 hours') RETURNING id"
            ).fetchone()
        prune_job = f"pgskip:{dbname}:pgskip:prune"
        config = MaintenanceConfig(
            prune_schedule="* * * * *", completed_retention=timedelta(hours=1)
        )
        (change,) = install(db_url, "pgskip", config)  # beat-sync installed it hourly
        assert change.startswith(f"pg_cron job {prune_job} updated: '* * * * *' runs CALL ")

        synced_at = time.time()
        with CeleryWorker("beatapp", broker_url, cwd=APPS_DIR,
                          extra_env={"PGSKIP_BEAT_SCHEDULE": "tick"}):  # fmt: skip
            wait_until(lambda: bool(_beat_runs(db_url)), timeout=95, what="a pg_cron-fired run")
        assert time.time() - synced_at < 95

        runs = _beat_runs(db_url)
        # The task saw beat's header; its id is the one recorded for the slot.
        assert runs[0][1] == "beat"
        with psycopg.connect(db_url) as conn:
            slots = conn.execute(
                "SELECT task_id FROM pgskip.beat_slots WHERE entry = 'every-minute'"
            ).fetchall()
        assert runs[0][0] in {r[0] for r in slots}
        assert len({task_id for task_id, _ in runs}) == len(runs)  # no slot ran twice
        with psycopg.connect(make_url(db_url, pg_cron_database)) as conn:
            status = conn.execute(
                "SELECT d.status FROM cron.job_run_details AS d JOIN cron.job AS j USING (jobid)"
                " WHERE j.jobname = %s ORDER BY d.start_time DESC LIMIT 1",
                (f"pgskip:{dbname}:pgskip:fire",),
            ).fetchone()
        assert status == ("succeeded",)

        wait_until(
            lambda: _last_run(db_url, pg_cron_database, prune_job) is not None,
            timeout=95,
            what="a pg_cron run of the prune job",
        )
        run = _last_run(db_url, pg_cron_database, prune_job)
        assert run is not None and run[0] == "succeeded", run
        with psycopg.connect(db_url) as conn:
            assert old is not None
            gone = conn.execute("SELECT id FROM pgskip.jobs WHERE id = %s", old).fetchone()
        assert gone is None, "the old completed message was pruned"
    finally:
        remove_all_jobs(db_url, "pgskip")
