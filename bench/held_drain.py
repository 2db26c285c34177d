"""A held snapshot against a worker draining a backlog: the drain rate before, during and after.

One real ``celery worker`` (threads pool, 4 threads, ``safetyapp.noop`` tasks) drains a backlog
that never runs out: once a second, when fewer than ``--backlog / 2`` messages wait, batches of
real messages (inserted as ``publish`` writes them) bring it back to ``--backlog``. Phases:

``warmup`` (until autovacuum has visited ``jobs`` once, at most ``--warmup``, default 180 s)
    the worker drains a new table until autovacuum has vacuumed and analysed ``jobs`` once, as
    on a table in service; not compared;
``before`` (``--before``, default 60 s)
    no snapshot is held: the reference rate, over a whole number of ``autovacuum_naptime``
    (1 min by default) so that it averages over autovacuum's passes;
``hold`` (``--hold``, default 240 s)
    another session holds a REPEATABLE READ snapshot, idle in transaction, so no row version
    dead since it was taken can be removed;
``after`` (``--after``, default 60 s)
    that transaction has ended; nothing else is done (no manual ``VACUUM``): what autovacuum and
    the fetches themselves clean up is what the worker gets.

Once a second the messages completed since a few seconds ago are counted, per second of their
``finished_at``. From that series it reports the drain rate before (msg/s), the rate over the last
60 s of the hold and its ratio to before, the rate in each 10 s window of every phase (before's
own windows, slowest to fastest, show how far a 10 s window strays when nothing changes), the
first window after the release at >= 95 % and at >= 100 % of before and the slowest one after it,
and the size of ``jobs``, its indexes and its TOAST, how many autovacuums of ``jobs`` had
finished and when the last one did, at the end of each phase. The goal it
measures: over the last minute of a 4-minute hold the drain rate stays at least 50 % of before,
and it is back to 100 % within 10 s of the release.

Run (a throwaway embedded PostgreSQL unless ``--url`` is given; 7 to 9 minutes by default)::

    python -m bench.held_drain
    python -m bench.held_drain --before 60 --hold 90 --after 30 --json out.json
    python -m bench.held_drain --url postgresql://postgres@host/db
    python -m bench.held_drain --slots 2 --after 90   # a ring of 2 of the schema's 8 slots

With ``--sessions`` it also says where the worker's database time goes, for the last
``hold_last`` seconds of each of before and the hold and the first window after the release:
what each of the worker's sessions was doing (``pg_stat_activity`` read every 10 ms: running,
idle, or waiting, and on what), each named after the statement it ran most when busy (``WITH``:
the fetch, ``ack_fetch``; ``SELECT``: the housekeeping, ``rotate()`` and ``sweep()``)::

    python -m bench.held_drain --warmup 30 --before 60 --hold 150 --after 30 --sessions

The test ``tests/chaos/test_held_drain.py`` runs it for about 40 seconds.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.held_snapshot import (
    held_snapshot,
    in_fresh_database,
    insert_messages,
    log_to_stderr,
    noop_worker,
    sample_payload,
)

#: Completions are recounted for the seconds from this long before the previous sample on, so a
#: second's count is final once no ack transaction that started in it is still uncommitted.
RECOUNT_LAG_S = 5
#: Rows per INSERT when topping the backlog up.
INSERT_BATCH = 5000
# The messages of ``queue`` completed from second ``since`` on, per second of ``finished_at``
# (the ack sets it to now(): the start of the ack transaction). Found through the partial index
# jobs_completed (finished_at) WHERE status = 'completed': the range holds only the rows
# completed in the last few seconds, a row is never updated once completed, so every entry
# points at a live tuple; the dead versions the held snapshot keeps (in the heap and in the
# dequeue index) are never read, and the cost follows the rate, not the bloat. A count of all
# completed rows would grow with the run, and a count of the pending ones walks the dead
# entries of jobs_dequeue that the snapshot keeps.
COUNT_SINCE = """
SELECT floor(extract(epoch FROM finished_at))::bigint, count(*)
  FROM pgskip.jobs
 WHERE status = 'completed' AND finished_at >= to_timestamp(%(since)s) AND queue = %(queue)s
 GROUP BY 1
