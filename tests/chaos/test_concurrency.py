"""Scenario 5: 4 prefork workers drain one queue's messages: each exactly once.

The suite drains 20,000; docs/reliability.md has runs of 100,000
(``PGSKIP_CHAOS_MESSAGES=100000``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg

from tests.chaos.support import Figures, Fleet, Runs, report, seed, verdict, wait_finished

MESSAGES = int(os.environ.get("PGSKIP_CHAOS_MESSAGES", "20000"))
WORKERS = ["w1", "w2", "w3", "w4"]


def run_concurrency_scenario(
    scenario: str,
    db_url: str,
    broker_url: str,
    log: Path,
    report_to: Path,
    *,
    messages: int = MESSAGES,
    env: dict[str, str] | None = None,
) -> Figures:
    ids = range(1, messages + 1)
    seed_s = seed(db_url, broker_url, ids)
    fleet = Fleet(broker_url, log, pool="prefork", concurrency=2, env=env)
    started = time.monotonic()
    try:
        fleet.start(WORKERS)
        wait_finished(log, messages, 600, scenario)
        wall = time.monotonic() - started
        time.sleep(1.0)  # a second delivery, if any, would show now
        assert fleet.all_running(), fleet.logs_tail()
    finally:
        fleet.stop()
    runs = Runs.read(log)
    dups, lost = verdict(runs, ids, in_flight=set())
    hosts = {s[0].host for s in runs.starts.values()}
    assert hosts == set(WORKERS), f"every worker took part: {hosts}"
    with psycopg.connect(db_url) as conn:
        states = conn.execute(
            "SELECT status::text, attempts, redelivered, count(*) FROM pgskip.jobs GROUP BY 1, 2, 3"
        ).fetchall()
    assert states == [("completed", 1, False, messages)], states
    figures = Figures(
        scenario=scenario,
        messages=messages,
        faults=0,
        fault_kind="faults",
        duplicates=dups,
        lost=lost,
        in_flight_at_faults=0,
        recovery_s=0.0,
        wall_s=round(wall, 1),
        extra={"seed_s": round(seed_s, 1), "tasks_per_s": round(messages / wall)},
    )
    report(figures, report_to)
    return figures


def test_four_prefork_workers_deliver_each_of_their_messages_exactly_once(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    run_concurrency_scenario("5-concurrency", db_url, chaos_broker, chaos_log, chaos_report)
