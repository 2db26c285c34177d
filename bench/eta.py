"""ETA precision: how late tasks with a countdown start after their ETA, idle and under load.

A real ``celery worker`` (``bench.benchapp``, threads pool, 4 threads, transport defaults)
consumes a queue of each broker of ``--brokers`` in turn (default ``pgskip,rabbitmq,redis``,
named as in :mod:`bench.brokers`; also ``pgskip-async``, ``rabbitmq-confirm`` and
``redis-fsync``), under the same loads and countdown ranges. A publisher sends ``bench.noop``
tasks in ``--tasks`` steps, ``--gap`` seconds apart (1.37 s: longer than the pgskip worker's
1 s fallback poll and out of step with it, so that consecutive ETAs of a range fall due
apart, as when tasks are published one by one; 0: all at once, a burst). Each step publishes
one task of every countdown range, with its ETA given explicitly (``apply_async(eta=...)``;
on pgskip a durable publish); the countdowns of successive steps are spread evenly over the
range. Each task stamps the time it starts (``time.time()``, the same clock); its lateness is
that stamp minus its ETA (its first stamp, should it run twice).

Where a task waits until due (its path):

* on pgskip (a throwaway database), those of at most ``eta_threshold`` (2 s) are delivered at
  once and held by the worker until due (``held``); the others wait in the database as
  ``scheduled`` and are promoted to ``pending`` when due (``stored``), read from the database
  right after each publish;
* on RabbitMQ and Redis, every ETA message is delivered in publish order, whatever its
  countdown, and held by the worker until due (``held``).

Countdown ranges (``--ranges``):

``1-12s``
    1 to 12 s (on pgskip held up to 2 s, stored beyond);
``1min``
    60 to 66 s (on pgskip stored);
``1h``
    3,600 to 3,606 s (on pgskip stored); only with ``--hour``, which adds an hour to every
    load. Redis delivers again a message held past its ``visibility_timeout`` (1 h).

Loads (``--loads``), each with a worker of its own:

``idle``
    nothing else to do;
``same-queue``
    a backlog of ``--backlog`` tasks on the same queue, topped up to ``--backlog`` whenever
    half of it has been drained (checked every 0.1 s), so the worker drains it without pause;
    an ETA message keeps its publish position: the backlog tasks published before it come
    first (on pgskip, a stored message is promoted in its publish place);
``other-queue``
    the same backlog on a second queue the worker consumes too.

The backlog is copies of one real ``bench.noop`` message (published by Celery, then read back),
each with a fresh task id, written straight to the queue without the publisher's CPU: on
pgskip rows inserted by SQL, its waiting tasks counted as the queue's ``pending`` rows; on
RabbitMQ and Redis messages published through kombu to the default exchange, the waiting ones
counted through kombu (a passive ``queue_declare``'s ``message_count``: the ready messages on
RabbitMQ, the queue's list lengths on Redis). Each load uses queues of its own, purged before
and after it: on pgskip their rows deleted, on RabbitMQ the queues and their exchanges deleted
(with the messages the stopped worker held), on Redis its database (13) flushed.

Reports, per load, range, path and broker (held, stored, and both), how many tasks started
and their lateness p50, p99 and max in ms (nearest rank: of 30 tasks the p99 is the largest),
and the rate at which the backlog was drained meanwhile; the JSON has every task's countdown,
path and lateness. The goal: p99 under 100 ms.

Run (pgskip on a throwaway embedded PostgreSQL, fsync off, unless ``--url`` is given; RabbitMQ
and Redis on this machine, started if absent; a broker that is not there is skipped; about 6
minutes per broker by default)::

    python -m bench.eta
    python -m bench.eta --brokers pgskip                 # pgskip alone
    python -m bench.eta --loads idle --ranges 1-12s --tasks 30 --gap 0   # a burst
    python -m bench.eta --hour --json eta-hour.json     # adds an hour per load
    python -m bench.eta --url postgresql://postgres@host/db

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
from kombu import Connection, Producer, Queue
from kombu.exceptions import ChannelError

from .brokers import Broker, RedisFsync, ensure_rabbitmq, ensure_redis, rabbitmq_confirm
from .common import code_state, machine_info, percentile
from .held_snapshot import in_fresh_database, log_to_stderr
from .workers import StampDir, Worker, new_queue, publisher_app, warm_up

#: Countdown ranges, in seconds: (first, last).
RANGES = {"1-12s": (1.0, 12.0), "1min": (60.0, 66.0), "1h": (3600.0, 3606.0)}
LOADS = ("idle", "same-queue", "other-queue")
#: The brokers this benchmark knows (names of bench.brokers); the first two on PostgreSQL.
BROKERS = ("pgskip", "pgskip-async", "rabbitmq", "rabbitmq-confirm", "redis", "redis-fsync")
DEFAULT_BROKERS = ("pgskip", "rabbitmq", "redis")
PATHS = ("held", "stored", "all")
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
PURGE = "DELETE FROM pgskip.jobs WHERE queue = ANY(%s)"
#: Spreads the countdowns of successive steps evenly over a range, in no particular order.
GOLDEN = (5**0.5 - 1) / 2
#: Seconds between two steps: longer than the pgskip worker's fallback poll
#: (``polling_interval``, 1 s), and not a multiple of it, so consecutive ETAs of a range fall
#: due apart, as when tasks are published one by one, at every phase of that poll.
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
    adds what is missing (:meth:`feed` connects and calls :meth:`keep_up`)."""

    def __init__(self, queue: str, size: int) -> None:
        super().__init__(name="eta-backlog", daemon=True)
        self.queue, self.size = queue, size
        self.stop_event = threading.Event()
        self.inserted = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.feed()
        except BaseException as exc:  # reported by the caller
            self.error = exc

    def feed(self) -> None:
        raise NotImplementedError

    def keep_up(self, waiting: Callable[[], int], add: Callable[[int], None]) -> None:
        while not self.stop_event.is_set():
            left = waiting()
            if left < self.size // 2:
                add(self.size - left)
                self.inserted += self.size - left
            self.stop_event.wait(0.1)


