"""Fetch latency while the ring of ``jobs``' slots goes round, completed messages kept a day.

With the default retention of completed messages (a day) every slot the ring comes back to holds
a slot's worth of completed messages, which ``rotate()`` moves to ``jobs_kept``: under the slot's
ACCESS EXCLUSIVE lock, which every fetch waits for, or ahead of the wrap without it. This bench
streams messages through at a steady rate long enough for the ring to come round several times
and records how long every fetch took and what every ``rotate()`` call did.

Producer: ``INSERT ... SELECT`` of 15,000 pending messages whenever fewer than 5,000 wait (as
``bench.steady_state``). Consumers: two processes running the transport's own ``fetch`` (20 at a
time) and ``ack`` (``Store.fetch`` / ``Store.ack``), each paced to ``--rate / 2`` messages a
second. ``rotate()`` once a second, as a worker runs it. Nothing is pruned: a day's retention.

Reports the rate, fetch latency (p50, p99, max, how many took more than 50 and 100 ms), the
duration of ``rotate()`` calls (p50, max), how many wraps, and the messages they moved.

Run (a throwaway embedded PostgreSQL unless ``--url`` is given; about 3 minutes by default)::

    python -m bench.ring_wrap
    python -m bench.ring_wrap --messages 400000 --rate 2500 --json out.json

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from .common import percentile
from .held_snapshot import in_fresh_database
from .steady_state import FILL, QUEUE

PAYLOAD = json.dumps({"body": "x" * 500, "headers": {"task": "bench.noop"}})


def _consumer(url: str, target: int, rate: float, stop: Any, done: Any, results: Any) -> None:
    from kombu_pgskip.store import Store

    timings: list[float] = []
    try:
        store = Store(url, check=False)
        me = uuid.uuid4()
        store.register_consumer(me, hostname="bench-ring-wrap", queues=[QUEUE], lease=300)
        start = time.perf_counter()
        mine = 0
        while not stop.is_set():
            ahead = mine / rate - (time.perf_counter() - start)
            if ahead > 0:
                time.sleep(ahead)
            c0 = time.perf_counter()
            rows = store.fetch([QUEUE], 20, me)
            dt = time.perf_counter() - c0
            if not rows:
                time.sleep(0.005)
                continue
            store.ack([r.tag for r in rows], me)
            timings.append(dt)
            mine += len(rows)
            with done.get_lock():
                done.value += len(rows)
                if done.value >= target:
                    stop.set()
        store.unregister_consumer(me)
        store.close()
    finally:
        stop.set()
        results.put(timings)


def run(url: str, *, messages: int, rate: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    done = ctx.Value("q", 0)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_consumer, args=(url, messages, rate / 2, stop, done, results))
        for _ in range(2)
    ]
    rotations: list[tuple[float, int, int, int]] = []
    with psycopg.connect(url, autocommit=True) as conn:
        first = conn.execute("SELECT slot FROM pgskip.jobs_rotation").fetchone()
        assert first is not None
        rotations.append((0.0, 0, 0, first[0]))  # where the ring starts
        conn.execute(FILL, (QUEUE, PAYLOAD, 20_000))
        inserted = 20_000
        for p in procs:
            p.start()
        t0 = time.time()
        next_rotate = t0
        while not stop.is_set() and any(p.is_alive() for p in procs):
            row = conn.execute(
                "SELECT count(*) FROM pgskip.jobs WHERE queue = %s AND status = 'pending'",
                (QUEUE,),
            ).fetchone()
            if row is not None and row[0] < 5_000 and inserted < messages:
                n = min(15_000, messages - inserted)
                conn.execute(FILL, (QUEUE, PAYLOAD, n))
                inserted += n
            if time.time() >= next_rotate:
                c0 = time.perf_counter()
                rot = conn.execute("SELECT * FROM pgskip.rotate()").fetchone()
                assert rot is not None
                rotations.append((1000 * (time.perf_counter() - c0), rot[0], rot[1], rot[2]))
                next_rotate = time.time() + 1.0
            time.sleep(0.05)
        elapsed = time.time() - t0
        fetch_ms = [1000 * dt for _ in procs for dt in results.get(timeout=120)]
        for p in procs:
            p.join(30)
    rotate_ms = [r[0] for r in rotations[1:]]
    return {
        "messages": done.value,
        "elapsed_s": round(elapsed, 1),
        "rate": round(done.value / elapsed),
        "fetch_ms_p50": round(percentile(fetch_ms, 50), 2),
        "fetch_ms_p99": round(percentile(fetch_ms, 99), 2),
        "fetch_ms_max": round(max(fetch_ms), 1),
        "fetches": len(fetch_ms),
        "fetches_over_50ms": sum(ms > 50 for ms in fetch_ms),
        "fetches_over_100ms": sum(ms > 100 for ms in fetch_ms),
        "rotate_ms_p50": round(percentile(rotate_ms, 50), 1),
        "rotate_ms_max": round(max(rotate_ms), 1),
        "wraps": sum(1 for a, b in itertools.pairwise(rotations) if a[3] != b[3]),
        "moved": sum(r[2] for r in rotations),
        # (ms, slots emptied, messages moved, current slot) of each call over 50 ms
        "slow_rotations": [(round(r[0]), r[1], r[2], r[3]) for r in rotations[1:] if r[0] > 50],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="superuser URL of a database (default: embedded server)")
    parser.add_argument("--messages", type=int, default=400_000)
    parser.add_argument("--rate", type=float, default=2_500, help="messages a second, in all")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    out = in_fresh_database(
        args.url, "ring_wrap", lambda url: run(url, messages=args.messages, rate=args.rate)
    )
    for key, value in out.items():
        if key != "slow_rotations":
            print(f"{key:>20}: {value}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
