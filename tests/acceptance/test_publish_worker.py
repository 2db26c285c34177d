"""Jobs enqueued with apply_async_in, run by a real ``celery worker``.

One worker (threads pool, concurrency 4) serves the whole module. It polls only every 30 s, so a
task that starts sooner after a commit was woken by the commit's notification.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime

import psycopg
import pytest
from celery import Celery

from kombu_pgskip import apply_async_in, apply_many, apply_many_in, send_task_in
from tests.helpers import REPO_ROOT, CeleryWorker
from tests.publish_support import Rollback, broker_url, cloned_database, jobs

pytestmark = [pytest.mark.acceptance]

POLLING_INTERVAL = 30.0
LATENCY_SAMPLES = 7


@pytest.fixture(scope="module")
def db(pg_server_dsn: str, template_db: str) -> Iterator[str]:
    with cloned_database(pg_server_dsn, template_db) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE test_runs ("
                " id bigserial PRIMARY KEY, key text NOT NULL, event text NOT NULL,"
                " pid int NOT NULL, hostname text, redelivered boolean,"
                " at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
            conn.execute("CREATE TABLE orders (id int PRIMARY KEY, key text NOT NULL)")
        yield url


@pytest.fixture(scope="module")
def worker(db: str) -> Iterator[CeleryWorker]:
    worker = CeleryWorker(
        "taskapp",
        broker_url(db),
        pool="threads",
        concurrency=4,
        cwd=str(REPO_ROOT / "tests" / "apps"),
        extra_env={"PGSKIP_OPT_POLLING_INTERVAL": str(POLLING_INTERVAL)},
    )
    with worker:
        yield worker


@pytest.fixture(scope="module")
def app(db: str) -> Iterator[Celery]:
    """The enqueuing side: knows the worker's task only by name."""
    app = Celery("enqueuer", broker=broker_url(db), set_as_current=False)
    app.conf.task_default_queue = "default"  # the queue tests/apps/taskapp.py consumes
    yield app
    app.close()


def _events(db: str, keys: list[str] | None = None) -> dict[str, dict[str, list[datetime]]]:
    """key -> event ("start"/"finish") -> times, from the tasks' own records."""
    with psycopg.connect(db, autocommit=True) as conn:
        if keys is None:
            rows = conn.execute("SELECT key, event, at FROM test_runs").fetchall()
        else:
            rows = conn.execute(
                "SELECT key, event, at FROM test_runs WHERE key = ANY(%s)", (keys,)
            ).fetchall()
    out: dict[str, dict[str, list[datetime]]] = {}
    for key, event, at in rows:
        out.setdefault(key, {}).setdefault(event, []).append(at)
    return out


def _wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, worker: CeleryWorker
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout}s waiting for {what}; worker log:\n"
                f"{worker.log_text()[-4000:]}"
            )
        time.sleep(0.05)


def _finished(db: str, keys: list[str]) -> Callable[[], bool]:
    def check() -> bool:
        events = _events(db, keys)
        return all("finish" in events.get(k, {}) for k in keys)

    return check


def test_committed_job_runs_exactly_once(db: str, worker: CeleryWorker, app: Celery) -> None:
    key = f"commit-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db) as conn, conn.transaction():
        apply_async_in(conn, app.signature("taskapp.record", args=(key,)))
    _wait_for(_finished(db, [key]), 20, f"{key} to finish", worker)
    time.sleep(0.5)  # a duplicate delivery would show up by now
    events = _events(db, [key])[key]
    assert len(events["start"]) == 1
    assert len(events["finish"]) == 1


def test_rolled_back_job_never_runs(db: str, worker: CeleryWorker, app: Celery) -> None:
    gone, marker = f"rollback-{uuid.uuid4().hex[:8]}", f"marker-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db) as conn:
        with pytest.raises(Rollback), conn.transaction():
            send_task_in(conn, "taskapp.record", args=(gone,), app=app)
            raise Rollback
        with conn.transaction():
            send_task_in(conn, "taskapp.record", args=(marker,), app=app)
    _wait_for(_finished(db, [marker]), 20, f"{marker} to finish", worker)
    time.sleep(0.5)
    assert gone not in _events(db, [gone])
    assert not any(gone in j.payload["headers"]["argsrepr"] for j in jobs(db))


