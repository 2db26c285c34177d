"""A prefork ``celery worker`` rides out server errors: it stays up, reconnects, goes on
consuming, and every task runs, none lost.

One worker, one phase per fault. Each phase queues its own tasks, injects the fault once a
quarter of them have finished, and waits for all of them:

* ``cancel`` / ``terminate``: the jobs table is locked, so the worker's fetch (or an ack the
  event loop writes itself) waits; every session waiting on the lock is then canceled
  (``pg_cancel_backend``) or terminated (``pg_terminate_backend``) until the worker logs its
  reconnect;
* ``listen``: the worker's LISTEN session is terminated;
* ``lock_timeout`` / ``statement_timeout``: set for the database's new sessions (the worker's
  reconnect after the phase before opens them), then the jobs table is locked past it.

The verdict: the worker's process never exited; it logged one reconnect or more per phase,
naming the phase's SQLSTATE; every task finished; a task started more than once only when the
broker redelivered it (a reconnect returns the messages fetched and not acked), and at most
a prefetch window's worth per reconnect.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from tests.acceptance.conftest import wait_until
from tests.chaos.support import (
    Fleet,
    Runs,
    job_status_counts,
    seed,
    wait_ids_finished,
)

PER_PHASE = 40
TASK_SLEEP_S = 0.05
CONCURRENCY = 2
#: Celery's prefetch window: the most messages delivered and not acked at a reconnect.
PREFETCH = 4 * CONCURRENCY
TIMEOUT = "700ms"
RECONNECTED = "consumer: Connection to broker lost"
#: What each phase's reconnect line must name (the exception's repr).
EXPECTED = {
    "cancel": ("SQLSTATE 57014",),
    "listen": ("SQLSTATE 57P01", "connection to PostgreSQL was lost"),
    "lock_timeout": ("SQLSTATE 55P03",),
    "statement_timeout": ("SQLSTATE 57014",),
    "terminate": ("SQLSTATE 57P01", "connection to PostgreSQL was lost"),
}
#: Database settings made just before each phase's fault: the sessions the worker opens when
#: it reconnects after it have them, for the next phase.
SETTINGS_AFTER: dict[str, dict[str, str | None]] = {
    "cancel": {},
    "listen": {"lock_timeout": TIMEOUT},
    "lock_timeout": {"lock_timeout": None, "statement_timeout": TIMEOUT},
    "statement_timeout": {"statement_timeout": None},
    "terminate": {},
}
PHASES = list(EXPECTED)


def _admin(db_url: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(
        db_url, autocommit=autocommit, options="-c lock_timeout=0 -c statement_timeout=0"
    )


def _set(db_url: str, settings: dict[str, str | None]) -> None:
    dbname = str(psycopg.conninfo.conninfo_to_dict(db_url)["dbname"])
    with _admin(db_url) as conn:
        for name, value in settings.items():
            target = sql.SQL("ALTER DATABASE {} ").format(sql.Identifier(dbname))
            if value is None:
                conn.execute(target + sql.SQL("RESET {}").format(sql.Identifier(name)))
            else:
                conn.execute(
                    target + sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
                )


def _signal_waiting(admin: psycopg.Connection[Any], holder_pid: int, kind: str) -> int:
    """Cancel or terminate every session of the database waiting for a lock; how many."""
    row = admin.execute(
        sql.SQL(
            "SELECT count({}(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            "   AND pid NOT IN (pg_backend_pid(), %s)"
        ).format(sql.Identifier(f"pg_{kind}_backend")),
        (holder_pid,),
    ).fetchone()
    return int(row[0]) if row else 0


def _terminate_listener(admin: psycopg.Connection[Any]) -> int:
    row = admin.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
    ).fetchone()
    return int(row[0]) if row else 0


def _inject(db_url: str, kind: str, reconnected: Callable[[], bool], timeout: float = 30.0) -> None:
    """Inject fault ``kind``, and keep at it until ``reconnected()`` (the worker logged a
    reconnect since the phase began)."""
    deadline = time.monotonic() + timeout
    with _admin(db_url) as admin:
        if kind == "listen":
            while not reconnected():
                assert time.monotonic() < deadline, "the worker did not notice"
                _terminate_listener(admin)
                time.sleep(0.2)
            return
        with _admin(db_url, autocommit=False) as holder:
            holder.execute("LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE")
            while not reconnected():
                assert time.monotonic() < deadline, "the worker did not notice"
                if kind in ("cancel", "terminate"):
                    _signal_waiting(admin, holder.info.backend_pid, kind)
                time.sleep(0.05)
            holder.rollback()


def test_a_prefork_worker_rides_out_server_errors(
    db_url: str, chaos_broker: str, chaos_log: Path
) -> None:
    fleet = Fleet(chaos_broker, chaos_log, pool="prefork", concurrency=CONCURRENCY)
    try:
        fleet.start(["w1"])
        worker = fleet.workers["w1"]
        pid = worker.pid
        for k, kind in enumerate(PHASES):
            ids = range(k * PER_PHASE + 1, (k + 1) * PER_PHASE + 1)
            before = worker.log_text().count(RECONNECTED)
            seed(db_url, chaos_broker, ids, sleep=TASK_SLEEP_S)

            def started(ids: range = ids) -> bool:
                return len(set(Runs.read(chaos_log).finishes) & set(ids)) >= PER_PHASE // 4

            wait_until(started, 60, f"the {kind} phase's first tasks")
            _set(db_url, SETTINGS_AFTER[kind])
            since = len(worker.log_text())

            def reconnected(before: int = before) -> bool:
                return worker.log_text().count(RECONNECTED) > before

            _inject(db_url, kind, reconnected)
            wait_ids_finished(chaos_log, ids, 60, f"the {kind} phase's tasks")
            assert worker.is_running() and worker.pid == pid, worker.log_text()[-3000:]
            logged = worker.log_text()[since:]
            assert any(what in logged for what in EXPECTED[kind]), (kind, logged[-3000:])
            assert "TransientDatabaseError" in logged, (kind, logged[-3000:])
        wait_until(
            lambda: job_status_counts(db_url) == {"completed": PER_PHASE * len(PHASES)},
            30,
            "every row completed",
        )
        time.sleep(1.0)
        assert worker.is_running() and worker.pid == pid
        reconnects = worker.log_text().count(RECONNECTED)
    finally:
        fleet.stop()
    runs = Runs.read(chaos_log)
    everything = set(range(1, PER_PHASE * len(PHASES) + 1))
    assert set(runs.finishes) == everything, sorted(everything - set(runs.finishes))[:20]
    assert set(runs.starts) == everything
    starts = Counter({m: len(s) for m, s in runs.starts.items()})
    for msg, n in starts.items():
        if n > 1:
            later = sorted(runs.starts[msg], key=lambda e: e.at)[1:]
            assert all(e.redelivered for e in later), (msg, runs.starts[msg])
    extra = sum(n - 1 for n in starts.values())
    assert reconnects >= len(PHASES)
    assert extra <= PREFETCH * reconnects, (extra, reconnects)
    print(
        f"server errors: phases={len(PHASES)} reconnects={reconnects} tasks={len(everything)} "
        f"ran again after a reconnect={extra}"
    )
