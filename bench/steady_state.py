"""Staying small: many messages through pgskip's jobs table with retention pruning on.

Producer: the bench keeps 5,000-20,000 messages pending by bulk ``INSERT ... SELECT`` of a real
Celery payload (one statement per 15,000, cheaper for the bench's own process than
``publish_many``, so that the consumers set the rate). Consumers: two processes running the
transport's own ``fetch`` (100 at a time) and ``ack`` statements (``Store.fetch`` /
``Store.ack``, one ack statement per batch), bypassing kombu so that a million messages take
minutes, not an hour. Pruning: the schema's ``prune()`` function every 2 seconds with the given
retention; where the schema has none, a plain ``DELETE`` of completed rows older than it. The
ring of slots: ``rotate()`` every second, as the workers run it, with the same retention.

Recorded: table, index and TOAST sizes and dead tuples along the way; the fetch statement's
latency along the way; and a controlled probe (10,000 pending rows, 50 fetches of 100 and their
acks, one client, nothing else running) on the fresh table and again at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any

import psycopg
import psycopg.sql

from .brokers import Broker
from .common import log, percentile

QUEUE = "steady"
FILL = (
    "INSERT INTO pgskip.jobs (queue, payload, task_name, task_id, slot) "
    "SELECT %s, %s::json, 'bench.noop', gen_random_uuid()::text,"
    " (SELECT slot FROM pgskip.jobs_rotation) FROM generate_series(1, %s)"
)
#: What each worker runs every second: the ring of slots moves on, finished slots are emptied.
ROTATE_FN = "SELECT * FROM pgskip.rotate()"
ROTATION_RETENTION = (
    "UPDATE pgskip.jobs_rotation SET completed_retention = make_interval(secs => %s)"
)
PRUNE = (
    "WITH d AS (DELETE FROM pgskip.jobs WHERE status = 'completed' "
    "AND finished_at < now() - make_interval(secs => %s) RETURNING 1) SELECT count(*) FROM d"
)
PRUNE_FN = "SELECT completed FROM pgskip.prune(make_interval(secs => %s), NULL)"
SIZES = """
WITH t AS (SELECT relid FROM pg_partition_tree('pgskip.jobs') WHERE isleaf)
SELECT sum(pg_relation_size(c.oid))::float8, sum(pg_indexes_size(c.oid))::float8,
       sum(pg_total_relation_size(c.oid))::float8,
       sum(COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0))::float8,
       sum(s.n_live_tup)::bigint, sum(s.n_dead_tup)::bigint, sum(s.autovacuum_count)::bigint,
       sum(s.autoanalyze_count)::bigint
  FROM t JOIN pg_class c ON c.oid = t.relid JOIN pg_stat_user_tables s ON s.relid = c.oid
"""
INDEX_SIZES = """
SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
  FROM pg_index
 WHERE indrelid IN (SELECT relid FROM pg_partition_tree('pgskip.jobs') WHERE isleaf)
 ORDER BY 1
