"""A held snapshot while a real worker drains a backlog (``bench/held_drain.py``, which measures
the drain rate before, during and after the hold): the worker drains in every phase and nothing
is lost. The rates are printed, not asserted: on a shared machine they vary too much over
seconds."""

from __future__ import annotations

import psycopg

from bench.held_drain import run
from bench.held_snapshot import HOLDER_APP


def test_worker_drains_through_a_held_snapshot_and_loses_nothing(db_url: str) -> None:
    lines: list[str] = []
    result = run(
        db_url,
        warmup=0,
        before=5,
        hold=10,
        after=5,
        backlog=10_000,
        window=5,
        sessions=True,
        log=lines.append,
    )
    print("\n" + result.table())
    assert [p.name for p in result.phases] == ["before", "hold", "after"]
    for p in result.phases:
        assert p.completed > 0, f"nothing completed in phase {p.name}"
    # Every phase is cut into windows; before's tell how far a window strays from its phase's
    # rate with nothing changing, and their mean is that rate.
    assert {w.phase for w in result.windows} == {"before", "hold", "after"}
    assert result.before_spread is not None
    assert result.before_spread[0] <= 1.0 + 1e-9 and result.before_spread[1] >= 1.0 - 1e-9
    # The backlog never ran out, so the rates are the worker's capacity.
    assert result.min_backlog is not None and result.min_backlog > 0
    # Nothing lost: every message published is completed or still waiting, none failed.
    assert set(result.by_status) <= {"completed", "pending", "running"}
    assert sum(result.by_status.values()) == result.published
    # The per-second series counted every completion once.
    assert result.sampled_completed == result.by_status["completed"]
    # Where the worker's database time went: its fetch (ack_fetch, a WITH statement) was busy
    # in every phase.
    fetching = {f.phase for f in result.sessions if f.statement == "WITH"}
    assert fetching == {"before", "hold", "after"}, result.sessions
    assert all(0 < f.busy <= 1 and f.by for f in result.sessions), result.sessions
    with psycopg.connect(db_url) as conn:
        still = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (HOLDER_APP,)
        ).fetchone()
    assert still == (0,)
