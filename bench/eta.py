"""ETA precision: how late tasks with a countdown start after their ETA, idle and under load.

A real ``celery worker`` (``bench.benchapp``, threads pool, 4 threads, transport defaults)
consumes a queue. A publisher sends ``bench.noop`` tasks in ``--tasks`` steps, ``--gap``
seconds apart (1.37 s: longer than the worker's 1 s fallback poll and out of step with it, so
that consecutive ETAs of a range fall due apart, as when tasks are published one by one; 0:
all at once, a burst). Each step publishes one task of every countdown range, with its ETA
given explicitly (``apply_async(eta=...)``, durable publish); the countdowns of successive
steps are spread evenly over the range. Each task stamps the time it starts (``time.time()``,
the same clock); its lateness is that stamp minus its ETA.

Countdown ranges (``--ranges``):

``1-12s``
    1 to 12 s: those of at most ``eta_threshold`` (2 s) are delivered at once and held by the
    worker until due (``held``); the others wait in the database as ``scheduled`` and are
    promoted to ``pending`` when due (``stored``);
``1min``
    60 to 66 s (stored);
``1h``
    3,600 to 3,606 s (stored); only with ``--hour``, which adds an hour to every load.

Loads (``--loads``), each with a worker of its own:

``idle``
    nothing else to do;
``same-queue``
    a backlog of ``--backlog`` tasks on the same queue, topped up to ``--backlog`` whenever
    half of it has been drained (checked every 0.1 s), so the worker drains it without pause;
    a due message is fetched in due order, behind the messages that were due before it;
``other-queue``
    the same backlog on a second queue the worker consumes too.

Reports, per load, range and path (held, stored, and both), how many tasks started and their
lateness p50, p99 and max in ms (nearest rank: of 30 tasks the p99 is the largest), and the
rate at which the backlog was drained meanwhile; the JSON has every task's countdown, path and
lateness. The goal: p99 under 100 ms.

Run (a throwaway embedded PostgreSQL, fsync off, unless ``--url`` is given; about 6 minutes
by default)::

    python -m bench.eta
    python -m bench.eta --loads idle --ranges 1-12s --tasks 30 --gap 0   # a burst
    python -m bench.eta --hour --json eta-hour.json     # adds an hour per load
    python -m bench.eta --url postgresql://postgres@host/db

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg

from .brokers import Broker
from .common import code_state, machine_info, percentile
from .held_snapshot import in_fresh_database, log_to_stderr
from .workers import StampDir, Worker, new_queue, publisher_app, warm_up

#: Countdown ranges, in seconds: (first, last).
RANGES = {"1-12s": (1.0, 12.0), "1min": (60.0, 66.0), "1h": (3600.0, 3606.0)}
LOADS = ("idle", "same-queue", "other-queue")
#: The task index of the backlog's tasks (the ETA tasks count from 0; warm-up is -1).
BACKLOG_INDEX = -2
#: How long after the last ETA a task that has not started is given up.
GRACE_S = 60.0
#: Copies of one real message, each with a fresh task id: the rows ``publish`` writes,
#: without the publisher's CPU (as bench.held_snapshot.insert_messages).
INSERT_COPIES = """
INSERT INTO pgskip.jobs (queue, payload, task_name, task_id)
SELECT %(queue)s, jsonb_set(%(payload)s::jsonb, '{headers,id}', to_jsonb(u))::json, 'bench.noop', u
  FROM (SELECT gen_random_uuid()::text AS u FROM generate_series(1, %(n)s)) AS g
