"""Real `celery worker` processes against the pgskip broker."""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance

FAST_LEASES = {"PGSKIP_OPT_LEASE_SECONDS": "3", "PGSKIP_OPT_SWEEP_INTERVAL": "1"}


def worker(broker_url: str, **kwargs: object) -> CeleryWorker:
    return CeleryWorker("taskapp", broker_url, cwd=APPS_DIR, **kwargs)  # type: ignore[arg-type]


def finished(db_url: str) -> Counter[str]:
    return Counter(key for key, *_ in runs(db_url, "finish"))


def test_tasks_run_on_several_queues(broker_url: str, db_url: str, publisher: Celery) -> None:
    for i in range(10):
        publisher.send_task("taskapp.record", args=(f"d{i}",), queue="default")
        publisher.send_task("taskapp.record", args=(f"e{i}",), queue="emails")
    with worker(broker_url, queues=["default", "emails"], concurrency=4):
        wait_until(lambda: len(finished(db_url)) == 20, 30, "20 tasks on two queues")
    done = finished(db_url)
    assert set(done) == {f"d{i}" for i in range(10)} | {f"e{i}" for i in range(10)}
    assert set(done.values()) == {1}


def test_higher_priority_tasks_start_first(broker_url: str, db_url: str, publisher: Celery) -> None:
    order = [(0, "p0-a"), (9, "p9-a"), (5, "p5-a"), (0, "p0-b"), (9, "p9-b")]
    for priority, key in order:
        publisher.send_task("taskapp.record", args=(key,), queue="default", priority=priority)
    with worker(broker_url, concurrency=1, extra_args=["--prefetch-multiplier", "1"]):
        wait_until(lambda: len(finished(db_url)) == 5, 30, "5 tasks")
    started = [key for key, *_ in runs(db_url, "start")]
    assert started == ["p9-a", "p9-b", "p5-a", "p0-a", "p0-b"]


