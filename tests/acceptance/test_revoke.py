"""A revoke that lasts, with real `celery worker` processes and a result backend: a task
revoked while its message waits in the database never runs, whatever worker starts later."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import kombu
import psycopg
import pytest
from celery import Celery

from kombu_pgskip.control import REVOKED_ERROR
from tests.acceptance.conftest import APPS_DIR, celery_cli, runs, wait_until
from tests.helpers import REPO_ROOT, CeleryWorker

pytestmark = pytest.mark.acceptance


@pytest.fixture
def backend(db_url: str) -> str:
    return "db+" + db_url


@pytest.fixture
def app(broker_url: str, backend: str) -> Iterator[Celery]:
    app = Celery("revoking", broker=broker_url, backend=backend, set_as_current=False)
    app.conf.task_default_queue = "default"
    yield app
    # As in test_remote_control: app.close() leaves the pooled connection that app.control
    # used in kombu's process-wide pools, its lease heartbeat running until the process exits.
    app.close()
    kombu.pools.reset()


def _worker(broker_url: str, backend: str, name: str) -> CeleryWorker:
    return CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, concurrency=1, hostname=f"{name}@%h",
        extra_env={"PGSKIP_RESULT_BACKEND": backend}, extra_args=["--prefetch-multiplier", "1"],
    )  # fmt: skip


def _statuses(db_url: str) -> dict[str, tuple[str, str | None]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT task_id, status::text, last_error FROM pgskip.jobs").fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def test_celery_control_revoke_outlives_the_workers_that_received_it(
    app: Celery, broker_url: str, backend: str, db_url: str
) -> None:
    first = _worker(broker_url, backend, "first").start()
    try:
        # An acks_late task fills the worker's only credit, so `queued` waits in the database
        # as `pending`; `later` waits there as `scheduled` (its countdown is past eta_threshold).
        app.send_task("taskapp.record_late", args=("blocker", 3.0))
        wait_until(lambda: "blocker" in {k for k, *_ in runs(db_url, "start")}, 20, "blocker")
        queued = app.send_task("taskapp.record", args=("queued",))
        later = app.send_task("taskapp.record", args=("later",), countdown=6)
        due = time.monotonic() + 6
        replies = app.control.revoke([queued.id, later.id], reply=True, timeout=3)
        texts = [reply["ok"] for answer in replies for reply in answer.values()]
        assert len(texts) == 1, replies
        assert "2 waiting in the database marked revoked for good" in texts[0]
        statuses = _statuses(db_url)
        assert statuses[queued.id] == statuses[later.id] == ("failed", REVOKED_ERROR)
        # The memory that remembered the revoke dies with the worker.
        first.kill9()
    finally:
        first.kill9()
    with _worker(broker_url, backend, "second"):
        wait_until(lambda: "blocker" in {k for k, *_ in runs(db_url, "finish")}, 30, "blocker")
        time.sleep(max(0.0, due + 1.5 - time.monotonic()))  # past the countdown
        assert queued.state == later.state == "REVOKED"
    started = {k for k, *_ in runs(db_url, "start")}
    assert "queued" not in started and "later" not in started
    env = {**os.environ, "PGSKIP_URL": db_url}
    listed = subprocess.run(
        [sys.executable, "-m", "kombu_pgskip", "failed", "--full"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count(REVOKED_ERROR) == 2


def test_pgskip_revoke_lasts_with_no_worker_running(
    app: Celery, broker_url: str, backend: str, db_url: str
) -> None:
    later = app.send_task("taskapp.record", args=("later",), countdown=3)
    now = app.send_task("taskapp.record", args=("now",))
    done = subprocess.run(
        [sys.executable, "-m", "kombu_pgskip", "revoke", later.id, now.id, "unknown-id",
         "--url", db_url],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"task {later.id}: revoked; its waiting message will never be delivered",
        f"task {now.id}: revoked; its waiting message will never be delivered",
        "task unknown-id: no waiting message (running, held by a worker, finished or unknown);"
        " no worker was told",
    ]
    with _worker(broker_url, backend, "late"):
        app.send_task("taskapp.record", args=("after",))
        wait_until(lambda: "after" in {k for k, *_ in runs(db_url, "finish")}, 20, "after")
        time.sleep(4)  # past the countdown
    assert {k for k, *_ in runs(db_url, "start")} == {"after"}


def test_pgskip_revoke_under_celery_stores_revoked_in_the_result_backend(
    app: Celery, broker_url: str, backend: str, db_url: str
) -> None:
    later = app.send_task("taskapp.record", args=("later",), countdown=60)
    done = celery_cli(
        "pgskip", "revoke", later.id, broker=broker_url, env={"PGSKIP_RESULT_BACKEND": backend}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"task {later.id}: revoked; its waiting message will never be delivered\n"
    assert later.state == "REVOKED"
    assert _statuses(db_url)[later.id] == ("failed", REVOKED_ERROR)
