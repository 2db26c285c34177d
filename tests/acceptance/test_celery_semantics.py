"""Task semantics Celery takes from its broker, with a real worker and a result backend."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance


@pytest.fixture
def backend(db_url: str) -> str:
    return "db+" + db_url


@pytest.fixture
def app(broker_url: str, backend: str) -> Iterator[Celery]:
    app = Celery("semantics", broker=broker_url, backend=backend, set_as_current=False)
    app.conf.task_default_queue = "default"
    yield app
    app.close()


def test_retry_keeps_the_priority_and_an_expired_task_ends_revoked(
    app: Celery, broker_url: str, backend: str, db_url: str
) -> None:
    expired = app.send_task("taskapp.record", args=("too-late",), expires=0.1)
    time.sleep(0.5)  # it expires before any worker sees it
    retried = app.send_task("taskapp.retry_once", args=("r",), priority=7)
    worker = CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, extra_env={"PGSKIP_RESULT_BACKEND": backend}
    )
    with worker:
        assert retried.get(timeout=30) == "r"
        # The expired message was delivered, and the worker marked the task REVOKED instead
        # of running it (with a broker that dropped it, it would stay PENDING forever).
        wait_until(lambda: expired.state == "REVOKED", 20, "the expired task to be REVOKED")
    events = [e for k, e, *_ in runs(db_url) if k == "r"]
    assert events == ["priority=7", "priority=7"]
    assert "too-late" not in {k for k, *_ in runs(db_url)}


def test_an_expired_periodic_task_ends_revoked_as_any_task(
    app: Celery, broker_url: str, backend: str, db_url: str
) -> None:
    """A beat entry's ``expires`` makes its message expire as ``apply_async(expires=...)``
    does: delivered, and marked REVOKED by the worker, not deleted unseen."""
    from datetime import datetime, timedelta, timezone

    from kombu_pgskip.periodic import fire_due
    from tests.periodic_support import sync_as_of

    app.conf.beat_schedule = {
        "late": {"task": "taskapp.record", "schedule": 60, "args": ("periodic-too-late",),
                 "options": {"expires": 0.1, "queue": "default"}},
    }  # fmt: skip
    now = datetime.now(timezone.utc)
    sync_as_of(app, db_url, now - timedelta(seconds=61))  # its first slot was a second ago
    assert fire_due(db_url, "pgskip", now=now, lookahead=timedelta(seconds=1)) == 1
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT task_id FROM pgskip.beat_slots WHERE entry = 'late'").fetchone()
    assert row is not None
    time.sleep(0.5)  # it expires before any worker sees it
    worker = CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, extra_env={"PGSKIP_RESULT_BACKEND": backend}
    )
    with worker:
        result = app.AsyncResult(row[0])
        wait_until(lambda: result.state == "REVOKED", 20, "the expired periodic task to be REVOKED")
    assert "periodic-too-late" not in {k for k, *_ in runs(db_url)}
