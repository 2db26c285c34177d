"""Scenario 1: SIGKILL workers in the middle of an ``acks_late`` run; nothing is lost."""

from __future__ import annotations

import random
import time
from pathlib import Path

from tests.chaos.support import (
    REDELIVERY_WAIT_S,
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

MESSAGES = 20_000
KILLS = 5
WORKERS = ["w1", "w2", "w3"]
#: lease_seconds (3) + sweep_interval (1), plus the time to fetch and run the returned messages
#: on a loaded 2-core machine.
RECOVERY_BOUND_S = 15.0


def run_crash_scenario(
    scenario: str,
    db_url: str,
    broker_url: str,
    log: Path,
    report_to: Path,
    *,
    env: dict[str, str] | None = None,
) -> Figures:
    """20,000 acks_late tasks, 3 workers, 5 random SIGKILLs each followed by a restart.

    ``env`` may hold ``PGSKIP_OPT_KEEP_COMPLETED=false``: then every row is gone at the end.
    """
    kept = (env or {}).get("PGSKIP_OPT_KEEP_COMPLETED", "true") != "false"
    rng = random.Random(7)
    ids = range(1, MESSAGES + 1)
    seed_s = seed(db_url, broker_url, ids)
    fleet = Fleet(broker_url, log, env=env)
    started = time.monotonic()
    try:
        fleet.start(WORKERS)
        kills = kill_and_restart(fleet, db_url, KILLS, FinishCounter(log), MESSAGES, rng)
        wait_finished(log, MESSAGES, 240, scenario)
        wall = time.monotonic() - started
        wait_all_completed(db_url, MESSAGES, REDELIVERY_WAIT_S, kept=kept)
        time.sleep(1.5)  # let the last redeliveries, if any, show up before counting
        assert fleet.all_running(), fleet.logs_tail()
    finally:
        fleet.stop()
    runs = Runs.read(log)
    in_flight = set().union(*(ids_ for _, _, ids_ in kills))
    dups, lost = verdict(runs, ids, in_flight)
    recovery = max(recovery_after(runs, at, ids_) for _, at, ids_ in kills)
    assert recovery < RECOVERY_BOUND_S, recovery
    assert job_status_counts(db_url) == ({"completed": MESSAGES} if kept else {})
    figures = Figures(
        scenario=scenario,
        messages=MESSAGES,
        faults=len(kills),
        fault_kind="kills",
        duplicates=dups,
        lost=lost,
        in_flight_at_faults=len(in_flight),
        recovery_s=round(recovery, 2),
        wall_s=round(wall, 1),
        extra={"seed_s": round(seed_s, 1), "killed": ",".join(n for n, _, _ in kills)},
    )
    report(figures, report_to)
    return figures


def test_sigkilled_acks_late_workers_lose_nothing_and_rerun_only_in_flight_tasks(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    run_crash_scenario("1-crash", db_url, chaos_broker, chaos_log, chaos_report)


def test_sigkilled_workers_that_delete_on_ack_lose_nothing_either(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    """The same with ``keep_completed=False``: an ack deletes the row, so a lost or delayed
    ack must still leave the message to be run again, and the table ends empty."""
    run_crash_scenario(
        "1-crash-keep-completed-off",
        db_url,
        chaos_broker,
        chaos_log,
        chaos_report,
        env={"PGSKIP_OPT_KEEP_COMPLETED": "false"},
    )