def test_bulk_enqueued_jobs_run_exactly_once(db: str, worker: CeleryWorker, app: Celery) -> None:
    prefix = f"many-{uuid.uuid4().hex[:6]}"
    committed = [f"{prefix}-c{i}" for i in range(150)]
    direct = [f"{prefix}-d{i}" for i in range(150)]
    with psycopg.connect(db) as conn:
        with pytest.raises(Rollback), conn.transaction():
            apply_many_in(conn, [app.signature("taskapp.record", args=(f"{prefix}-gone",))])
            raise Rollback
        with conn.transaction():
            apply_many_in(conn, [app.signature("taskapp.record", args=(k,)) for k in committed])
    apply_many(app.signature("taskapp.record", args=(k,)) for k in direct)
    _wait_for(_finished(db, committed + direct), 60, "the bulk-enqueued tasks to finish", worker)
    time.sleep(0.5)
    events = _events(db, [*committed, *direct, f"{prefix}-gone"])
    assert f"{prefix}-gone" not in events
    assert all(len(events[k]["start"]) == 1 for k in committed + direct)


@pytest.mark.slow
def test_thousand_transactions_run_exactly_the_committed_ones(
    db: str, worker: CeleryWorker, app: Celery
) -> None:
    rng = random.Random(20240611)
    prefix = f"bulk-{uuid.uuid4().hex[:6]}"
    committed: set[str] = set()
    rolled_back: set[str] = set()
    started = time.monotonic()
    with psycopg.connect(db) as conn:
        for i in range(1000):
            key = f"{prefix}-{i}"
            roll_back = rng.random() < 1 / 3
            try:
                with conn.transaction():
                    conn.execute("INSERT INTO orders (id, key) VALUES (%s, %s)", (i, key))
                    apply_async_in(conn, app.signature("taskapp.record", args=(key,)))
                    if roll_back:
                        raise Rollback
            except Rollback:
                rolled_back.add(key)
            else:
                committed.add(key)
    enqueue_seconds = time.monotonic() - started

    def all_finished() -> bool:
        with psycopg.connect(db, autocommit=True) as c:
            row = c.execute(
                "SELECT count(DISTINCT key) FROM test_runs WHERE key LIKE %s AND event = 'finish'",
                (f"{prefix}-%",),
            ).fetchone()
        return row is not None and row[0] >= len(committed)

    _wait_for(all_finished, 60, "the committed tasks to finish", worker)
    time.sleep(0.5)
    events = {k: v for k, v in _events(db).items() if k.startswith(prefix)}
    assert set(events) == committed
    assert all(len(v["start"]) == 1 and len(v["finish"]) == 1 for v in events.values())
    with psycopg.connect(db, autocommit=True) as c:
        orders = {r[0] for r in c.execute("SELECT key FROM orders").fetchall()}
    assert orders == committed
    assert 250 < len(rolled_back) < 420  # a third, give or take: the seed is fixed
    print(f"\n1000 transactions enqueued in {enqueue_seconds:.2f}s; {len(committed)} committed")


def test_idle_worker_starts_the_task_within_milliseconds_of_commit(
    db: str, worker: CeleryWorker, app: Celery
) -> None:
    latencies: list[float] = []
    with psycopg.connect(db) as conn:
        for n in range(LATENCY_SAMPLES):
            time.sleep(0.3)  # let the worker go back to waiting on LISTEN
            key = f"latency-{n}-{uuid.uuid4().hex[:6]}"
            apply_async_in(conn, app.signature("taskapp.record", args=(key,)))
            before_commit = time.time()
            conn.commit()
            _wait_for(_finished(db, [key]), 10, f"{key} to start", worker)
            start = _events(db, [key])[key]["start"][0]
            latencies.append(start.timestamp() - before_commit)
    median = statistics.median(latencies)
    print(
        f"\ncommit-to-start latency: median {median * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.1f} ms over {LATENCY_SAMPLES} commits"
    )
    # A poll would take up to POLLING_INTERVAL (30 s): these came from the notification.
    assert max(latencies) < 1.0
    assert median < 0.25
