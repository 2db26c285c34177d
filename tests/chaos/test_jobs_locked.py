"""A lock on ``jobs`` longer than the lease (an index build, a table rewrite, pg_repack's swap)
does not let a live worker's lease lapse: its long task runs once.

The worker's background thread renews its leases on a connection that writes nothing but the
``consumers`` rows, before any housekeeping, and its housekeeping (acks, the sweep) gives up on
the lock within half a renewal interval instead of waiting behind it.
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg

from tests.acceptance.conftest import wait_until
from tests.chaos.support import (
    FAST_LEASES,
    Figures,
    Fleet,
    Runs,
    report,
    seed,
    task_id,
    verdict,
)

LEASE_S = float(FAST_LEASES["PGSKIP_OPT_LEASE_SECONDS"])
#: How long the table stays locked: three leases.
LOCKED_S = 3 * LEASE_S
#: The task outlasts the lock, so that it is still running when a sweep can read again.
TASK_S = LOCKED_S + 5


def test_a_long_task_runs_once_while_jobs_is_locked_for_three_leases(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    fleet = Fleet(chaos_broker, chaos_log, pool="prefork", concurrency=1)
    fleet_args = ["--prefetch-multiplier", "1"]
    started = time.monotonic()
    try:
        fleet.start(["holder"], extra_args=fleet_args)
        seed(db_url, chaos_broker, [1], sleep=TASK_S)
        wait_until(lambda: 1 in Runs.read(chaos_log).starts, 30, "the long task to start")
        # An idle worker whose sweeper runs every second: it would take the task if the
        # holder's lease lapsed.
        fleet.start(["rescuer"], extra_args=fleet_args)
        with psycopg.connect(db_url) as locker:
            locker.execute("LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE")
            time.sleep(LOCKED_S)
            lease_left = _lease_left(db_url, fleet.workers["holder"].pid)
            locker.commit()
        # The first sweep that can read, as pg_cron's or another worker's may run right then.
        with psycopg.connect(db_url, autocommit=True) as conn:
            swept = conn.execute("SELECT requeued FROM pgskip.sweep(20)").fetchone()
        wait_until(lambda: 1 in Runs.read(chaos_log).finishes, TASK_S + 20, "the long task")
        wall = time.monotonic() - started
        time.sleep(2 * LEASE_S)  # a wrongful redelivery would start now
        assert fleet.all_running(), fleet.logs_tail()
    finally:
        fleet.stop()
    runs = Runs.read(chaos_log)
    assert [e.host for e in runs.starts[1]] == ["holder"], f"ran more than once: {runs.starts}"
    assert len(runs.finishes[1]) == 1
    verdict(runs, [1], set())
    assert swept == (0,)
    assert lease_left > LEASE_S / 3, f"the lease was not renewed under the lock: {lease_left}"
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT status::text, attempts FROM pgskip.jobs WHERE task_id = %s", (task_id(1),)
        ).fetchone()
    assert row == ("completed", 1)
    report(
        Figures(
            scenario="jobs-locked",
            messages=1,
            faults=1,
            fault_kind="locks",
            duplicates=0,
            lost=0,
            in_flight_at_faults=1,
            recovery_s=0.0,
            wall_s=round(wall, 1),
            extra={"lease_s": LEASE_S, "locked_s": LOCKED_S, "lease_left_s": round(lease_left, 2)},
        ),
        chaos_report,
    )


def _lease_left(db_url: str, worker_pid: int) -> float:
    """Seconds left of the shortest lease of worker ``worker_pid``'s consumers (``consumers``
    stays readable while ``jobs`` is locked)."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT min(extract(epoch FROM lease_until - now()))::float8 FROM pgskip.consumers"
            " WHERE pid = %s",
            (worker_pid,),
        ).fetchone()
    assert row is not None and row[0] is not None, "no consumer of the holder"
    return float(row[0])
