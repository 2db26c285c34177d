"""Celery events against the pgskip broker: `celery events --dump`, `-E`, enable_events."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, celery_cli, runs, wait_until
from tests.helpers import REPO_ROOT, CeleryWorker

pytestmark = pytest.mark.acceptance

HOST = socket.gethostname()


def event_queues(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT name FROM pgskip.queues WHERE name LIKE 'celeryev.%%'")
        return {r[0] for r in rows}


@contextmanager
def event_dump(broker_url: str, db_url: str) -> Iterator[Path]:
    """`celery events --dump` running, its queue bound; yields the file it prints to."""
    out = Path(tempfile.mkstemp(prefix="celery-events-", suffix=".log")[1])
    env = dict(os.environ, PGSKIP_BROKER_URL=broker_url, PYTHONPATH=str(REPO_ROOT))
    with open(out, "wb") as fh:
        # Ctrl-C reaches it as in a terminal, even when the suite runs as a background job of a
        # shell, whose children start with SIGINT ignored (and Python then keeps it so).
        dump = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "taskapp", "events", "--dump"],
            cwd=APPS_DIR, env=env, stdout=fh, stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    try:
        # Events sent before the receiver's queue is bound are not kept (as with any broker).
        wait_until(lambda: len(event_queues(db_url)) == 1, 20, "the receiver's queue")
        yield out
    finally:
        dump.send_signal(signal.SIGINT)  # as Ctrl-C: the receiver closes its channel
        stopped = time.monotonic()
        try:
            dump.wait(timeout=15)
        except subprocess.TimeoutExpired:
            dump.kill()
            dump.wait()
        took = time.monotonic() - stopped
        tail = out.read_text(errors="replace")[-3000:]
        out.unlink(missing_ok=True)
    # Ctrl-C stops it promptly, and it leaves by closing its channel (which drops its
    # auto_delete queue), not killed, whose queue would wait for its x-expires.
    assert dump.returncode != -signal.SIGKILL, f"Ctrl-C ignored for {took:.1f}s:\n{tail}"


def test_celery_events_dump_sees_a_worker_start_beat_run_tasks_and_stop(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    with event_dump(broker_url, db_url) as out:
        worker = CeleryWorker(
            "taskapp", broker_url, cwd=APPS_DIR, hostname="ev1@%h",
            extra_args=["-E"], without=("gossip", "mingle"),
        )  # fmt: skip
        with worker:
            result = publisher.send_task("taskapp.record", args=("evented",))
            wait_until(
                lambda: f"task succeeded: taskapp.record({result.id})" in out.read_text(),
                20,
                "task-succeeded in the dump",
            )
            wait_until(lambda: "heartbeat" in out.read_text(), 10, "a worker heartbeat")
        wait_until(lambda: "shutdown" in out.read_text(), 10, "worker-offline")
        text = out.read_text()
        for what in ("started", "task received", "task started", "task succeeded"):
            assert f"ev1@{HOST} [" in text and what in text, (what, text)
    # Its queue was auto_delete: it goes with its consumer (at once when the receiver closes its
    # channel; after the sweep when a slow receiver had to be killed).
    wait_until(lambda: event_queues(db_url) == set(), 30, "the receiver's queue deleted")


def test_enable_events_by_remote_control_then_task_events_flow(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    # Heartbeats on, task events off (no -E): worker events only, until enable_events.
    worker = CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, hostname="ev2@%h", without=("gossip", "mingle")
    )
    with event_dump(broker_url, db_url) as out, worker:
        wait_until(lambda: "heartbeat" in out.read_text(), 20, "a worker heartbeat")
        first = publisher.send_task("taskapp.record", args=("quiet",))
        wait_until(lambda: "quiet" in {k for k, *_ in runs(db_url, "finish")}, 20, "quiet")
        time.sleep(0.5)
        assert first.id not in out.read_text(), "task events are off without -E"
        enable = celery_cli("control", "enable_events", broker=broker_url)
        assert enable.returncode == 0 and "task events enabled" in enable.stdout
        second = publisher.send_task("taskapp.record", args=("loud",))
        wait_until(
            lambda: f"task succeeded: taskapp.record({second.id})" in out.read_text(),
            20,
            "task-succeeded after enable_events",
        )