"""


def _consumer(
    url: str, target: Any, stop: Any, done: Any, kept: bool
) -> list[tuple[float, float, int]]:
    from kombu_pgskip.store import Store

    store = Store(url, check=False, keep_completed=kept)
    me = uuid.uuid4()
    store.register_consumer(me, hostname="bench-steady", queues=[QUEUE], lease=300)
    timings: list[tuple[float, float, int]] = []
    while not stop.is_set():
        c0 = time.perf_counter()
        rows = store.fetch([QUEUE], 100, me)
        dt = time.perf_counter() - c0
        if not rows:
            time.sleep(0.005)
            continue
        store.ack([r.tag for r in rows], me)
        with done.get_lock():
            done.value += len(rows)
            total = done.value
        timings.append((time.time(), dt, total))
        if total >= target:
            stop.set()
    store.unregister_consumer(me)
    store.close()
    return timings


def _consumer_main(
    url: str, target: int, stop: Any, done: Any, results: Any, kept: bool = True
) -> None:
    try:
        results.put(_consumer(url, target, stop, done, kept))
    except BaseException:
        stop.set()
        results.put([])
        raise


def _probe(url: str, payload: str) -> dict[str, Any]:
    """Fetch latency with 10,000 pending rows, one client, nothing else running."""
    from kombu_pgskip.store import Store

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, ("probe", payload, 10_000))
    store = Store(url, check=False)
    me = uuid.uuid4()
    store.register_consumer(me, hostname="bench-probe", queues=["probe"], lease=60)
    fetch_ms: list[float] = []
    for _ in range(50):
        c0 = time.perf_counter()
        rows = store.fetch(["probe"], 100, me)
        fetch_ms.append(1000 * (time.perf_counter() - c0))
        store.ack([r.tag for r in rows], me)
    store.unregister_consumer(me)
    store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgskip.jobs WHERE queue = 'probe'")
    return {
        "fetch100_ms_p50": percentile(fetch_ms, 50),
        "fetch100_ms_p90": percentile(fetch_ms, 90),
        "fetch100_ms_max": max(fetch_ms),
    }


def _sizes(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    row = conn.execute(SIZES).fetchone()
    assert row is not None
    mb = 1024 * 1024
    return {
        "table_mb": round(row[0] / mb, 2),
        "indexes_mb": round(row[1] / mb, 2),
        "total_mb": round(row[2] / mb, 2),
        "toast_mb": round(row[3] / mb, 2),
        "live_tup": row[4],
        "dead_tup": row[5],
        "autovacuums": row[6],
        "autoanalyzes": row[7],
        "index_mb": {
            name: round(size / mb, 2) for name, size in conn.execute(INDEX_SIZES).fetchall()
        },
    }


def _set_naptime(conn: psycopg.Connection[Any], naptime: str | None) -> None:
    if naptime is None:
        conn.execute("ALTER SYSTEM RESET autovacuum_naptime")
    else:
        conn.execute(
            psycopg.sql.SQL("ALTER SYSTEM SET autovacuum_naptime = {}").format(
                psycopg.sql.Literal(naptime)
            )
        )
    conn.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)


def steady_state(
    pgskip: Broker,
    payload: str,
    *,
    messages: int,
    retention: float,
    autovacuum_naptime: str | None = None,
    keep_completed: bool = True,
) -> dict[str, Any]:
    """``autovacuum_naptime``: run with this server setting (the bench's own cluster), as
    docs/performance.md advises for queue workloads; None keeps PostgreSQL's default (1min).
    ``keep_completed=False``: the consumers' acks delete the rows (the transport option of that
    name); pruning runs all the same, and finds nothing."""
    url = pgskip.db_url or ""
    pgskip.reset()
    with psycopg.connect(url, autocommit=True) as conn:
        _set_naptime(conn, autovacuum_naptime)
        conn.execute("TRUNCATE pgskip.jobs")  # start from an empty file, whatever ran before
        conn.execute("VACUUM ANALYZE pgskip.jobs")
        # As `pgskip maintenance` writes the retention it prunes with.
        conn.execute(ROTATION_RETENTION, (retention,))
        row = conn.execute("SELECT to_regproc('pgskip.prune') IS NOT NULL").fetchone()
    has_prune = bool(row and row[0])
    prune_sql = PRUNE_FN if has_prune else PRUNE
    how = (
        f"pgskip.prune() (the schema's pruning function) every 2 s, retention {retention:g} s"
        if has_prune
        else f"plain DELETE of completed rows by the bench every 2 s (no pruning function in "
        f"the schema), retention {retention:g} s"
    )
    prune_ms: list[float] = []
    probe_start = _probe(url, payload)

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    done = ctx.Value("q", 0)
    samples: list[dict[str, Any]] = []
    inserted = 0
    pruned = 0
    t0 = time.time()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_consumer_main, args=(url, messages, stop, done, results, keep_completed)
        )
        for _ in range(2)
    ]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, (QUEUE, payload, 20_000))
        inserted += 20_000
        for p in procs:
            p.start()
        next_prune = next_sample = next_rotate = time.time()
        while not stop.is_set() and any(p.is_alive() for p in procs):
            now = time.time()
            row = conn.execute(
                "SELECT count(*) FROM pgskip.jobs WHERE queue = %s AND status = 'pending'",
                (QUEUE,),
            ).fetchone()
            pending = row[0] if row else 0
            if pending < 5_000 and inserted < messages:
                n = min(15_000, messages - inserted)
                conn.execute(FILL, (QUEUE, payload, n))
                inserted += n
            if now >= next_prune:
                c0 = time.perf_counter()
                pr = conn.execute(prune_sql, (retention,)).fetchone()
                prune_ms.append(1000 * (time.perf_counter() - c0))
                pruned += int(pr[0]) if pr else 0
                next_prune = time.time() + 2.0
            if now >= next_rotate:
                conn.execute(ROTATE_FN)
                next_rotate = time.time() + 1.0
            if now >= next_sample:
                s = _sizes(conn)
                s.update(t=round(now - t0, 1), processed=done.value, pending=pending)
                samples.append(s)
                next_sample = now + 2.0
            time.sleep(0.1)
        elapsed = time.time() - t0
        timings = [t for _ in procs for t in results.get(timeout=120)]
        for p in procs:
            p.join(30)
        conn.execute(prune_sql, (retention,))
        end_sizes = _sizes(conn)
        end_sizes.update(t=round(time.time() - t0, 1), processed=done.value, pending=0)
        samples.append(end_sizes)
        # The end state after one more retention period and pruning, as a steady system sees it.
        conn.execute("DELETE FROM pgskip.jobs WHERE status = 'pending'")
    probe_end = _probe(url, payload)

    timings.sort()
    k = max(1, len(timings) // 20)
    first = [1000 * dt for _, dt, _ in timings[:k]]
    last = [1000 * dt for _, dt, _ in timings[-k:]]
    curve: list[tuple[int, float | None]] = []
    step = max(1, len(timings) // 40)
    for i in range(0, len(timings), step):
        chunk = timings[i : i + step]
        curve.append((chunk[-1][2], percentile([1000 * dt for _, dt, _ in chunk], 50)))
    out = {
        "messages": done.value,
        "elapsed_s": round(elapsed, 1),
        "rate": done.value / elapsed,
        "pruning": how,
        "pruned_rows": pruned,
        "prune_ms_p50": percentile(prune_ms, 50),
        "prune_ms_max": max(prune_ms) if prune_ms else None,
        "probe_start": probe_start,
        "probe_end": probe_end,
        "fetch_ms_p50_first5pct": percentile(first, 50),
        "fetch_ms_p50_last5pct": percentile(last, 50),
        "max_total_mb": max(s["total_mb"] for s in samples),
        "end": end_sizes,
        "samples": samples,
        "fetch_curve": curve,
        "autovacuum_naptime": autovacuum_naptime or "default (1min)",
        "keep_completed": keep_completed,
    }
    with psycopg.connect(url, autocommit=True) as conn:
        _set_naptime(conn, None)
    log(
        f"steady state: {done.value} messages in {elapsed:.0f} s, max total "
        f"{out['max_total_mb']} MB, probe {probe_start['fetch100_ms_p50']:.2f} -> "
        f"{probe_end['fetch100_ms_p50']:.2f} ms"
    )
    pgskip.reset()
    return out
