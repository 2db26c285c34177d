"""Scenario 6: scenarios 1 and 5 through PgBouncer in transaction pooling, poll-only mode."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.conftest import PGBOUNCER_OPTIONS
from tests.chaos.pgbouncer import PgBouncer
from tests.chaos.test_concurrency import run_concurrency_scenario
from tests.chaos.test_crash import run_crash_scenario


def test_sigkilled_workers_behind_pgbouncer_lose_nothing(
    pgbouncer: PgBouncer, db_url: str, chaos_log: Path, chaos_report: Path
) -> None:
    broker = pgbouncer.url_for(db_url).replace("postgresql://", "pgskip://", 1)
    figures = run_crash_scenario(
        "6-pgbouncer-crash", db_url, broker, chaos_log, chaos_report, env=PGBOUNCER_OPTIONS
    )
    assert figures.lost == 0


def test_four_prefork_workers_behind_pgbouncer_deliver_each_message_once(
    pgbouncer: PgBouncer, db_url: str, chaos_log: Path, chaos_report: Path
) -> None:
    broker = pgbouncer.url_for(db_url).replace("postgresql://", "pgskip://", 1)
    run_concurrency_scenario(
        "6-pgbouncer-concurrency", db_url, broker, chaos_log, chaos_report, env=PGBOUNCER_OPTIONS
    )
