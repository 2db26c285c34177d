"""A SIGKILLed worker's tasks come back when its session ends, not when its lease runs out.

The workers run with a 60 s lease: every recovery asserted here is far shorter, so it went by the
session lock (kombu_pgskip/leases.py), which PostgreSQL releases the moment the killed process's
connection closes, and not by the lease.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import psycopg

from tests.chaos.support import (
    Figures,
    FinishCounter,
    Fleet,
    Runs,
    job_status_counts,
    kill_and_restart,
    recovery_after,
    report,
    seed,
    verdict,
    wait_all_completed,
    wait_finished,
)

LEASE_S = 60.0
#: From the kill until every task in flight on the killed worker has finished again: a sweep
#: (every second, or the restarted worker's first) and the tasks' run on a loaded 2-core
#: machine. A quarter of the lease.
RECOVERY_BOUND_S = 15.0


def _run(
    scenario: str,
    db_url: str,
    broker_url: str,
    log: Path,
    report_to: Path,
    *,
    messages: int,
    sleep: float,
    fleet: Fleet,
    extra_args: list[str],
) -> None:
    ids = range(1, messages + 1)
    seed(db_url, broker_url, ids, sleep=sleep)
    started = time.monotonic()
    try:
        fleet.start(["w1", "w2"], extra_args=extra_args)
        kills = kill_and_restart(fleet, db_url, 1, FinishCounter(log), messages, random.Random(3))
        wait_finished(log, messages, 120, scenario)
        wall = time.monotonic() - started
        # Rows left running under the dead consumers (acks it had not written) come back too,
        # long before its lease would have run out.
        wait_all_completed(db_url, messages, RECOVERY_BOUND_S)
        time.sleep(1.0)  # a late redelivery, if any, would show up now
        assert fleet.all_running(), fleet.logs_tail()
    finally:
        fleet.stop()
    ((name, killed_at, in_flight),) = kills
    assert in_flight, "the killed worker held no message: the kill proved nothing"
    runs = Runs.read(log)
    dups, lost = verdict(runs, ids, in_flight)
    recovery = recovery_after(runs, killed_at, in_flight)
    assert recovery < RECOVERY_BOUND_S, (recovery, RECOVERY_BOUND_S)
    assert job_status_counts(db_url) == {"completed": messages}
    with psycopg.connect(db_url) as conn:
        lease_left = conn.execute(
            "SELECT min(extract(epoch FROM lease_until - now()))::float8 FROM pgskip.consumers"
        ).fetchone()
    assert lease_left is not None and lease_left[0] is not None and lease_left[0] > 30
    report(
        Figures(
            scenario=scenario,
            messages=messages,
            faults=1,
            fault_kind="kills",
            duplicates=dups,
            lost=lost,
            in_flight_at_faults=len(in_flight),
            recovery_s=round(recovery, 2),
            wall_s=round(wall, 1),
            extra={"lease_s": LEASE_S, "killed": name},
        ),
        report_to,
    )


def test_a_killed_prefork_workers_tasks_come_back_in_seconds_not_after_its_lease(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    """Two prefork workers (-c 2, acks_late, prefetch multiplier 1), one SIGKILLed halfway and
    started again; the other's sweeper runs every second."""
    fleet = Fleet(
        chaos_broker,
        chaos_log,
        pool="prefork",
        concurrency=2,
        env={"PGSKIP_OPT_LEASE_SECONDS": str(LEASE_S), "PGSKIP_OPT_SWEEP_INTERVAL": "1"},
    )
    _run(
        "session-end-prefork",
        db_url,
        chaos_broker,
        chaos_log,
        chaos_report,
        messages=600,
        sleep=0.02,
        fleet=fleet,
        extra_args=["--prefetch-multiplier", "1"],
    )


def test_a_worker_started_in_place_of_a_killed_one_sweeps_at_once(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    """The survivor's next sweep is minutes away (sweep_interval 300 s): the killed worker's
    tasks come back by the first sweep of the worker started in its place."""
    fleet = Fleet(
        chaos_broker,
        chaos_log,
        env={"PGSKIP_OPT_LEASE_SECONDS": str(LEASE_S), "PGSKIP_OPT_SWEEP_INTERVAL": "300"},
    )
    _run(
        "session-end-restart-sweeps",
        db_url,
        chaos_broker,
        chaos_log,
        chaos_report,
        messages=2000,
        sleep=0.005,
        fleet=fleet,
        extra_args=[],
    )
