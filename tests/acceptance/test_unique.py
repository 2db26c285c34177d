"""Unique tasks with a real `celery worker`: while a task published with a unique key waits,
runs, or waits to be retried, publishing it again writes nothing and raises DuplicateTask;
its retry is not lost; once it has run, the key is free again."""

from __future__ import annotations

import psycopg
import pytest
from celery import Celery

from kombu_pgskip import DuplicateTask
from tests.acceptance.conftest import APPS_DIR, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance


def _events(db_url: str, key: str) -> list[str]:
    return [event for k, event, *_ in runs(db_url) if k == key]


def _waiting_or_running(db_url: str) -> list[tuple[str, str | None]]:
    with psycopg.connect(db_url) as conn:
        return [
            (r[0], r[1])
            for r in conn.execute(
                "SELECT status::text, unique_key FROM pgskip.jobs"
                " WHERE status IN ('pending', 'scheduled', 'running') ORDER BY id"
            )
        ]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_keyed_task_is_not_published_twice_while_it_waits_runs_or_retries(
    broker_url: str, db_url: str, publisher: Celery, pool: str
) -> None:
    def publish(key: str, hold: float = 0.0) -> str:
        result = publisher.send_task(
            "taskapp.sync_account", args=(key, hold), pgskip_unique="account:7"
        )
        return str(result.id)

    with CeleryWorker("taskapp", broker_url, cwd=APPS_DIR, pool=pool, concurrency=2):
        first = publish("first", 1.5)
        with pytest.raises(DuplicateTask):
            publish("while-waiting")
        wait_until(lambda: "try=0" in _events(db_url, "first"), 20, "the first run")
        with pytest.raises(DuplicateTask):
            publish("while-running")
        # The retry (same task id) took the key over from the run it retries.
        wait_until(lambda: "try=1" in _events(db_url, "first"), 20, "the retry")
        with pytest.raises(DuplicateTask):
            publish("while-retrying")
        wait_until(lambda: "finish" in _events(db_url, "first"), 20, "the retry to finish")
        wait_until(lambda: _waiting_or_running(db_url) == [], 20, "the retry's ack")
        later = publish("later")
        assert later != first
        wait_until(lambda: "finish" in _events(db_url, "later"), 20, "the later task")
    assert _events(db_url, "first") == ["try=0", "try=1", "finish"]
    assert [k for k, *_ in runs(db_url)].count("while-waiting") == 0
    assert {k for k, *_ in runs(db_url)} == {"first", "later"}