def test_countdown_waits_in_the_database_and_runs_on_time(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    with worker(broker_url) as w:
        sent = datetime.now(timezone.utc)
        publisher.send_task("taskapp.record", args=("later",), countdown=6)
        time.sleep(3)
        with psycopg.connect(db_url) as conn:
            status = conn.execute("SELECT status::text FROM pgskip.jobs").fetchall()
        assert status == [("scheduled",)], "the worker must not hold the message while it waits"
        assert "received" not in w.log_text()
        wait_until(lambda: finished(db_url)["later"] == 1, 15, "the countdown task")
    with psycopg.connect(db_url) as conn:
        (started,) = conn.execute(
            "SELECT at FROM test_runs WHERE key = 'later' AND event = 'start'"
        ).fetchone()  # type: ignore[misc]
    delay = (started - sent).total_seconds()
    assert 5.9 <= delay <= 7.5, delay


def test_stored_countdowns_start_at_their_eta_not_at_the_next_poll(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    # Polls 4 s apart and ETAs 6 s apart: each ETA after the first falls due more than a poll
    # after the promotion before it, so one promoted by the next poll (or a sweep) instead of at
    # its due time would start up to 4 s late.
    slow_poll = {"PGSKIP_OPT_POLLING_INTERVAL": "4", "PGSKIP_OPT_SWEEP_INTERVAL": "30"}
    with worker(broker_url, extra_env=slow_poll):
        etas = {}
        for key, countdown in (("eta-a", 2), ("eta-b", 8), ("eta-c", 14)):
            etas[key] = datetime.now(timezone.utc) + timedelta(seconds=countdown)
            publisher.send_task("taskapp.record", args=(key,), eta=etas[key])
        wait_until(lambda: all(finished(db_url)[k] == 1 for k in etas), 30, "the countdowns")
    with psycopg.connect(db_url) as conn:
        started = dict(
            conn.execute("SELECT key, at FROM test_runs WHERE event = 'start'").fetchall()
        )
    late = {key: (started[key] - eta).total_seconds() for key, eta in etas.items()}
    assert all(-0.05 <= s < 1.0 for s in late.values()), late


def test_a_stored_countdown_behind_a_backlog_starts_before_the_tasks_published_after_it(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    # A countdown keeps its place in the queue, as with RabbitMQ, where the worker receives it
    # in publish order and holds it until due: here 10 s of tasks published after it do not
    # make it wait. Sorted by its ETA instead, it would start after all of them (7 s late).
    with worker(broker_url, concurrency=1):
        eta = datetime.now(timezone.utc) + timedelta(seconds=3)
        publisher.send_task("taskapp.record", args=("eta",), eta=eta)
        with publisher.producer_or_acquire() as producer:
            for i in range(40):
                publisher.send_task("taskapp.record", args=(f"b{i}", 0.25), producer=producer)
        wait_until(lambda: finished(db_url)["eta"] == 1, 30, "the countdown")
    with psycopg.connect(db_url) as conn:
        started = dict(
            conn.execute("SELECT key, at FROM test_runs WHERE event = 'start'").fetchall()
        )
    # The task running at its ETA and the four the worker had prefetched go first: 1.25 s.
    late = (started["eta"] - eta).total_seconds()
    assert -0.05 <= late < 2.5, late
    before = [key for key, at in started.items() if key != "eta" and at < started["eta"]]
    assert len(before) < 20, before


def test_acks_late_task_of_a_killed_worker_runs_again_elsewhere(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    first = worker(broker_url, extra_env=FAST_LEASES, hostname="first@%h").start()
    try:
        publisher.send_task("taskapp.record_late", args=("crash", 4.0))
        wait_until(lambda: len(runs(db_url, "start")) == 1, 20, "the first start")
        first.kill9()
    finally:
        first.kill9()
    killed_at = time.monotonic()
    with worker(broker_url, extra_env=FAST_LEASES, hostname="second@%h"):
        wait_until(lambda: finished(db_url)["crash"] == 1, 30, "the task to run again")
    recovery = time.monotonic() - killed_at
    starts = runs(db_url, "start")
    assert len(starts) == 2
    assert starts[0][3] is False and starts[1][3] is True  # delivery_info["redelivered"]
    assert starts[0][2] != starts[1][2]
    assert recovery < 30, recovery


def test_two_workers_never_both_receive_one_message(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    n = 1000
    w1 = worker(broker_url, concurrency=4, hostname="w1@%h")
    w2 = worker(broker_url, concurrency=4, hostname="w2@%h")
    with w1, w2, publisher.producer_or_acquire() as producer:
        for i in range(n):
            publisher.send_task("taskapp.record", args=(f"m{i}",), producer=producer)
        wait_until(lambda: len(finished(db_url)) == n, 90, f"{n} tasks")
    starts = Counter(key for key, *_ in runs(db_url, "start"))
    assert len(starts) == n and set(starts.values()) == {1}
    hosts = {pid for _, _, pid, _ in runs(db_url, "start")}
    assert len(hosts) == 2, "both workers took part"


def test_prefork_pool_children_publish_on_their_own_connections(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    for i in range(6):
        publisher.send_task("taskapp.spawn", args=(f"s{i}",))
    with worker(broker_url, pool="prefork", concurrency=2):
        wait_until(lambda: len(finished(db_url)) == 12, 40, "6 tasks and their 6 children")
    done = finished(db_url)
    assert set(done.values()) == {1}
    assert {f"s{i}-child" for i in range(6)} <= set(done)
    with psycopg.connect(db_url) as conn:
        statuses = dict(
            conn.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
        )
    assert statuses == {"completed": 12}


def test_task_longer_than_the_lease_runs_once_while_its_worker_lives(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    # Lease 3 s, task 9 s: the heartbeat thread must keep renewing it, even in the solo pool
    # where the task blocks the consumer thread, while a second worker sweeps every second.
    busy = worker(broker_url, pool="solo", concurrency=1, extra_env=FAST_LEASES, hostname="busy@%h")
    idle = worker(broker_url, extra_env=FAST_LEASES, hostname="idle@%h")
    with busy:
        publisher.send_task("taskapp.record_late", args=("long", 9.0))
        wait_until(lambda: len(runs(db_url, "start")) == 1, 20, "the long task to start")
        with idle:
            wait_until(lambda: finished(db_url)["long"] == 1, 30, "the long task to finish")
            time.sleep(2)
    assert len(runs(db_url, "start")) == 1
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT status::text, attempts, redelivered FROM pgskip.jobs").fetchone()
    assert row == ("completed", 1, False)


def test_poll_only_mode_delivers_without_listen(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    env = {"PGSKIP_OPT_LISTEN": "false", "PGSKIP_OPT_POLLING_INTERVAL": "0.2"}
    with worker(broker_url, extra_env=env):
        for i in range(5):
            publisher.send_task("taskapp.record", args=(f"poll{i}",))
        wait_until(lambda: len(finished(db_url)) == 5, 20, "5 tasks in poll-only mode")
        with psycopg.connect(db_url) as conn:
            listeners = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND query ILIKE 'LISTEN%%'"
            ).fetchone()
    assert listeners == (0,)


def test_a_stream_of_tasks_runs_once_each_and_a_later_task_starts_at_once(
    broker_url: str, db_url: str, publisher: Celery
) -> None:
    """Tasks published faster than the worker's fetch cooldown each run once; a task published
    after the stream starts at once, woken by its notification (the poll is 30 s away)."""
    n = 1500
    env = {"PGSKIP_OPT_POLLING_INTERVAL": "30"}
    with (
        worker(broker_url, concurrency=4, extra_env=env),
        publisher.producer_or_acquire() as producer,
    ):
        publisher.send_task("taskapp.record", args=("first",), producer=producer)
        wait_until(lambda: len(finished(db_url)) == 1, 30, "the first task")
        for i in range(n):
            publisher.send_task("taskapp.record", args=(f"b{i}",), producer=producer)
        wait_until(lambda: len(finished(db_url)) == n + 1, 120, f"{n} tasks")
        time.sleep(0.5)  # the stream is over: the worker waits for notifications
        sent = time.monotonic()
        publisher.send_task("taskapp.record", args=("late",), producer=producer)
        wait_until(lambda: finished(db_url)["late"] == 1, 20, "the late task")
        assert time.monotonic() - sent < 5, "woken by its notification, not the 30 s poll"
    starts = Counter(key for key, *_ in runs(db_url, "start"))
    assert len(starts) == n + 2 and set(starts.values()) == {1}