class PgskipBacklog(Backlog):
    """The backlog as rows: counted as the queue's ``pending`` rows, copies inserted by SQL."""

    def __init__(self, db_url: str, queue: str, payload: str, size: int) -> None:
        super().__init__(queue, size)
        self.db_url, self.payload = db_url, payload

    def feed(self) -> None:
        with psycopg.connect(self.db_url, autocommit=True, application_name="eta-backlog") as c:

            def waiting() -> int:
                row = c.execute(PENDING, (self.queue,)).fetchone()
                return int(row[0]) if row else 0

            def add(n: int) -> None:
                c.execute(INSERT_COPIES, {"queue": self.queue, "payload": self.payload, "n": n})

            self.keep_up(waiting, add)


@dataclass
class Sample:
    """One real message as a kombu broker delivered it: what its copies are published with."""

    body: bytes | str
    headers: dict[str, Any]
    content_type: str
    content_encoding: str
    properties: dict[str, Any]  # delivery_mode, priority, reply_to (those it had)


class KombuBacklog(Backlog):
    """The backlog through kombu (RabbitMQ, Redis): counted by a passive ``queue_declare``
    (``message_count``: the ready messages), copies published to the default exchange, which
    routes them straight to the queue."""

    def __init__(self, broker: Broker, queue: str, sample: Sample, size: int) -> None:
        super().__init__(queue, size)
        self.broker, self.sample = broker, sample

    def feed(self) -> None:
        sample = self.sample
        with Connection(self.broker.url, transport_options=self.broker.transport_options) as conn:
            channel = conn.channel()
            producer = Producer(channel, auto_declare=False)

            def waiting() -> int:
                try:
                    return int(channel.queue_declare(queue=self.queue, passive=True).message_count)
                except ChannelError:
                    if self.broker.kind != "redis":
                        raise
                    return 0  # kombu's Redis transport: no list left, the queue is empty

            def add(n: int) -> None:
                for _ in range(n):
                    task_id = str(uuid.uuid4())
                    producer.publish(
                        sample.body,
                        exchange="",
                        routing_key=self.queue,
                        headers={**sample.headers, "id": task_id},
                        content_type=sample.content_type,
                        content_encoding=sample.content_encoding,
                        correlation_id=task_id,
                        **sample.properties,
                    )

            self.keep_up(waiting, add)


@dataclass
class Figures:
    broker: str
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
    broker: str
    load: str
    backlog: int
    backlog_drained_per_s: float | None  # backlog tasks started per second meanwhile
    figures: list[Figures] = field(default_factory=list)
    # Every ETA task: (range, countdown s, path, lateness ms or None if it did not start).
    samples: list[tuple[str, float, str, float | None]] = field(default_factory=list)


