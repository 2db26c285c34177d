"""End to end without celery beat: `celery -A beatapp pgskip beat-sync`, then a real pg_cron tick
inserts the message and a real `celery worker` runs it.

pg_cron 1.4 ticks on the minute, so this waits up to about 70 seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psycopg
import pytest

from kombu_pgskip.maintenance import remove_all_jobs
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


def test_a_real_pg_cron_tick_sends_a_message_a_real_worker_runs(
    broker_url: str, db_url: str, pg_cron_database: str
) -> None:
    env = dict(os.environ, PGSKIP_BROKER_URL=broker_url, PGSKIP_BEAT_SCHEDULE="tick")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    dbname = db_url.rsplit("/", 1)[1]
    try:
        sync = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "beatapp", "pgskip", "beat-sync"],
            cwd=APPS_DIR, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert sync.returncode == 0, sync.stdout + sync.stderr
        assert "+ every-minute: beatapp.record crontab(* * * * *)" in sync.stdout
        assert f"pgskip:{dbname}:pgskip:fire installed" in sync.stdout

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
    finally:
        remove_all_jobs(db_url, "pgskip")
