"""A real `celery worker` moves the ring of `jobs`' slots on and empties the slots its tasks
finished, with nothing else running: no maintenance job, no `pgskip tick`."""

from __future__ import annotations

import time

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance


def _ring(db_url: str) -> tuple[int, dict[int, int]]:
    """The current slot, and the size in bytes of each slot."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT slot FROM pgskip.jobs_rotation").fetchone()
        sizes = conn.execute(
            "SELECT k, pg_relation_size(format('pgskip.jobs_%s', k)::regclass)"
            " FROM generate_series(1, 8) AS k"
        ).fetchall()
    assert row is not None
    return int(row[0]), {int(k): int(size) for k, size in sizes}


def test_a_worker_rotates_the_slots_and_empties_those_its_tasks_finished(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 5, completed_retention = '0 s'")
    with CeleryWorker("taskapp", broker_url, cwd=APPS_DIR, queues=["default"]):
        for i in range(12):
            publisher.send_task("taskapp.record", args=(f"t{i}",), queue="default")
            if i % 5 == 4:  # a rotation (every second) between each five
                target = 1 + i // 5
                wait_until(lambda t=target: _ring(db_url)[0] > t, 10, "the ring to move on")
        wait_until(lambda: len(runs(db_url, "finish")) == 12, 30, "the twelve tasks")
        wait_until(
            lambda: all(size == 0 for k, size in _ring(db_url)[1].items() if k != _ring(db_url)[0]),
            10,
            "the finished slots to be emptied",
        )
    current, sizes = _ring(db_url)
    assert current >= 3, "the ring moved on at least twice"
    assert sizes[current] > 0  # the current slot is never emptied
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT DISTINCT slot, status::text FROM pgskip.jobs").fetchall()
    assert left == [(current, "completed")]


def test_an_idle_worker_takes_each_task_at_once_while_the_ring_moves_on(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    """An idle worker looks for a new message in the slot of the newest one it took first, and
    in every slot when nothing is there (``fetcher.py``). Tasks sent one at a time to a worker
    that polls only every 60 s, the ring moving on every three messages while it waits: each
    starts within seconds, the ones in a slot the worker has not seen yet included, so the same
    fetch found them and not the poll."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 3")
    seen: set[int] = set()
    with CeleryWorker(
        "taskapp",
        broker_url,
        cwd=APPS_DIR,
        queues=["default"],
        extra_env={"PGSKIP_OPT_POLLING_INTERVAL": "60"},
    ):
        for i in range(8):
            seen.add(_ring(db_url)[0])
            publisher.send_task("taskapp.record", args=(f"idle{i}",), queue="default")
            wait_until(lambda n=i + 1: len(runs(db_url, "finish")) == n, 5, f"task {i} to run")
            time.sleep(1.2)  # the worker rotates every second: the ring may move on meanwhile
    assert len(seen) >= 3, "tasks went to at least three slots"