"""
NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"


def _now(conn: psycopg.Connection[Any]) -> float:
    row = conn.execute(NOW).fetchone()
    assert row is not None
    return float(row[0])


class Feeder(threading.Thread):
    """Once a second: counts the completions, then tops the backlog up to ``backlog``.

    ``per_second`` maps an epoch second (of ``finished_at``, the database's clock) to the
    messages completed in it; the seconds from ``RECOUNT_LAG_S`` before the previous sample on
    are recounted each time, so acks that commit late are counted in their own second.
    """

    def __init__(self, url: str, queue: str, payload: str, backlog: int):
        super().__init__(name="held-drain-feeder", daemon=True)
        self.url, self.queue, self.payload, self.backlog = url, queue, payload, backlog
        self.stop_event = threading.Event()
        self.publishing = threading.Event()
        self.publishing.set()
        self.per_second: dict[int, int] = {}
        self.completed = 0
        self.published = 0
        self.min_waiting: int | None = None  # the smallest backlog seen before a top-up
        self.error: BaseException | None = None
        self._since = 0

    @property
    def waiting(self) -> int:
        return self.published - self.completed

    def sample(self, conn: psycopg.Connection[Any]) -> None:
        now = int(_now(conn))
        rows = conn.execute(COUNT_SINCE, {"since": self._since, "queue": self.queue}).fetchall()
        for second in [s for s in self.per_second if s >= self._since]:
            del self.per_second[second]
        self.per_second.update((int(s), int(n)) for s, n in rows)
        self.completed = sum(self.per_second.values())
        self._since = now - RECOUNT_LAG_S

    def top_up(self, conn: psycopg.Connection[Any]) -> None:
        waiting = self.waiting
        if self.published and (self.min_waiting is None or waiting < self.min_waiting):
            self.min_waiting = waiting
        if waiting >= self.backlog // 2:
            return
        missing = self.backlog - waiting
        while missing > 0:
            n = min(missing, INSERT_BATCH)
            insert_messages(conn, self.queue, self.payload, n)
            self.published += n
            missing -= n

    def run(self) -> None:
        try:
            with psycopg.connect(
                self.url, autocommit=True, application_name="held-drain-feeder"
            ) as conn:
                # Guard: the count goes through jobs_completed even if the statistics are off.
                conn.execute("SET enable_seqscan = off")
                self._since = int(_now(conn)) - RECOUNT_LAG_S
                next_at = time.monotonic()
                while not self.stop_event.is_set():
                    self.sample(conn)
                    if self.publishing.is_set():
                        self.top_up(conn)
                    next_at = max(next_at + 1.0, time.monotonic())
                    self.stop_event.wait(max(0.0, next_at - time.monotonic()))
                self.sample(conn)  # the last acks, after the worker stopped
        except BaseException as exc:  # reported by the caller
            self.error = exc


#: Seconds between two reads of what the worker's sessions are doing (``--sessions``).
SESSION_SAMPLE_S = 0.01
WORKER_APP = "kombu-pgskip"  # the application_name of the transport's sessions
SESSIONS = """
SELECT extract(epoch FROM clock_timestamp())::float8, pid,
       CASE WHEN state LIKE 'idle%%' THEN 'idle'
            WHEN wait_event_type IS NOT NULL THEN wait_event_type || ':' || wait_event
            ELSE 'running' END,
       split_part(ltrim(query), ' ', 1)
  FROM pg_stat_activity
 WHERE datname = current_database() AND application_name = %(app)s
"""


class SessionSampler(threading.Thread):
    """``--sessions``: what each of the worker's sessions is doing, every ``SESSION_SAMPLE_S``
    (on the database's clock)."""

    def __init__(self, url: str):
        super().__init__(name="held-drain-sessions", daemon=True)
        self.url = url
        self.stop_event = threading.Event()
        # (time, pid, what it was doing, the first word of its statement)
        self.samples: list[tuple[float, int, str, str]] = []
        self.ticks: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(
                self.url, autocommit=True, application_name="held-drain-sessions"
            ) as conn:
                while not self.stop_event.is_set():
                    rows = conn.execute(SESSIONS, {"app": WORKER_APP}).fetchall()
                    if rows:
                        self.ticks.append(float(rows[0][0]))
                    self.samples.extend((float(t), int(p), str(w), str(q)) for t, p, w, q in rows)
                    self.stop_event.wait(SESSION_SAMPLE_S)
        except BaseException as exc:  # reported by the caller
            self.error = exc

    def sessions(self, phase: str, start: float, end: float) -> list[SessionFigures]:
        """Each session busy in [start, end): the share of the samples it was not idle, by what
        it was doing, named after the statement it ran most when busy."""
        ticks = sum(1 for t in self.ticks if start <= t < end)
        doing: dict[int, Counter[str]] = defaultdict(Counter)
        ran: dict[int, Counter[str]] = defaultdict(Counter)
        for t, pid, what, query in self.samples:
            if start <= t < end and what != "idle":
                doing[pid][what] += 1
                ran[pid][query] += 1
        out = []
        for pid, by in doing.items():
            busy = by.total()
            if not ticks or busy < ticks * 0.005:
                continue
            out.append(
                SessionFigures(
                    phase=phase,
                    pid=pid,
                    statement=ran[pid].most_common(1)[0][0],
                    busy=busy / ticks,
                    by={w: n / ticks for w, n in by.most_common()},
                )
            )
        return sorted(out, key=lambda f: -f.busy)


@dataclass
class SessionFigures:
    phase: str
    pid: int
    statement: str  # the first word of the statement it ran most when busy
    busy: float  # the share of the samples it was not idle
    by: dict[str, float]  # that share by what it was doing: running, or a wait event


@dataclass
class PhaseFigures:
    name: str
    seconds: int  # whole seconds of completions counted
    completed: int
    rate: float  # msg/s
    ratio: float  # rate / the rate before
    table_bytes: int  # jobs (main fork) at the end of the phase
    index_bytes: int
    toast_bytes: int  # TOAST table and its index
    autovacuums: int  # autovacuum runs on jobs finished so far (cumulative)
    last_autovacuum: int | None  # when the last one ended, seconds after ``before`` started


@dataclass
class Window:
    phase: str
    start: int  # seconds after the phase started
    seconds: int
    rate: float
    ratio: float


@dataclass
class DrainResult:
    backlog: int
    before_rate: float = 0.0
    hold_last_seconds: int = 0
    hold_last_rate: float = 0.0
    hold_last_ratio: float = 0.0
    phases: list[PhaseFigures] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)  # before, hold, after: --window s each
    # the slowest and the fastest of before's own windows, as ratios to before: how far a window
    # strays from its phase's rate when nothing changes
    before_spread: tuple[float, float] | None = None
    back_to_95_at: int | None = None  # start of the first window after release at >= 95 %
    back_to_100_at: int | None = None  # ... at >= 100 %
    lowest_after: Window | None = None  # the slowest window after the release
    holder_pid: int | None = None
    published: int = 0
    by_status: dict[str, int] = field(default_factory=dict)  # the queue's rows at the end
    sampled_completed: int = 0  # completions the per-second series counted
    min_backlog: int | None = None  # smallest backlog the feeder saw before a top-up
    per_second: list[tuple[int, int]] = field(default_factory=list)  # (s since before, count)
    # --sessions: before (its last hold_last s), hold (its last hold_last s), after (its first
    # window)
    sessions: list[SessionFigures] = field(default_factory=list)

    def phase(self, name: str) -> PhaseFigures:
        return next(p for p in self.phases if p.name == name)

    def table(self) -> str:
        mb = 1 / (1024 * 1024)
        lines = [
            "| phase | seconds | completed | msg/s | % of before | jobs MB | indexes MB "
            "| TOAST MB | autovacuums of jobs so far | the last ended at s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in self.phases:
            lines.append(
                f"| {p.name} | {p.seconds} | {p.completed:,} | {p.rate:,.0f} | {p.ratio:.0%} "
                f"| {p.table_bytes * mb:,.1f} | {p.index_bytes * mb:,.1f} "
                f"| {p.toast_bytes * mb:,.1f} | {p.autovacuums} "
                f"| {'-' if p.last_autovacuum is None else p.last_autovacuum} |"
            )
            if p.name == "hold":
                lines.append(
                    f"| hold, last {self.hold_last_seconds} s | {self.hold_last_seconds} | - "
                    f"| {self.hold_last_rate:,.0f} | {self.hold_last_ratio:.0%} | | | | | |"
                )
        lines += ["", "| phase | window | msg/s | % of before |", "|---|---|---|---|"]
        for w in self.windows:
            lines.append(
                f"| {w.phase} | {w.start}-{w.start + w.seconds} s | {w.rate:,.0f} | {w.ratio:.0%} |"
            )

        def at(start: int | None) -> str:
            return "none" if start is None else f"the window starting {start} s after the release"

        spread = (
            "none"
            if self.before_spread is None
            else f"{self.before_spread[0]:.0%} to {self.before_spread[1]:.0%} of before"
        )
        lines += [
            "",
            f"before's own windows: {spread}",
            f"back to >= 95 % of before: {at(self.back_to_95_at)}",
            f"back to >= 100 % of before: {at(self.back_to_100_at)}",
            "slowest after the release: "
            + (
                "none"
                if self.lowest_after is None
                else f"{self.lowest_after.ratio:.0%} of before, {at(self.lowest_after.start)}"
            ),
            f"published {self.published:,}; at the end: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(self.by_status.items()))
            + f"; smallest backlog before a top-up: {self.min_backlog}",
        ]
        if self.sessions:
            lines += [
                "",
                "| phase | worker session (its statement) | busy | doing |",
                "|---|---|---|---|",
            ]
            for f in self.sessions:
                doing = ", ".join(f"{w} {v:.1%}" for w, v in list(f.by.items())[:5])
                lines.append(f"| {f.phase} | {f.pid} ({f.statement}) | {f.busy:.1%} | {doing} |")
        return "\n".join(lines)


Sizes = tuple[int, int, int, int, float | None]


def _sizes(conn: psycopg.Connection[Any]) -> Sizes:
    """``jobs`` (summed over its partitions when it has some): main fork, indexes, TOAST (with
    its index) in bytes; its autovacuum count and when the last one ended (epoch seconds)."""
    row = conn.execute(
        "SELECT sum(pg_relation_size(c.oid)), sum(pg_indexes_size(c.oid)),"
        " sum(coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0)),"
        " sum(coalesce(pg_stat_get_autovacuum_count(c.oid), 0)),"
        " extract(epoch FROM max(pg_stat_get_last_autovacuum_time(c.oid)))::float8"
        " FROM pg_partition_tree('pgskip.jobs') AS t JOIN pg_class c ON c.oid = t.relid"
        " WHERE t.isleaf"
    ).fetchone()
    assert row is not None
    last = None if row[4] is None else float(row[4])
    return int(row[0]), int(row[1]), int(row[2]), int(row[3]), last


def _sum(per_second: dict[int, int], start: int, end: int) -> int:
    return sum(per_second.get(s, 0) for s in range(start, end))


def run(
    db_url: str,
    *,
    warmup: int = 180,
    before: int = 60,
    hold: int = 240,
    after: int = 60,
    backlog: int = 20_000,
    window: int = 10,
    hold_last: int = 60,
    start_timeout: float = 60.0,
    sessions: bool = False,
    log: Callable[[str], None] | None = None,
) -> DrainResult:
    """Run the phases against the migrated database ``db_url`` and return the figures;
    ``sessions``: with where the worker's database time goes (``--sessions``)."""
    say = log or (lambda msg: None)
    broker_url = db_url.replace("postgresql://", "pgskip://", 1)
    queue = f"drain.{uuid.uuid4().hex[:8]}"
    feeder = Feeder(db_url, queue, sample_payload(broker_url, queue), backlog)
    result = DrainResult(backlog=backlog)
    spans: dict[str, tuple[int, int]] = {}  # phase -> [start, end) in epoch seconds
    sizes: dict[str, Sizes] = {}

    with psycopg.connect(db_url, autocommit=True) as conn:

        def phase(name: str, seconds: int, done: Callable[[], bool] | None = None) -> None:
            """From the next whole second of the database's clock, ``seconds`` whole seconds, or
            the whole seconds until ``done()`` (checked every second) if that comes first."""
            start = math.ceil(_now(conn))
            end = start + seconds
            say(f"phase {name}: {seconds}s" + (" at most" if done else ""))
            while (now := _now(conn)) < end and not (done and done()):
                time.sleep(min(1.0 if done else 10.0, end - now))
                if feeder.error is not None:
                    raise RuntimeError(f"the feeder failed: {feeder.error}") from feeder.error
                if done is None or round(now - start) % 10 == 0:
                    say(f"  {name}: {feeder.completed:,} completed, {feeder.waiting:,} waiting")
            spans[name] = (start, max(start, min(end, math.floor(now))))
            sizes[name] = _sizes(conn)

        sampler = SessionSampler(db_url) if sessions else None
        if sampler is not None:
            sampler.start()
        feeder.start()
        try:
            with noop_worker(broker_url, queue):
                deadline = time.monotonic() + start_timeout
                while feeder.completed == 0:
                    if feeder.error is not None:
                        raise RuntimeError(f"the feeder failed: {feeder.error}") from feeder.error
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"nothing completed within {start_timeout:.0f}s"
                            f" ({feeder.published:,} published)"
                        )
                    time.sleep(0.2)
                if warmup > 0:
                    phase("warmup", warmup, done=lambda: _sizes(conn)[3] > 0)
                phase("before", before)
                with held_snapshot(db_url) as pid:
                    result.holder_pid = pid
                    phase("hold", hold)
                phase("after", after)
                feeder.publishing.clear()
            # the worker is stopped (warm shutdown): nothing completes any more
        finally:
            feeder.stop_event.set()
            feeder.join(timeout=30)
            if sampler is not None:
                sampler.stop_event.set()
                sampler.join(timeout=30)
        if feeder.error is not None:
            raise RuntimeError(f"the feeder failed: {feeder.error}") from feeder.error
        if sampler is not None and sampler.error is not None:
            raise RuntimeError(f"the session sampler failed: {sampler.error}") from sampler.error
        result.by_status = {
            str(s): int(n)
            for s, n in conn.execute(
                "SELECT status::text, count(*) FROM pgskip.jobs WHERE queue = %s GROUP BY 1",
                (queue,),
            ).fetchall()
        }

    per_second = feeder.per_second
    result.published = feeder.published
    result.sampled_completed = sum(per_second.values())
    result.min_backlog = feeder.min_waiting

    b0, b1 = spans["before"]
    result.before_rate = _sum(per_second, b0, b1) / max(1, b1 - b0)

    def ratio(rate: float) -> float:
        return rate / result.before_rate if result.before_rate else 0.0

    for name in spans:
        s0, s1 = spans[name]
        done = _sum(per_second, s0, s1)
        rate = done / max(1, s1 - s0)
        table, index, toast, autovacuums, last = sizes[name]
        result.phases.append(
            PhaseFigures(
                name=name,
                seconds=s1 - s0,
                completed=done,
                rate=rate,
                ratio=ratio(rate),
                table_bytes=table,
                index_bytes=index,
                toast_bytes=toast,
                autovacuums=autovacuums,
                last_autovacuum=None if last is None else math.floor(last) - b0,
            )
        )
        if name == "warmup":
            continue
        for w0 in range(s0, s1 - window + 1, window):
            w_rate = _sum(per_second, w0, w0 + window) / window
            result.windows.append(Window(name, w0 - s0, window, w_rate, ratio(w_rate)))

    h0, h1 = spans["hold"]
    last0 = max(h0, h1 - hold_last)
    result.hold_last_seconds = h1 - last0
    result.hold_last_rate = _sum(per_second, last0, h1) / max(1, h1 - last0)
    result.hold_last_ratio = ratio(result.hold_last_rate)
    before_ratios = [w.ratio for w in result.windows if w.phase == "before"]
    if before_ratios:
        result.before_spread = (min(before_ratios), max(before_ratios))
    after_windows = [w for w in result.windows if w.phase == "after"]
    result.back_to_95_at = next((w.start for w in after_windows if w.ratio >= 0.95), None)
    result.back_to_100_at = next((w.start for w in after_windows if w.ratio >= 1.0), None)
    result.lowest_after = min(after_windows, key=lambda w: w.rate, default=None)
    if sampler is not None:
        a0 = spans["after"][0]
        for name, (s0, s1) in (
            ("before", (max(b0, b1 - hold_last), b1)),
            ("hold", (last0, h1)),
            ("after", (a0, a0 + window)),
        ):
            result.sessions += sampler.sessions(name, s0, s1)
    result.per_second = sorted((s - b0, n) for s, n in per_second.items())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="superuser URL of a database (default: embedded server)")
    parser.add_argument(
        "--warmup", type=int, default=180, help="at most this long until autovacuum ran (s)"
    )
    parser.add_argument("--before", type=int, default=60, help="seconds")
    parser.add_argument("--hold", type=int, default=240, help="seconds")
    parser.add_argument("--after", type=int, default=60, help="seconds")
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=10, help="seconds per window")
    parser.add_argument(
        "--slots",
        type=int,
        help="go round only the first N slots of jobs' ring (2 to the slots the schema has; "
        "the fetch still reads every partition)",
    )
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="also say what the worker's sessions were doing, by phase",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    def measure(url: str) -> DrainResult:
        if args.slots is not None:
            with psycopg.connect(url, autocommit=True) as conn:
                # The slots past N stay empty: rotate() goes round 1 to N.
                conn.execute("UPDATE pgskip.jobs_rotation SET slots = %s", (args.slots,))
        return run(
            url,
            warmup=args.warmup,
            before=args.before,
            hold=args.hold,
            after=args.after,
            backlog=args.backlog,
            window=args.window,
            sessions=args.sessions,
            log=log_to_stderr,
        )

    result = in_fresh_database(args.url, "held_drain", measure)
    print(result.table())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
