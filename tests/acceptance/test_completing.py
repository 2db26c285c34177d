"""Finishing a task's message in the task's own transaction (kombu_pgskip.completing), with real
prefork workers killed with SIGKILL at random points: every message's effect happens exactly
once."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, wait_until
from tests.docs_support import SAMPLE_DATABASE, blocks, sample_address
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance

FAST_LEASES = {"PGSKIP_OPT_LEASE_SECONDS": "3", "PGSKIP_OPT_SWEEP_INTERVAL": "1"}


@pytest.fixture
def counter(db_url: str) -> Iterator[str]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE test_counter (n bigint NOT NULL)")
        conn.execute("INSERT INTO test_counter VALUES (0)")
        conn.execute("CREATE TABLE test_effects (key text NOT NULL)")
    yield db_url


def _state(db_url: str) -> tuple[int, int, int, dict[str, int]]:
    with psycopg.connect(db_url) as conn:
        (n,) = conn.execute("SELECT n FROM test_counter").fetchone()  # type: ignore[misc]
        (effects, distinct) = conn.execute(
            "SELECT count(*), count(DISTINCT key) FROM test_effects"
        ).fetchone()  # type: ignore[misc]
        statuses = dict(
            conn.execute(
                "SELECT status::text, count(*) FROM pgskip.jobs"
                " WHERE task_name LIKE 'taskapp.count%' GROUP BY 1"
            ).fetchall()
        )
    return int(n), int(effects), int(distinct), statuses


def test_killed_workers_never_double_an_effect_nor_lose_one(
    broker_url: str, counter: str, publisher: Celery
) -> None:
    # Each task works 0.1 s after its commit, before it returns and is acknowledged: most
    # kills land there, where a task that committed on its own would run again.
    n = 300
    rng = random.Random(20261202)
    with publisher.producer_or_acquire() as producer:
        for i in range(n):
            hold = rng.choice((0.0, 0.0, 0.02, 0.05))
            publisher.send_task("taskapp.count_once", args=(f"t{i}", hold, 0.1), producer=producer)
    kills = 0
    for _ in range(6):  # SIGKILL the whole worker at a random point of its run, six times
        w = CeleryWorker(
            "taskapp", broker_url, cwd=APPS_DIR, pool="prefork", concurrency=2,
            extra_env=FAST_LEASES,
        ).start()  # fmt: skip
        time.sleep(rng.uniform(0.5, 2.5))
        w.kill9()
        kills += 1
        if _state(counter)[0] >= n:
            break
    with CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, pool="prefork", concurrency=2, extra_env=FAST_LEASES
    ):
        wait_until(lambda: _state(counter)[3].get("completed", 0) == n, 120, f"{n} completed")
    total, effects, distinct, statuses = _state(counter)
    assert kills >= 1
    assert (total, effects, distinct) == (n, n, n), statuses
    assert statuses == {"completed": n}


def test_a_block_that_raises_commits_nothing_and_the_task_fails_as_usual(
    broker_url: str, counter: str, publisher: Celery
) -> None:
    with CeleryWorker("taskapp", broker_url, cwd=APPS_DIR) as w:
        publisher.send_task("taskapp.count_then_fail", args=("f",))
        wait_until(lambda: _state(counter)[3].get("completed", 0) == 1, 20, "the ack")
        assert "ValueError: f: the work failed" in w.log_text()
    assert _state(counter)[:3] == (0, 0, 0)


def test_the_guides_task_charges_once(broker_url: str, db_url: str, tmp_path: Path) -> None:
    """docs/exactly-once.md's proj.py, in a real worker: one charge per message."""
    (block,) = blocks("exactly-once.md", "python")
    code = block.text.replace(SAMPLE_DATABASE, sample_address(db_url))
    (tmp_path / "proj.py").write_text(code, encoding="utf-8")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)")
        conn.execute("INSERT INTO accounts VALUES (1, 100)")
    app = Celery("publisher", broker=broker_url, set_as_current=False)
    try:
        for _ in range(3):
            app.send_task("proj.charge", args=(1, 10))
        with CeleryWorker("proj", broker_url, cwd=str(tmp_path)):
            wait_until(lambda: _completed(db_url, "proj.charge") == 3, 30, "three charges")
    finally:
        app.close()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT balance FROM accounts").fetchone() == (70,)


def _completed(db_url: str, task: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pgskip.jobs WHERE task_name = %s AND status = 'completed'",
            (task,),
        ).fetchone()
    return int(row[0]) if row else 0
