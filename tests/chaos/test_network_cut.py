"""Scenario 3: the network between workers and PostgreSQL drops mid-fetch and mid-ack."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit

from tests.chaos.proxy import CuttingProxy
from tests.chaos.support import (
    REDELIVERY_WAIT_S,
    Figures,
    FinishCounter,
    Fleet,
    Runs,
    job_status_counts,
    recovery_after,
    report,
    running_ids,
    seed,
    verdict,
    wait_all_completed,
    wait_finished,
    wait_ids_finished,
    wait_progress,
)

MESSAGES = 10_000
#: Which statement each cut interrupts: its request reaches the server (and commits), its
#: reply never reaches the worker, and every connection through the proxy drops with it.
CUTS = ["fetch", "ack", "fetch", "ack"]
DOWN_S = 1.0
RECOVERY_BOUND_S = 20.0


def test_connection_cuts_mid_fetch_and_mid_ack_lose_nothing(
    db_url: str, chaos_broker: str, chaos_log: Path, chaos_report: Path
) -> None:
    ids = range(1, MESSAGES + 1)
    seed(db_url, chaos_broker, ids)
    target = urlsplit(db_url)
    assert target.hostname is not None and target.port is not None
    with CuttingProxy(target.hostname, target.port) as proxy:
        fleet = Fleet(proxy.url_for(chaos_broker), chaos_log)
        cuts: list[tuple[str, float, float, set[int]]] = []
        started = time.monotonic()
        progress = FinishCounter(chaos_log)
        try:
            fleet.start(["w1", "w2"])
            for k, kind in enumerate(CUTS, start=1):
                wait_progress(progress, MESSAGES * k // (len(CUTS) + 1), f"cut {k}'s turn")
                proxy.cut_after(kind, DOWN_S)
                _, cut_at, restored_at = proxy.wait_cut(30)
                snap = running_ids(db_url)  # nothing reaches the database until restored_at
                cuts.append((kind, cut_at, restored_at, snap))
                # One cut at a time: the next waits until this one's messages are done.
                wait_ids_finished(
                    chaos_log, snap, RECOVERY_BOUND_S, f"the messages in flight at cut {k}"
                )
            wait_finished(chaos_log, MESSAGES, 180, "network cuts")
            wall = time.monotonic() - started
            wait_all_completed(db_url, MESSAGES, REDELIVERY_WAIT_S)
            time.sleep(1.5)
            assert fleet.all_running(), fleet.logs_tail()
            logs = {name: w.log_text() for name, w in fleet.workers.items()}
        finally:
            fleet.stop()
    runs = Runs.read(chaos_log)
    in_flight: set[int] = set().union(*(snap for *_, snap in cuts))
    dups, lost = verdict(runs, ids, in_flight)
    per_cut = [recovery_after(runs, cut_at, snap) for _, cut_at, _, snap in cuts]
    recovery = max(per_cut)
    assert recovery < RECOVERY_BOUND_S, recovery
    assert job_status_counts(db_url) == {"completed": MESSAGES}
    # Each worker noticed and reconnected by itself.
    for name, text in logs.items():
        assert "Connection to broker lost" in text or "Cannot connect" in text, (name, text[-2000:])
    report(
        Figures(
            scenario="3-network-cut",
            messages=MESSAGES,
            faults=len(cuts),
            fault_kind="cuts",
            duplicates=dups,
            lost=lost,
            in_flight_at_faults=len(in_flight),
            recovery_s=round(recovery, 2),
            wall_s=round(wall, 1),
            extra={
                "cut_during": ",".join(kind for kind, *_ in cuts),
                "down_s": DOWN_S,
                "recovery_per_cut_s": ",".join(f"{r:.1f}" for r in per_cut),
            },
        ),
        chaos_report,
    )
