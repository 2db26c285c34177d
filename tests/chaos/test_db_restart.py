"""Scenario 2: PostgreSQL restarts twice (fast, immediate) while tasks are published and run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg

from kombu_pgskip.testing.embedded import EmbeddedPostgres
from tests.acceptance.conftest import wait_until
from tests.chaos.support import (
    TASK,
    Figures,
    FinishCounter,
    Fleet,
    Runs,
    publisher,
    refetched_after_crash,
    report,
    running_ids,
    seed,
    task_id,
    verdict,
    wait_ids_finished,
    wait_progress,
)

MESSAGES = 20_000
SEEDED = 10_000
PUBLISHERS = 2
#: From the start of a restart until every worker ran a task again: the restart itself, then
#: Celery's reconnect backoff (kombu retries after 0, 2, 4 ... s).
RECOVERY_BOUND_S = 30.0


class Publisher(threading.Thread):
    """Publishes its share of the ids with ``send_task``; remembers which calls raised."""

    def __init__(self, broker_url: str, ids: range) -> None:
        super().__init__(daemon=True)
        self.broker_url = broker_url
        self.ids = ids
        self.ok: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self.calls: list[tuple[int, float, float]] = []  # (id, call began, call returned)

    def run(self) -> None:
        app = publisher(self.broker_url)
        try:
            with app.producer_or_acquire() as producer:
                for msg in self.ids:
                    began = time.time()
                    try:
                        app.send_task(TASK, args=(msg,), task_id=task_id(msg), producer=producer)
                    except Exception as exc:
                        self.failed.append((msg, f"{type(exc).__name__}: {exc}"))
                    else:
                        self.ok.append(msg)
                    self.calls.append((msg, began, time.time()))
        finally:
            app.close()


def test_postgresql_restarts_lose_no_published_task(
    restartable_pg: EmbeddedPostgres,
    db_url: str,
    chaos_broker: str,
    chaos_log: Path,
    chaos_report: Path,
) -> None:
    ids = range(1, MESSAGES + 1)
    # Half the run waits in the queue from the start; the other half is published while the
    # workers run and the server restarts under the publishers.
    seed(db_url, chaos_broker, range(1, SEEDED + 1))
    share = (MESSAGES - SEEDED) // PUBLISHERS
    publishers = [
        Publisher(chaos_broker, range(SEEDED + 1 + k * share, SEEDED + 1 + (k + 1) * share))
        for k in range(PUBLISHERS)
    ]
    fleet = Fleet(chaos_broker, chaos_log)
    outages: list[tuple[str, float, float, set[int]]] = []
    recoveries: list[float] = []
    started = time.monotonic()
    progress = FinishCounter(chaos_log)
    try:
        fleet.start(["w1", "w2", "w3"])
        for p in publishers:
            p.start()
        for k, mode in enumerate(("fast", "immediate"), start=1):
            wait_progress(progress, MESSAGES * k // 3, f"restart {k}")
            assert all(p.is_alive() for p in publishers), "restart while publishing"
            before = running_ids(db_url)
            t0 = time.time()
            restartable_pg.restart(mode=mode)
            t1 = time.time()
            after = running_ids(db_url)
            outages.append((mode, t0, t1, before | after))

            # Every worker reconnects by itself and runs tasks again.
            def resumed(t1: float = t1) -> bool:
                runs = Runs.read(chaos_log)
                hosts = {e.host for ev in runs.starts.values() for e in ev if e.at > t1}
                return hosts >= set(fleet.workers)

            wait_until(resumed, RECOVERY_BOUND_S, f"every worker to run tasks after restart {k}")
            recoveries.append(time.time() - t0)
        for p in publishers:
            p.join(180)
            assert not p.is_alive(), "a publisher hung"
        ok = [*range(1, SEEDED + 1), *(m for p in publishers for m in p.ok)]
        failed = [m for p in publishers for m, _ in p.failed]
        wait_ids_finished(chaos_log, ok, 180, "every published task")
        wall = time.monotonic() - started
        time.sleep(1.5)
        assert fleet.all_running(), fleet.logs_tail()
    finally:
        fleet.stop()
    runs = Runs.read(chaos_log)
    in_flight: set[int] = set().union(*(snap for *_, snap in outages))
    # A publish under way during a restart may be stored twice: its INSERT committed, the
    # reply was lost with the connection, and Celery's publish retry inserted it again.
    mid_publish = {
        msg
        for p in publishers
        for msg, began, returned in p.calls
        for _, t0, t1, _ in outages
        if began <= t1 and returned >= t0
    }
    in_flight |= mid_publish
    refetched = set().union(
        *(refetched_after_crash(runs, t0, t1) for mode, t0, t1, _ in outages if mode == "immediate")
    )
    in_flight |= refetched
    dups, lost = verdict(runs, ok, in_flight, maybe=failed)
    assert len(ok) + len(failed) == MESSAGES
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM (SELECT task_id FROM pgskip.jobs GROUP BY 1 HAVING count(*) > 1)"
            " AS d"
        ).fetchone()
    stored_twice = int(row[0]) if row else 0
    errors = sorted({why for p in publishers for _, why in p.failed})
    figures = Figures(
        scenario="2-db-restart",
        messages=MESSAGES,
        faults=len(outages),
        fault_kind="restarts",
        duplicates=dups,
        lost=lost,
        in_flight_at_faults=len(in_flight),
        recovery_s=round(max(recoveries), 2),
        wall_s=round(wall, 1),
        extra={
            "publish_errors": len(failed),
            "mid_publish": len(mid_publish),
            "stored_twice": stored_twice,
            "refetched_after_crash": len(refetched),
            "failed_publishes_that_ran": len(set(failed) & set(runs.finishes)),
            "restart_s": ",".join(f"{m}={t1 - t0:.1f}" for m, t0, t1, _ in outages),
        },
    )
    report(figures, chaos_report)
    print("publish errors:", errors[:5])
    assert set(ids) == set(ok) | set(failed)
