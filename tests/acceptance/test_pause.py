"""`pgskip pause` and `pgskip resume` with real `celery worker` processes: a paused queue's
tasks wait, in every worker, one started later too, while its other queues and the task
already running go on; on resume they start at once."""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime, timezone

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, pgskip_ok, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance


def _started(db_url: str) -> dict[str, datetime]:
    with psycopg.connect(db_url) as conn:
        return dict(conn.execute("SELECT key, at FROM test_runs WHERE event = 'start'").fetchall())


def test_a_paused_queue_waits_in_every_worker_and_starts_at_once_on_resume(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    first = CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, queues=["default", "reports"], concurrency=2
    )
    with first:
        publisher.send_task("taskapp.record_late", args=("long", 3.0), queue="reports")
        wait_until(lambda: "long" in _started(db_url), 20, "the long task to start")
        out = pgskip_ok(db_url, "pause", "reports", "--reason", "deploy")
        assert out.startswith("queue 'reports': paused;")
        for i in range(5):
            publisher.send_task("taskapp.record", args=(f"r{i}",), queue="reports")
            publisher.send_task("taskapp.record", args=(f"d{i}",), queue="default")
        wait_until(
            lambda: (
                {f"d{i}" for i in range(5)} | {"long"}
                <= {key for key, *_ in runs(db_url, "finish")}
            ),
            30,
            "the other queue's tasks and the running one",
        )
        time.sleep(2.5)  # two fallback polls and more
        # The task that was running when the queue was paused finished and was acknowledged.
        with psycopg.connect(db_url) as conn:
            statuses = Counter(
                status
                for (status,) in conn.execute(
                    "SELECT status::text FROM pgskip.jobs WHERE queue = 'reports'"
                )
            )
        assert statuses == {"completed": 1, "pending": 5}
        # A worker started later honours the pause: it is in the database.
        second = CeleryWorker("taskapp", broker_url, cwd=APPS_DIR, queues=["reports"])
        with second:
            time.sleep(3)
            assert not any(key.startswith("r") for key in _started(db_url))
            # and says why it runs nothing, in its log
            assert "queue 'reports' is paused since " in second.log_text()
            assert (
                " (deploy): this worker takes none of its messages until "
                "`celery -A proj pgskip resume reports`"
            ) in second.log_text()
            assert "'reports' since " in pgskip_ok(db_url, "status")
            assert pgskip_ok(db_url, "resume", "reports") == "queue 'reports': resumed\n"
            # From the command's return, not its start: starting the CLI (Python, Celery) alone
            # takes about a second on a loaded two-core machine.
            resumed_at = datetime.now(timezone.utc)
            wait_until(
                lambda: {f"r{i}" for i in range(5)} <= set(_started(db_url)), 20, "the resume"
            )
    started = _started(db_url)
    first_start = min(at for key, at in started.items() if key.startswith("r"))
    assert (first_start - resumed_at).total_seconds() < 1.0
    assert Counter(key for key, *_ in runs(db_url, "start")) == {
        key: 1 for key in ["long", *(f"{q}{i}" for q in "rd" for i in range(5))]
    }
