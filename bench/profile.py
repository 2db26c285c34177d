"""Where pgskip's time goes: ``python -m bench.profile [--tasks N] [--out DIR]``.

1. Worker side: a backlog of ``N`` tasks, then a ``-P threads -c 4`` worker drains it while
   ``py-spy`` samples it (collapsed stacks in ``worker.txt``, summarised as the share of samples
   per function in ``profile.json``; flamegraph.pl or inferno draw a flame graph from it), with
   ``pg_stat_statements`` and ``pg_stat_wal`` counting statements, rows and WAL flushes per task.
2. Publisher: ``N`` durable ``apply_async`` calls under cProfile (``publisher.pstats``), with the
   same statement counts.

It runs its own EmbeddedPostgres (fsync on) with ``pg_stat_statements`` preloaded.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

from .brokers import Broker
from .common import REPO, log
from .workers import StampDir, Worker, new_queue, publish_backlog, publisher_app

STATS = """
SELECT calls, rows, round(total_exec_time::numeric, 1) AS ms,
       regexp_replace(left(query, 90), '\\s+', ' ', 'g')
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY calls DESC LIMIT 12
"""


def _db_counters(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    row = conn.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    wal = conn.execute(
        "SELECT wal_records, wal_bytes, wal_write, wal_sync FROM pg_stat_wal"
    ).fetchone()
    assert row is not None and wal is not None
    return {
        "commits": row[0],
        "wal_records": wal[0],
        "wal_bytes": int(wal[1]),
        "wal_writes": wal[2],
        "wal_syncs": wal[3],
    }


def _delta(a: dict[str, Any], b: dict[str, Any], n: int) -> dict[str, float]:
    return {f"{k}_per_task": round((b[k] - a[k]) / n, 2) for k in a}


def _reset(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SELECT pg_stat_statements_reset()")
    conn.execute("SELECT pg_stat_reset_shared('wal')")
    conn.execute("SELECT pg_stat_reset()")
    time.sleep(0.6)  # statistics are flushed by backends at most every 500 ms


def top_frames(collapsed: Path, limit: int = 25) -> list[tuple[str, float]]:
    """Share of samples in which each function appears (inclusive), from py-spy's raw output."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        total += c
        seen = set()
        for frame in stack.split(";"):
            name = frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].split("/")[-1]
            if name not in seen:
                seen.add(name)
                inclusive[name] += c
    return (
        [(name, round(100 * c / total, 1)) for name, c in inclusive.most_common(limit)]
        if total
        else []
    )


def main(argv: list[str] | None = None) -> int:
    from kombu_pgskip import migrate
    from kombu_pgskip.embedded import EmbeddedPostgres

    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "profile"))
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = args.tasks
    report: dict[str, Any] = {"tasks": n}

    pg = EmbeddedPostgres(
        fsync=True,
        pg_cron=False,
        extra_conf={
            "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.track": "all",
        },
    ).start()
    try:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE pgskip_prof")
        url = pg.dsn("pgskip_prof")
        migrate(url, schema="pgskip")
        broker = Broker(
            "pgskip",
            "pgskip",
            url=f"pgskip://postgres@127.0.0.1:{pg.port}/pgskip_prof",
            db_url=url,
            available=True,
        )
        conn = psycopg.connect(url, autocommit=True)
        conn.execute("CREATE EXTENSION pg_stat_statements")

        # 1. worker side under py-spy
        queue = new_queue("prof")
        app = publisher_app(broker, queue)
        publish_backlog(broker, app, n)
        stamps = StampDir()
        _reset(conn)
        before = _db_counters(conn)
        worker = Worker(
            broker, queue, stamps, pool=args.pool, concurrency=args.concurrency, name="prof"
        )
        worker.start()
        spy = shutil.which("py-spy") or str(Path(__import__("sys").executable).parent / "py-spy")
        spy_proc = None
        if Path(spy).exists():
            time.sleep(0.3)
            raw = out / "worker.txt"
            spy_proc = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(worker.pid),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--threads",
                    "--subprocesses",
                    "--output",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        done = stamps.wait_for(n, 180)
        got = sorted(t for i, t in stamps.read() if i >= 0)
        report["worker_rate"] = (
            round((len(got) - 1) / (got[-1] - got[0]), 1) if len(got) > 1 else None
        )
        time.sleep(0.7)
        after = _db_counters(conn)
        report["worker_counters"] = _delta(before, after, max(done, 1))
        report["worker_statements"] = [list(r) for r in conn.execute(STATS).fetchall()]
        if spy_proc is not None:
            spy_proc.send_signal(signal.SIGINT)
            try:
                spy_proc.wait(30)
            except subprocess.TimeoutExpired:
                spy_proc.kill()
            if (out / "worker.txt").exists():
                report["worker_top_frames"] = top_frames(out / "worker.txt")
        worker.stop()
        stamps.cleanup()

        # 2. publisher under cProfile
        broker.reset()
        app2 = publisher_app(broker, new_queue("profpub"))
        task = app2.tasks["bench.noop"]
        for i in range(100):
            task.apply_async(kwargs={"i": i})
        _reset(conn)
        before = _db_counters(conn)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for i in range(n):
            task.apply_async(kwargs={"i": i})
        prof.disable()
        elapsed = time.perf_counter() - t0
        time.sleep(0.7)
        after = _db_counters(conn)
        report["publisher_rate"] = round(n / elapsed, 1)
        report["publisher_counters"] = _delta(before, after, n)
        report["publisher_statements"] = [list(r) for r in conn.execute(STATS).fetchall()]
        prof.dump_stats(out / "publisher.pstats")
        with open(out / "publisher.txt", "w") as fh:
            pstats.Stats(prof, stream=fh).sort_stats("cumulative").print_stats(35)
        app.close()
        app2.close()
        conn.close()
    finally:
        pg.cleanup()
    (out / "profile.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    log(f"profile written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
