"""Scenario 4: tasks three times longer than the lease run once, unless their worker dies."""

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
    running_ids_of,
    seed,
    task_id,
    verdict,
)

LEASE_S = float(FAST_LEASES["PGSKIP_OPT_LEASE_SECONDS"])
SWEEP_S = float(FAST_LEASES["PGSKIP_OPT_SWEEP_INTERVAL"])
TASK_S = 3 * LEASE_S
#: The documented bound (docs/reliability.md): a dead worker's messages are handed out again
#: within lease_seconds + max(sweep_interval, lease_seconds / 3) of its death. The sweep
#: notifies, so an idle worker fetches at once; 1.5 s of slack for a loaded 2-core machine.
REDELIVERY_BOUND_S = LEASE_S + max(SWEEP_S, LEASE_S / 3) + 1.5


def test_long_tasks_run_once_while_their_worker_lives_and_again_soon_after_it_dies(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    # Each worker takes exactly two messages (prefork -c 2, prefetch multiplier 1).
    fleet = Fleet(
        chaos_broker,
        chaos_log,
        pool="prefork",
        concurrency=2,
    )
    fleet_args = ["--prefetch-multiplier", "1"]
    started = time.monotonic()
    try:
        fleet.start(["live", "doomed"], extra_args=fleet_args)
        seed(db_url, chaos_broker, range(1, 5), sleep=TASK_S)
        wait_until(lambda: len(Runs.read(chaos_log).starts) == 4, 30, "4 long tasks to start")
        # An idle worker whose sweeper runs every second and takes what comes back.
        fleet.start(["rescuer"], extra_args=fleet_args)
        runs = Runs.read(chaos_log)
        on_live = {m for m, s in runs.starts.items() if s[0].host == "live"}
        on_doomed = {m for m, s in runs.starts.items() if s[0].host == "doomed"}
        assert len(on_live) == len(on_doomed) == 2, runs.starts
        pid, killed_at = fleet.kill("doomed")
        in_flight = running_ids_of(db_url, pid)
        assert in_flight == on_doomed
        wait_until(lambda: set(Runs.read(chaos_log).finishes) == {1, 2, 3, 4}, 60, "all 4")
        wall = time.monotonic() - started
        time.sleep(SWEEP_S * 2)  # a wrongful sweep of the live worker's tasks would show now
    finally:
        fleet.stop()
    runs = Runs.read(chaos_log)
    dups, lost = verdict(runs, range(1, 5), in_flight)
    for msg in on_live:
        assert len(runs.starts[msg]) == 1 and len(runs.finishes[msg]) == 1, runs.starts[msg]
        finish = runs.finishes[msg][0]
        assert finish.at - runs.starts[msg][0].at >= TASK_S
    redelivery = []
    for msg in on_doomed:
        first, second = runs.starts[msg]
        assert (first.host, second.host) == ("doomed", "rescuer")
        assert (first.redelivered, second.redelivered) == (False, True)
        assert [f.host for f in runs.finishes[msg]] == ["rescuer"]
        redelivery.append(second.at - killed_at)
    assert max(redelivery) < REDELIVERY_BOUND_S, (redelivery, REDELIVERY_BOUND_S)
    with psycopg.connect(db_url) as conn:
        rows: dict[str, int] = dict(
            conn.execute("SELECT task_id, attempts FROM pgskip.jobs WHERE status = 'completed'")
        )
    assert {msg: rows[task_id(msg)] for msg in range(1, 5)} == {
        m: (1 if m in on_live else 2) for m in range(1, 5)
    }
    report(
        Figures(
            scenario="4-long-tasks",
            messages=4,
            faults=1,
            fault_kind="kills",
            duplicates=dups,
            lost=lost,
            in_flight_at_faults=len(in_flight),
            recovery_s=round(max(redelivery), 2),
            wall_s=round(wall, 1),
            extra={
                "lease_s": LEASE_S,
                "task_s": TASK_S,
                "bound_s": REDELIVERY_BOUND_S,
                "live_worker_runs": sum(len(runs.starts[m]) for m in on_live),
            },
        ),
        chaos_report,
    )