def _figures(
    broker: str, load: str, countdowns: str, path: str, tasks: int, late: list[float]
) -> Figures:
    ordered = sorted(late)
    return Figures(
        broker=broker,
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


def _sample_message(app: Any, broker: Broker, queue: str) -> Sample:
    """A backlog task as a kombu broker delivers it from ``queue``: published, then taken."""
    app.tasks["bench.noop"].apply_async(kwargs={"i": BACKLOG_INDEX}, queue=queue)
    with Connection(broker.url, transport_options=broker.transport_options) as conn:
        bound = Queue(queue).bind(conn.default_channel)
        deadline = time.monotonic() + 10.0
        while (message := bound.get(no_ack=True)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sample message for {queue} did not arrive")
            time.sleep(0.05)
    props = message.properties
    return Sample(
        body=message.body,
        headers=dict(message.headers),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        properties={k: props[k] for k in ("delivery_mode", "priority", "reply_to") if props.get(k)},
    )


def _backlog(broker: Broker, app: Any, queue: str, size: int) -> Backlog:
    if broker.kind == "pgskip":
        assert broker.db_url is not None
        return PgskipBacklog(broker.db_url, queue, _sample_payload(app, broker.db_url, queue), size)
    return KombuBacklog(broker, queue, _sample_message(app, broker, queue), size)


def purge(broker: Broker, queues: list[str]) -> None:
    """Drops every message of ``queues``: waiting, scheduled, held or unacknowledged."""
    if broker.kind == "pgskip" and broker.db_url:
        with psycopg.connect(broker.db_url, autocommit=True) as conn:
            conn.execute(PURGE, (queues,))
    elif broker.kind == "redis":
        broker.reset()  # the benchmarks' own database: queues, bindings, unacked hash
    else:
        broker.delete_queues(queues)


def measure(
    broker: Broker,
    load: str,
    *,
    ranges: list[str],
    tasks: int,
    backlog: int,
    gap: float = GAP_S,
    say: Any = log_to_stderr,
) -> LoadResult:
    """One load on ``broker``: a worker of its own, ``tasks`` steps ``gap`` seconds apart, each
    publishing one ETA task of every range; then waits until they have all started (at most
    ``GRACE_S`` after the last ETA). Its queues are purged before and after."""
    queue = new_queue("eta")
    other = new_queue("eta-load")
    queues = [queue, other]
    backlog_queue = {"same-queue": queue, "other-queue": other}.get(load)
    purge(broker, queues)
    app = publisher_app(broker, queue)
    stamps = StampDir()
    worker = EtaWorker(
        broker,
        queue,
        stamps,
        extra=[other] if load == "other-queue" else [],
        name=f"eta-{broker.name}-{load}",
    )
    feeder: Backlog | None = None
    result = LoadResult(
        broker=broker.name,
        load=load,
        backlog=backlog if backlog_queue is not None else 0,
        backlog_drained_per_s=None,
    )
    try:
        if backlog_queue is not None:
            feeder = _backlog(broker, app, backlog_queue, backlog)
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
        say(
            f"{broker.name} {load}: publishing {len(plan)} ETA tasks ({', '.join(ranges)}), "
            f"every {gap} s"
        )
        task = app.tasks["bench.noop"]
        etas: dict[int, float] = {}
        stored: set[int] = set()
        t_publish = time.time()
        # Only pgskip can store a message until due: where it waits is read from its database.
        with (
            psycopg.connect(broker.db_url, autocommit=True)
            if broker.kind == "pgskip" and broker.db_url
            else contextlib.nullcontext()
        ) as conn:
            for i, (k, _, countdown) in enumerate(plan):
                time.sleep(max(0.0, t_publish + k * gap - time.time()))
                eta = datetime.now(timezone.utc) + timedelta(seconds=countdown)
                task_id = task.apply_async(kwargs={"i": i}, eta=eta).id
                etas[i] = eta.timestamp()
                if conn is not None:
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
        starts: dict[int, float] = {}  # each ETA task's first start
        for i, t in stamped:
            if i >= 0 and t < starts.get(i, float("inf")):
                starts[i] = t
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
                result.figures.append(_figures(broker.name, load, name, path, len(members), late))
        for i, (_, name, countdown) in enumerate(plan):
            path = "stored" if i in stored else "held"
            late_ms = round(1000.0 * (starts[i] - etas[i]), 2) if i in starts else None
            result.samples.append((name, round(countdown, 3), path, late_ms))
        return result
    finally:
        if feeder is not None:
            feeder.stop_event.set()
            if feeder.is_alive():
                feeder.join(timeout=10)
        worker.stop()
        stamps.cleanup()
        app.close()
        purge(broker, queues)


def table(results: list[LoadResult]) -> str:
    """One row per load, range, path and broker (the brokers of a row side by side)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    def rank(values: list[str], value: str) -> int:
        return values.index(value) if value in values else len(values)

    brokers = list(dict.fromkeys(r.broker for r in results))
    ranges = list(dict.fromkeys(f.countdowns for r in results for f in r.figures))
    figures = sorted(
        (f for r in results for f in r.figures),
        key=lambda f: (
            rank(list(LOADS), f.load),
            rank(ranges, f.countdowns),
            rank(list(PATHS), f.path),
            rank(brokers, f.broker),
        ),
    )
    lines = [
        "| load | countdowns | path | broker | tasks | started | p50 ms | p99 ms | max ms "
        "| min ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f.load} | {f.countdowns} | {f.path} | {f.broker} | {f.tasks} | {f.started} "
            f"| {ms(f.p50_ms)} | {ms(f.p99_ms)} | {ms(f.max_ms)} | {ms(f.min_ms)} |"
        )
    lines.append("")
    for r in sorted(results, key=lambda r: (rank(list(LOADS), r.load), rank(brokers, r.broker))):
        if r.backlog:
            rate = "-" if r.backlog_drained_per_s is None else f"{r.backlog_drained_per_s:,.0f}"
            lines.append(
                f"{r.load}, {r.broker}: backlog of {r.backlog:,} drained at {rate} tasks/s"
            )
    return "\n".join(lines)


def make_broker(name: str, db_url: str | None, cleanup: contextlib.ExitStack) -> Broker:
    """The broker ``name``: pgskip on the database ``db_url``, the others as
    :mod:`bench.brokers` finds or starts them (a server of the run's own stopped by
    ``cleanup``)."""
    if name in ("pgskip", "pgskip-async"):
        assert db_url is not None
        return Broker(
            name,
            "pgskip" if name == "pgskip" else "pgskip, durable_publish=False",
            kind="pgskip",
            url=db_url.replace("postgresql://", "pgskip://", 1),
            db_url=db_url,
            transport_options={"durable_publish": False} if name == "pgskip-async" else {},
            available=True,
        )
    if name in ("rabbitmq", "rabbitmq-confirm"):
        plain = ensure_rabbitmq()
        return plain if name == "rabbitmq" else rabbitmq_confirm(plain)
    if name == "redis":
        return ensure_redis()
    server = RedisFsync()
    cleanup.callback(server.stop)
    return server.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--brokers", default=",".join(DEFAULT_BROKERS), help=f"of {', '.join(BROKERS)}"
    )
    parser.add_argument(
        "--url", help="superuser URL of a database for pgskip (default: embedded server)"
    )
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
    names = list(dict.fromkeys(x.strip() for x in args.brokers.split(",") if x.strip()))
    loads = [x for x in args.loads.split(",") if x]
    ranges = [x for x in args.ranges.split(",") if x] + (["1h"] if args.hour else [])
    unknown = (
        [x for x in names if x not in BROKERS]
        + [x for x in loads if x not in LOADS]
        + [x for x in ranges if x not in RANGES]
    )
    if unknown:
        parser.error(f"unknown broker, load or range {', '.join(unknown)}")
    if args.tasks < 1 or args.backlog < 2:
        parser.error("--tasks must be at least 1 and --backlog at least 2")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    labels: dict[str, str] = {}
    unavailable: dict[str, str] = {}

    def run_all(db_url: str | None) -> list[LoadResult]:
        results: list[LoadResult] = []
        with contextlib.ExitStack() as cleanup:
            for name in names:
                broker = make_broker(name, db_url, cleanup)
                if not broker.available:
                    log_to_stderr(f"{name}: unavailable ({broker.reason}), skipped")
                    unavailable[name] = broker.reason
                    continue
                labels[name] = broker.label
                for load in loads:
                    results.append(
                        measure(
                            broker,
                            load,
                            ranges=ranges,
                            tasks=args.tasks,
                            backlog=args.backlog,
                            gap=args.gap,
                        )
                    )
        return results

    if any(name.startswith("pgskip") for name in names):
        results = in_fresh_database(args.url, "eta", run_all)
    else:
        results = run_all(None)
    print(table(results))
    if args.json:
        out = {
            "bench": "eta",
            "started": started,
            "command": " ".join(["python -m bench.eta", *(sys.argv[1:] if argv is None else argv)]),
            "params": {
                "brokers": labels,
                "unavailable": unavailable,
                "loads": loads,
                "ranges": {name: RANGES[name] for name in ranges},
                "tasks_per_range": args.tasks,
                "gap_s": args.gap,
                "backlog": args.backlog,
                "worker": "celery worker -P threads -c 4, transport defaults "
                "(pgskip: eta_threshold 2 s)",
            },
            "machine": machine_info(),
            "code": code_state(),
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
