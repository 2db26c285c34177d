"""Fleet-wide queue limits (``pgskip limit``): what a limit costs a fetch, and that it holds.

Two measurements, on a throwaway embedded PostgreSQL (fsync off) unless ``--url`` is given:

``fetch``
    The time of one fetch of 10 messages, p50 and p99 over ``--fetches`` fetches, from a queue
    of ``--backlog`` pending messages: the normal fetch of an unlimited queue
    (``Store.fetch``), and the limited fetch (``Store.fetch_limited``: its lock, the count of
    running messages, the take, in one transaction) of a queue limited by ``--max-running``
    (set high enough never to stop it), by that and a per-key limit (its messages spread over
    100 keys), and by a rate (high enough never to stop it). The messages of each fetch are
    acknowledged before the next (not timed), so the running messages stay few; the same
    client, the same connection.
``fleet``
    ``--workers`` real ``celery worker`` processes (threads pool, ``--concurrency`` each,
    ``acks_late`` and a prefetch multiplier of 1) consume a queue limited to ``--limit``
    running; ``--tasks`` tasks of ``--task-seconds`` each record when they start and end: the
    most that ran at once, against the limit. Then the same fleet on a queue limited to
    ``--rate`` starts per second (``--rate-tasks`` tasks that do nothing): the average start
    rate from the first start to the last, and the most starts within any one second, against
    the rate plus the bucket's burst.

Run (about a minute by default)::

    python -m bench.limits --json limits.json
    python -m bench.limits --workers 8 --tasks 200 --rate 50 --url postgresql://postgres@host/db

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from .brokers import Broker
from .common import log, machine_info, percentile
from .workers import StampDir, Worker, new_queue, publisher_app, stop_all


def _publish_rows(db_url: str, queue: str, n: int, keys: int = 0) -> None:
    """``n`` pending ``bench.noop`` messages written straight into ``queue`` (``keys``: spread
    over that many concurrency keys)."""
    payload = json.dumps(
        {
            "body": "W1tdLCB7fSwge31d",
            "headers": {"task": "bench.noop", "id": "x", "lang": "py"},
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "properties": {"priority": 0, "delivery_info": {}, "body_encoding": "base64"},
        }
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        columns = "queue, payload, task_name"
        if keys:
            conn.execute(
                f"INSERT INTO pgskip.jobs ({columns}, concurrency_key)"
                " SELECT %s, %s::json, 'bench.noop', 'k' || (g %% %s)"
                " FROM generate_series(1, %s) AS g",
                (queue, payload, keys, n),
            )
        else:
            conn.execute(
                f"INSERT INTO pgskip.jobs ({columns})"
                " SELECT %s, %s::json, 'bench.noop' FROM generate_series(1, %s)",
                (queue, payload, n),
            )
        conn.execute("ANALYZE pgskip.jobs")


def measure_fetch(db_url: str, backlog: int, fetches: int) -> dict[str, Any]:
    from kombu_pgskip.store import Store

    store = Store(db_url)
    consumer = uuid.uuid4()
    cases: dict[str, dict[str, Any]] = {
        "unlimited": {},
        "max_running": {"max_running": 1_000_000},
        "max_running+per_key": {"max_running": 1_000_000, "max_running_per_key": 1_000},
        "rate": {"rate": 1e9},
    }
    out: dict[str, Any] = {}
    try:
        for name, limits in cases.items():
            queue = new_queue(f"fetch-{name.replace('+', '-')}")
            _publish_rows(db_url, queue, backlog, keys=100 if "per_key" in name else 0)
            store.register_consumer(consumer, hostname="bench", queues=[queue], lease=600)
            if limits:
                store.set_limit(queue, **limits)
            times: list[float] = []
            took = 0
            for _ in range(fetches):
                t0 = time.perf_counter()
                if limits:
                    rows = store.fetch_limited(queue, 10, consumer).rows
                else:
                    rows = store.fetch([queue], 10, consumer)
                times.append(time.perf_counter() - t0)
                took += len(rows)
                store.ack([r.tag for r in rows], consumer)
            out[name] = {
                "p50_ms": round((percentile(times, 50) or 0) * 1000, 3),
                "p99_ms": round((percentile(times, 99) or 0) * 1000, 3),
                "fetches": fetches,
                "messages": took,
            }
            log(f"fetch {name}: {out[name]}")
            with psycopg.connect(db_url, autocommit=True) as conn:
                conn.execute("DELETE FROM pgskip.jobs WHERE queue = %s", (queue,))
                conn.execute("DELETE FROM pgskip.queue_limits WHERE name = %s", (queue,))
        store.unregister_consumer(consumer)
    finally:
        store.close()
    return out


def _spans(stamps: StampDir) -> list[tuple[int, float, float]]:
    spans = []
    for f in Path(stamps.path).glob("spans-*.txt"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                spans.append((int(parts[0]), float(parts[1]), float(parts[2])))
    return spans


def _wait_spans(stamps: StampDir, n: int, timeout: float) -> list[tuple[int, float, float]]:
    deadline = time.monotonic() + timeout
    while True:
        spans = _spans(stamps)
        if len({s[0] for s in spans if s[0] >= 0}) >= n or time.monotonic() > deadline:
            return [s for s in spans if s[0] >= 0]
        time.sleep(0.1)


def _most_at_once(spans: list[tuple[int, float, float]]) -> int:
    events = sorted([(t0, 1) for _, t0, _ in spans] + [(t1, -1) for _, _, t1 in spans])
    running = high = 0
    for _, step in events:
        running += step
        high = max(high, running)
    return high


def _run_fleet(
    broker: Broker,
    tag: str,
    limits: dict[str, Any],
    workers: int,
    concurrency: int,
    tasks: int,
    seconds: float,
) -> list[tuple[int, float, float]]:
    from kombu_pgskip.store import Store

    queue = new_queue(tag)
    assert broker.db_url is not None
    store = Store(broker.db_url)
    try:
        store.set_limit(queue, **limits)
    finally:
        store.close()
    stamps = StampDir()
    app = publisher_app(broker, queue)
    fleet = [
        Worker(
            broker,
            queue,
            stamps,
            pool="threads",
            concurrency=concurrency,
            name=f"{tag}{k}",
            acks_late=True,
        )
        for k in range(workers)
    ]
    try:
        for w in fleet:
            w.start()
        app.tasks["bench.span"].apply_async(kwargs={"i": -1})  # up: a first task ran
        deadline = time.monotonic() + 60
        while not any(i == -1 for i, _, _ in _spans(stamps)) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the others registered too
        for i in range(tasks):
            app.tasks["bench.span"].apply_async(kwargs={"i": i, "seconds": seconds})
        return _wait_spans(stamps, tasks, timeout=60 + tasks * seconds)
    finally:
        stop_all(fleet)
        stamps.cleanup()
        app.close()
        broker.delete_queues([queue])


def measure_fleet(broker: Broker, args: argparse.Namespace) -> dict[str, Any]:
    spans = _run_fleet(broker, "cap", {"max_running": args.limit}, args.workers,
                       args.concurrency, args.tasks, args.task_seconds)  # fmt: skip
    capped = {
        "workers": args.workers,
        "slots": args.workers * args.concurrency,
        "limit": args.limit,
        "tasks": len(spans),
        "most_running_at_once": _most_at_once(spans),
    }
    log(f"fleet, max running: {capped}")
    spans = _run_fleet(broker, "rate", {"rate": args.rate}, args.workers, args.concurrency,
                       args.rate_tasks, 0.0)  # fmt: skip
    starts = sorted(t0 for _, t0, _ in spans)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    most = max(
        (sum(1 for t in starts if s <= t < s + 1.0) for s in starts),
        default=0,
    )
    rated = {
        "workers": args.workers,
        "rate": args.rate,
        "burst": max(1, -int(-args.rate // 1)),
        "tasks": len(starts),
        "start_rate": round((len(starts) - 1) / span, 2) if span else None,
        "most_starts_in_one_second": most,
    }
    log(f"fleet, rate: {rated}")
    return {"max_running": capped, "rate": rated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="postgresql:// URL of a database to use (migrated here)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--fetches", type=int, default=300)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=80)
    parser.add_argument("--task-seconds", type=float, default=0.1)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--rate-tasks", type=int, default=100)
    parser.add_argument("--skip-fleet", action="store_true", help="measure the fetch only")
    args = parser.parse_args()

    from kombu_pgskip import migrate

    pg = None
    url = args.url
    if url is None:
        from kombu_pgskip.testing.embedded import EmbeddedPostgres

        pg = EmbeddedPostgres(fsync=False, pg_cron=False).start()
        url = pg.dsn()
    try:
        migrate(url, schema="pgskip")
        broker = Broker(
            "pgskip",
            "pgskip",
            kind="pgskip",
            url=url.replace("postgresql://", "pgskip://", 1),
            db_url=url,
            available=True,
        )
        results: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
        results["fetch"] = measure_fetch(url, args.backlog, args.fetches)
        if not args.skip_fleet:
            results["fleet"] = measure_fleet(broker, args)
    finally:
        if pg is not None:
            pg.cleanup()
    print(json.dumps(results, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