"""
PENDING = "SELECT count(*) FROM pgskip.jobs WHERE queue = %s AND status = 'pending'"
STATUS = "SELECT status::text FROM pgskip.jobs WHERE task_id = %s"
#: Spreads the countdowns of successive steps evenly over a range, in no particular order.
GOLDEN = (5**0.5 - 1) / 2
#: Seconds between two steps: longer than the worker's fallback poll (``polling_interval``,
#: 1 s), and not a multiple of it, so consecutive ETAs of a range fall due apart, as when tasks
#: are published one by one, at every phase of that poll.
GAP_S = 1.37


class EtaWorker(Worker):
    """A :class:`~bench.workers.Worker` that consumes ``extra`` queues besides its own."""

    def __init__(self, *args: Any, extra: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra = extra

    def argv(self) -> list[str]:
        argv = super().argv()
        at = argv.index("-Q") + 1
        argv[at] = ",".join([self.queue, *self.extra])
        return argv


class Backlog(threading.Thread):
    """Keeps ``size`` tasks waiting in ``queue``: every 0.1 s, once fewer than half are left,
    inserts what is missing."""

    def __init__(self, db_url: str, queue: str, payload: str, size: int) -> None:
        super().__init__(name="eta-backlog", daemon=True)
        self.db_url, self.queue, self.payload, self.size = db_url, queue, payload, size
        self.stop_event = threading.Event()
        self.inserted = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.db_url, autocommit=True, application_name="eta-backlog") as c:
                while not self.stop_event.is_set():
                    row = c.execute(PENDING, (self.queue,)).fetchone()
                    waiting = int(row[0]) if row else 0
                    if waiting < self.size // 2:
                        n = self.size - waiting
                        c.execute(
                            INSERT_COPIES, {"queue": self.queue, "payload": self.payload, "n": n}
                        )
                        self.inserted += n
                    self.stop_event.wait(0.1)
        except BaseException as exc:  # reported by the caller
            self.error = exc


@dataclass
class Figures:
    load: str
    countdowns: str
    path: str  # held (by the worker, in memory), stored (in the database), all
    tasks: int
    started: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    min_ms: float | None


@dataclass
class LoadResult:
    load: str
    backlog: int
    backlog_drained_per_s: float | None  # backlog tasks started per second meanwhile
    figures: list[Figures] = field(default_factory=list)
    # Every ETA task: (range, countdown s, path, lateness ms or None if it did not start).
    samples: list[tuple[str, float, str, float | None]] = field(default_factory=list)


def _figures(load: str, countdowns: str, path: str, tasks: int, late: list[float]) -> Figures:
    ordered = sorted(late)
    return Figures(
        load=load,
        countdowns=countdowns,
        path=path,
        tasks=tasks,
        started=len(ordered),
        p50_ms=percentile(ordered, 50),
        p99_ms=percentile(ordered, 99),
        max_ms=ordered[-1] if ordered else None,
        min_ms=ordered[0] if ordered else None,
    )


def _sample_payload(app: Any, db_url: str, queue: str) -> str:
    """A backlog task (``bench.noop`` with index ``BACKLOG_INDEX``) as pgskip stores it for
    ``queue``: published, read and deleted."""
    app.tasks["bench.noop"].apply_async(kwargs={"i": BACKLOG_INDEX}, queue=queue)
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "DELETE FROM pgskip.jobs WHERE queue = %s RETURNING payload::text", (queue,)
        ).fetchone()
    if row is None:
        raise RuntimeError(f"the sample message for {queue} was not written")
    return str(row[0])


def measure(
    db_url: str,
    load: str,
    *,
    ranges: list[str],
    tasks: int,
    backlog: int,
    gap: float = GAP_S,
    say: Any = log_to_stderr,
) -> LoadResult:
    """One load: a worker of its own, ``tasks`` steps ``gap`` seconds apart, each publishing
    one ETA task of every range; then waits until they have all started (at most ``GRACE_S``
    after the last ETA)."""
    broker_url = db_url.replace("postgresql://", "pgskip://", 1)
    broker = Broker(name="pgskip", label="pgskip", url=broker_url, db_url=db_url)
    queue = new_queue("eta")
    other = new_queue("eta-load")
    backlog_queue = {"same-queue": queue, "other-queue": other}.get(load)
    app = publisher_app(broker, queue)
    stamps = StampDir()
    worker = EtaWorker(
        broker, queue, stamps, extra=[other] if load == "other-queue" else [], name=f"eta-{load}"
    )
    feeder = None
    if backlog_queue is not None:
        feeder = Backlog(
            db_url, backlog_queue, _sample_payload(app, db_url, backlog_queue), backlog
        )
    result = LoadResult(load=load, backlog=backlog if feeder else 0, backlog_drained_per_s=None)
    try:
        worker.start()
        if not warm_up(app, stamps):
            raise RuntimeError(f"the worker did not start:\n{worker.log_tail()}")
        if feeder is not None:
            feeder.start()
            if not stamps.wait_index(BACKLOG_INDEX, 60.0):
                raise RuntimeError(f"the backlog is not being drained:\n{worker.log_tail()}")
        # Step k publishes one task of each range, gap seconds after step k - 1; its countdown
        # is k times the golden ratio's fraction along the range (spread evenly, in no order).
        plan = [
            (k, name, lo + (hi - lo) * ((k * GOLDEN) % 1.0))
            for k in range(tasks)
            for name in ranges
            for lo, hi in (RANGES[name],)
        ]
        say(f"{load}: publishing {len(plan)} ETA tasks ({', '.join(ranges)}), every {gap} s")
        task = app.tasks["bench.noop"]
        etas: dict[int, float] = {}
        stored: set[int] = set()
        t_publish = time.time()
        with psycopg.connect(db_url, autocommit=True) as conn:
            for i, (k, _, countdown) in enumerate(plan):
                time.sleep(max(0.0, t_publish + k * gap - time.time()))
                eta = datetime.now(timezone.utc) + timedelta(seconds=countdown)
                task_id = task.apply_async(kwargs={"i": i}, eta=eta).id
                etas[i] = eta.timestamp()
                # Where it waits, read at once: the worker holds it, or the database does.
                row = conn.execute(STATUS, (task_id,)).fetchone()
                if row is not None and row[0] == "scheduled":
                    stored.add(i)
        deadline = max(etas.values()) + GRACE_S
        while time.time() < deadline:
            started = {i for i, _ in stamps.read() if i >= 0}
            if len(started) >= len(plan):
                break
            if feeder is not None and feeder.error is not None:
                raise RuntimeError(f"the backlog feeder failed: {feeder.error}") from feeder.error
            time.sleep(min(1.0, max(0.05, (deadline - time.time()) / 10)))
        stamped = stamps.read()
        starts = {i: t for i, t in stamped if i >= 0}
        if feeder is not None and starts:
            end = max(starts.values())
            drained = sum(1 for i, t in stamped if i == BACKLOG_INDEX and t_publish <= t <= end)
            result.backlog_drained_per_s = drained / max(1e-9, end - t_publish)
        for name in ranges:
            mine = [i for i, (_, r, _) in enumerate(plan) if r == name]
            by_path: dict[str, list[int]] = {
                "held": [i for i in mine if i not in stored],
                "stored": [i for i in mine if i in stored],
                "all": mine,
            }
            for path, members in by_path.items():
                if not members:
                    continue
                late = [1000.0 * (starts[i] - etas[i]) for i in members if i in starts]
                result.figures.append(_figures(load, name, path, len(members), late))
        for i, (_, name, countdown) in enumerate(plan):
            path = "stored" if i in stored else "held"
            late_ms = round(1000.0 * (starts[i] - etas[i]), 2) if i in starts else None
            result.samples.append((name, round(countdown, 3), path, late_ms))
        return result
    finally:
        if feeder is not None:
            feeder.stop_event.set()
            feeder.join(timeout=10)
        worker.stop()
        stamps.cleanup()
        app.close()


def table(results: list[LoadResult]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    lines = [
        "| load | countdowns | path | tasks | started | p50 ms | p99 ms | max ms | min ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for f in r.figures:
            lines.append(
                f"| {f.load} | {f.countdowns} | {f.path} | {f.tasks} | {f.started} "
                f"| {ms(f.p50_ms)} | {ms(f.p99_ms)} | {ms(f.max_ms)} | {ms(f.min_ms)} |"
            )
    lines.append("")
    for r in results:
        if r.backlog:
            rate = "-" if r.backlog_drained_per_s is None else f"{r.backlog_drained_per_s:,.0f}"
            lines.append(f"{r.load}: backlog of {r.backlog:,} drained at {rate} tasks/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="superuser URL of a database (default: embedded server)")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"of {', '.join(LOADS)}")
    parser.add_argument("--ranges", default="1-12s,1min", help="of 1-12s, 1min (1h: --hour)")
    parser.add_argument("--hour", action="store_true", help="add the 1h range (an hour per load)")
    parser.add_argument("--tasks", type=int, default=30, help="ETA tasks per range and load")
    parser.add_argument(
        "--gap", type=float, default=GAP_S, help="seconds between steps (0: all at once)"
    )
    parser.add_argument("--backlog", type=int, default=2000, help="tasks kept waiting under load")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    loads = [x for x in args.loads.split(",") if x]
    ranges = [x for x in args.ranges.split(",") if x] + (["1h"] if args.hour else [])
    unknown = [x for x in loads if x not in LOADS] + [x for x in ranges if x not in RANGES]
    if unknown:
        parser.error(f"unknown load or range {', '.join(unknown)}")
    if args.tasks < 1 or args.backlog < 2:
        parser.error("--tasks must be at least 1 and --backlog at least 2")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def run_all(url: str) -> list[LoadResult]:
        return [
            measure(url, load, ranges=ranges, tasks=args.tasks, backlog=args.backlog, gap=args.gap)
            for load in loads
        ]

    results = in_fresh_database(args.url, "eta", run_all)
    print(table(results))
    if args.json:
        out = {
            "bench": "eta",
            "started": started,
            "command": " ".join(["python -m bench.eta", *(sys.argv[1:] if argv is None else argv)]),
            "params": {
                "loads": loads,
                "ranges": {name: RANGES[name] for name in ranges},
                "tasks_per_range": args.tasks,
                "gap_s": args.gap,
                "backlog": args.backlog,
                "worker": "celery worker -P threads -c 4, transport defaults (eta_threshold 2 s)",
            },
            "machine": machine_info(),
            "code": code_state(),
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
