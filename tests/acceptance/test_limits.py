"""`pgskip limit` with real `celery worker` processes of every pool kind (prefork and threads on
Celery's event loop, solo on kombu's blocking drain_events): at no instant do more of a limited
queue's tasks run than its limit, across the whole fleet; per key, at most one of a key; and
no more start than its rate allows. Every task runs once. A concurrency limit counts a message
from its fetch to its ack: the tasks here acknowledge late (acks_late=True), once they finish,
so that running means running (docs/limits.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import datetime

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, pgskip_ok, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance

QUEUES = ["limited", "keyed", "rated"]


@pytest.fixture(scope="module")
def fleet(module_broker_url: str, module_db_url: str) -> Iterator[list[CeleryWorker]]:
    """Four workers, 11 task slots in all, consuming the limited queues (limited before they
    start: the limits hold from the first fetch)."""
    pgskip_ok(module_db_url, "limit", "limited", "--max-running", "3")
    pgskip_ok(module_db_url, "limit", "keyed", "--per-key", "1")
    pgskip_ok(module_db_url, "limit", "rated", "--rate", "4/s")
    workers = [
        CeleryWorker(
            "taskapp", module_broker_url, cwd=APPS_DIR, queues=QUEUES, pool=pool, concurrency=n
        )
        for pool, n in (("prefork", 3), ("prefork", 3), ("threads", 4), ("solo", 1))
    ]
    for worker in workers:
        worker.start()
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def publisher(module_broker_url: str) -> Iterator[Celery]:
    app = Celery("publisher", broker=module_broker_url, set_as_current=False)
    yield app
    app.close()


def _events(db_url: str, prefix: str) -> list[tuple[str, str, datetime]]:
    """(key, 'start' or 'finish', when) of the tasks whose key starts with ``prefix``."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT key, event, at FROM test_runs WHERE key LIKE %s ORDER BY at, id",
            (prefix + "%",),
        ).fetchall()
    return [(str(k), str(e), at) for k, e, at in rows]


def _most_at_once(events: list[tuple[str, str, datetime]], group: str | None = None) -> int:
    """The most tasks running at one instant (of keys whose group is ``group``: the part
    before the first '-')."""
    running = high = 0
    for key, event, _ in sorted(events, key=lambda e: (e[2], e[1] == "start")):
        if group is not None and key.split("-")[0] != group:
            continue
        running += 1 if event == "start" else -1
        high = max(high, running)
    return high


def _all_done(db_url: str, prefix: str, n: int) -> bool:
    return Counter(e for _, e, _ in _events(db_url, prefix))["finish"] >= n


def test_at_most_max_running_tasks_run_at_once_across_the_fleet(
    fleet: list[CeleryWorker], publisher: Celery, module_db_url: str
) -> None:
    for i in range(24):
        publisher.send_task("taskapp.record_late", args=(f"cap{i}", 0.3), queue="limited")
    wait_until(lambda: _all_done(module_db_url, "cap", 24), 60, "the limited queue's tasks")
    events = _events(module_db_url, "cap")
    assert Counter(k for k, e, _ in events if e == "start") == {f"cap{i}": 1 for i in range(24)}
    # Never more than 3; not always 3 either: a worker's prefetched messages hold slots too
    # (the solo worker's wait for its one process).
    assert 1 < _most_at_once(events) <= 3
    # Each worker logged what it learnt.
    assert all("queue 'limited' is limited across every worker: at most 3 running" in
               w.log_text() for w in fleet)  # fmt: skip
    span = (events[-1][2] - events[0][2]).total_seconds()
    assert span >= 8 * 0.3  # 24 tasks of 0.3 s, 3 at a time


def test_at_most_one_task_of_each_concurrency_key_runs_at_once(
    fleet: list[CeleryWorker], publisher: Celery, module_db_url: str
) -> None:
    for i in range(4):
        for customer in "abc":
            publisher.send_task(
                "taskapp.record_late",
                args=(f"key{customer}-{i}", 0.3),
                queue="keyed",
                pgskip_concurrency_key=f"customer:{customer}",
            )
    wait_until(lambda: _all_done(module_db_url, "key", 12), 60, "the keyed tasks")
    events = _events(module_db_url, "key")
    for customer in "abc":
        assert _most_at_once(events, f"key{customer}") == 1
    assert _most_at_once(events) >= 2  # other keys ran meanwhile


def test_no_more_tasks_start_than_the_rate_allows(
    fleet: list[CeleryWorker], publisher: Celery, module_db_url: str
) -> None:
    for i in range(20):
        publisher.send_task("taskapp.record", args=(f"rate{i}",), queue="rated")
    wait_until(lambda: _all_done(module_db_url, "rate", 20), 60, "the rated tasks")
    starts = [at for _, e, at in _events(module_db_url, "rate") if e == "start"]
    assert len(starts) == 20
    # A bucket of 4 tokens refilled at 4 per second: within any span of t seconds, at most
    # 4 + 4 t starts (one more for the delay between a fetch and its task's start).
    for i in range(len(starts)):
        for j in range(i, len(starts)):
            span = (starts[j] - starts[i]).total_seconds()
            assert j - i + 1 <= 4 + 4 * span + 1, (i, j, span)
    assert (starts[-1] - starts[0]).total_seconds() >= (20 - 4) / 4 - 0.5
