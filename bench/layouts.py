"""Layouts of ``jobs`` side by side: how large the table gets and how fast it drains when a
million messages go through it, today's single table against ``jobs`` partitioned by id range
whose finished partitions are dropped whole (PgQ's table rotation, pg_partman's retention).

Each layout runs the same workload as ``bench.steady_state``, in one database of one server:
two consumer processes running the transport's own ``fetch`` (100 at a time) and ``ack``
statements, a producer keeping 5,000-20,000 messages pending with bulk inserts of a real
Celery payload, and the retention of completed messages (``--retention`` seconds) applied
every 2 s:

``single``
    today's schema: ``prune()`` deletes the completed rows past the retention, and autovacuum
    reclaims their space (and the dead versions the status updates leave) when it comes round.
``rotated``
    the same columns and partial indexes on a table partitioned by ``RANGE (id)``, partitions
    of ``--partition-rows`` ids created ahead of the inserts; every 2 s, each partition whose
    messages are all finished, the last one more than ``--retention`` seconds ago, is dropped
    (``DROP TABLE`` under a short ``lock_timeout``; skipped when a lock is held). No pruning
    statement and no vacuum is needed to give its space back. A prototype: the transport's
    statements run unchanged against it, but it has none of the schema's triggers (the claims
    of unique keys), and ``sweep()``, ``prune()`` and the migrations do not know of the
    partitions.

The sizes are those of the table and every partition with their indexes and TOAST, sampled
every 2 s; a controlled probe (10,000 pending rows, 50 fetches of 100) runs on the empty table
before and at the end. Prints figures; asserts nothing. Run::

    python -m bench.layouts --url postgresql://postgres@127.0.0.1:5432/postgres --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .common import log, machine_info, percentile
from .steady_state import FILL, PRUNE_FN, QUEUE, _consumer_main
from .steady_state import _probe as _steady_probe

PAYLOAD = json.dumps(
    {
        "body": "W1sxLCAyXSwge30sIHsiY2FsbGJhY2tzIjogbnVsbCwgImVycmJhY2tzIjogbnVsbH1d" * 8,
        "headers": {
            "lang": "py",
            "task": "bench.noop",
            "id": "00000000-0000-0000-0000-000000000000",
            "retries": 0,
            "root_id": "00000000-0000-0000-0000-000000000000",
            "argsrepr": "(1, 2)",
            "kwargsrepr": "{}",
            "origin": "gen1@bench",
        },
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "properties": {
            "correlation_id": "00000000-0000-0000-0000-000000000000",
            "reply_to": "00000000-0000-0000-0000-000000000000",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": "steady"},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": "00000000-0000-0000-0000-000000000000",
        },
    }
)

SIZE_OF_TREE = """
WITH t AS (
    SELECT 'pgskip.jobs'::regclass AS relid
    UNION ALL
    SELECT inhrelid FROM pg_inherits WHERE inhparent = 'pgskip.jobs'::regclass
)
SELECT sum(pg_relation_size(relid))::float8, sum(pg_indexes_size(relid))::float8,
       sum(pg_total_relation_size(relid))::float8, count(*) - 1
  FROM t
"""

#: The partitions of jobs in id order: (name, upper bound of their ids).
PARTITIONS = """
SELECT c.relname, (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''?(\\d+)'))[1]::bigint
  FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'pgskip.jobs'::regclass
 ORDER BY 2
"""


#: Whether a message marked completed drops its payload (``--compact-completed``): a trigger
#: of the prototype stands for an ack that keeps only what listing a finished message needs.
COMPACT = {"on": False}

COMPACT_TRIGGER = """
CREATE FUNCTION pgskip.layouts_compact() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'completed' THEN
        NEW.payload := '{}';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER layouts_compact BEFORE UPDATE OF status ON pgskip.jobs
    FOR EACH ROW EXECUTE FUNCTION pgskip.layouts_compact();
"""

#: Whether payloads are stored out of line (``--payload-out-of-line``): a status update then
#: writes a new version of the row without copying the payload.
OUT_OF_LINE = {"on": False}


def _partition(conn: psycopg.Connection[Any], start: int, rows: int) -> None:
    name = sql.Identifier("pgskip", f"jobs_p{start // rows}")
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} PARTITION OF pgskip.jobs FOR VALUES FROM ({}) TO ({})"
        ).format(name, sql.Literal(start), sql.Literal(start + rows))
    )
    _out_of_line(conn, name)


def _out_of_line(conn: psycopg.Connection[Any], table: sql.Identifier) -> None:
    if OUT_OF_LINE["on"]:
        conn.execute(sql.SQL("ALTER TABLE {} SET (toast_tuple_target = 128)").format(table))
        conn.execute(
            sql.SQL("ALTER TABLE {} ALTER COLUMN payload SET STORAGE EXTERNAL").format(table)
        )


def make_rotated(conn: psycopg.Connection[Any], rows: int) -> None:
    """Replace pgskip.jobs (empty) by a table of the same columns and partial indexes
    partitioned by id range, with its first partitions."""
    conn.execute("DROP TABLE pgskip.jobs")
    conn.execute(
        """
        CREATE TABLE pgskip.jobs (
            id bigint NOT NULL DEFAULT nextval('pgskip.jobs_rotated_id'),
            queue text NOT NULL,
            priority smallint DEFAULT 0 NOT NULL,
            status pgskip.job_status DEFAULT 'pending' NOT NULL,
            run_at timestamptz DEFAULT now() NOT NULL,
            payload json NOT NULL,
            task_name text,
            task_id text,
            attempts integer DEFAULT 0 NOT NULL,
            redelivered boolean DEFAULT false NOT NULL,
            locked_by uuid,
            locked_at timestamptz,
            expires_at timestamptz,
            created_at timestamptz DEFAULT now() NOT NULL,
            finished_at timestamptz,
            last_error text,
            delivery bigint,
            unique_key text,
            concurrency_key text,
            PRIMARY KEY (id)
        ) PARTITION BY RANGE (id)
        """
    )
    for statement in (
        "CREATE INDEX jobs_dequeue ON pgskip.jobs (queue, priority DESC, run_at, id)"
        " WHERE status = 'pending'",
        "CREATE INDEX jobs_running_rows ON pgskip.jobs (id) WHERE status = 'running'",
        "CREATE INDEX jobs_scheduled ON pgskip.jobs (run_at) WHERE status = 'scheduled'",
        "CREATE INDEX jobs_completed ON pgskip.jobs (finished_at) WHERE status = 'completed'",
        "CREATE INDEX jobs_failed ON pgskip.jobs (queue, finished_at) WHERE status = 'failed'",
        "CREATE INDEX jobs_expiring ON pgskip.jobs (expires_at)"
        " WHERE expires_at IS NOT NULL AND status IN ('pending', 'scheduled')",
    ):
        conn.execute(statement)
    for k in range(3):
        _partition(conn, 1 + k * rows, rows)


def rotate(conn: psycopg.Connection[Any], rows: int, retention: float) -> int:
    """Create partitions ahead of the inserts; drop those whose messages are all finished,
    the last more than ``retention`` seconds ago. Returns how many were dropped."""
    row = conn.execute("SELECT last_value FROM pgskip.jobs_rotated_id").fetchone()
    last = int(row[0]) if row else 0
    parts = conn.execute(PARTITIONS).fetchall()
    top = int(parts[-1][1]) if parts else 1
    while top <= last + 2 * rows:
        _partition(conn, top, rows)
        top += rows
    dropped = 0
    for name, upper in parts:
        if int(upper) > last:
            break  # inserts may still land here
        table = sql.Identifier("pgskip", name)
        busy = conn.execute(
            sql.SQL(
                "SELECT EXISTS (SELECT FROM {t} WHERE status IN ('pending', 'scheduled',"
                " 'running')) OR EXISTS (SELECT FROM {t} WHERE status = 'completed'"
                " AND finished_at > now() - make_interval(secs => {r}))"
            ).format(t=table, r=sql.Literal(retention))
        ).fetchone()
        if busy is None or busy[0]:
            break  # messages are finished in about id order: the later ones are not either
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '100ms'")
                conn.execute(sql.SQL("DROP TABLE {}").format(table))
            dropped += 1
        except psycopg.errors.LockNotAvailable:
            break
    return dropped


def _sizes(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    row = conn.execute(SIZE_OF_TREE).fetchone()
    assert row is not None
    mb = 1024 * 1024
    dead = conn.execute(
        "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(autovacuum_count), 0)"
        " FROM pg_stat_user_tables WHERE schemaname = 'pgskip' AND relname LIKE 'jobs%'"
    ).fetchone()
    assert dead is not None
    return {
        "table_mb": round(row[0] / mb, 2),
        "indexes_mb": round(row[1] / mb, 2),
        "total_mb": round(row[2] / mb, 2),
        "partitions": int(row[3]),
        "dead_tup": int(dead[0]),
        "autovacuums": int(dead[1]),
    }


def _probe(url: str) -> float | None:
    """p50 ms of 50 fetches of 100 from 10,000 pending rows, one client."""
    return _steady_probe(url, PAYLOAD)["fetch100_ms_p50"]  # type: ignore[no-any-return]


def run_layout(
    url: str,
    layout: str,
    messages: int,
    retention: float,
    rows: int,
    *,
    keep: bool = True,
    hold: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """One layout's run; ``hold``: (from, to) seconds into it, a REPEATABLE READ transaction
    of another connection holds a snapshot (having read a row of another table, as a report
    or a shell left open does: it holds no lock on jobs)."""
    from kombu_pgskip.migrate import migrate

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS pgskip CASCADE")
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        if layout == "rotated":
            conn.execute("CREATE SEQUENCE pgskip.jobs_rotated_id")
            make_rotated(conn, rows)
        else:
            _out_of_line(conn, sql.Identifier("pgskip", "jobs"))
        if COMPACT["on"]:
            conn.execute(COMPACT_TRIGGER)
        conn.execute("VACUUM ANALYZE pgskip.jobs")
    probe_start = _probe(url)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    done = ctx.Value("q", 0)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_consumer_main, args=(url, messages, stop, done, results, keep))
        for _ in range(2)
    ]
    samples: list[dict[str, Any]] = []
    housekeeping_ms: list[float] = []
    inserted = dropped = 0
    holder: psycopg.Connection[Any] | None = None
    held_from = held_to = None
    t0 = time.time()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, (QUEUE, PAYLOAD, 20_000))
        inserted += 20_000
        for p in procs:
            p.start()
        next_keep = next_sample = time.time()
        while not stop.is_set() and any(p.is_alive() for p in procs):
            now = time.time()
            if hold is not None and holder is None and held_from is None and now - t0 >= hold[0]:
                holder = psycopg.connect(url)
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM pgskip.migrations")
                held_from = (now - t0, done.value)
            if holder is not None and hold is not None and now - t0 >= hold[1]:
                holder.rollback()
                holder.close()
                holder = None
                held_to = (now - t0, done.value)
            row = conn.execute(
                "SELECT count(*) FROM pgskip.jobs WHERE queue = %s AND status = 'pending'",
                (QUEUE,),
            ).fetchone()
            pending = row[0] if row else 0
            if pending < 5_000 and inserted < messages:
                n = min(15_000, messages - inserted)
                if layout == "rotated":
                    rotate(conn, rows, retention)  # partitions ahead of this insert
                conn.execute(FILL, (QUEUE, PAYLOAD, n))
                inserted += n
            if now >= next_keep:
                c0 = time.perf_counter()
                if layout == "rotated":
                    dropped += rotate(conn, rows, retention)
                else:
                    conn.execute(PRUNE_FN, (retention,))
                housekeeping_ms.append(1000 * (time.perf_counter() - c0))
                next_keep = time.time() + 2.0
            if now >= next_sample:
                s = _sizes(conn)
                s.update(t=round(now - t0, 1), processed=done.value, pending=pending)
                samples.append(s)
                next_sample = now + 2.0
            time.sleep(0.1)
        elapsed = time.time() - t0
        if holder is not None:
            holder.rollback()
            holder.close()
            held_to = (elapsed, done.value)
        timings = [t for _ in procs for t in results.get(timeout=120)]
        for p in procs:
            p.join(30)
        samples.append({**_sizes(conn), "t": round(time.time() - t0, 1), "processed": done.value})
    probe_end = _probe(url)
    timings.sort()
    k = max(1, len(timings) // 20)
    out = {
        "layout": layout,
        "keep_completed": keep,
        "compact_completed": COMPACT["on"],
        "messages": done.value,
        "elapsed_s": round(elapsed, 1),
        "rate": round(done.value / elapsed, 1),
        "max_total_mb": max(s["total_mb"] for s in samples),
        "end_total_mb": samples[-1]["total_mb"],
        "partitions_dropped": dropped,
        "held": None
        if held_from is None or held_to is None
        else {
            "from_s": round(held_from[0], 1),
            "to_s": round(held_to[0], 1),
            "rate": round((held_to[1] - held_from[1]) / (held_to[0] - held_from[0]), 1),
            "rate_outside": round(
                (done.value - (held_to[1] - held_from[1]))
                / (elapsed - (held_to[0] - held_from[0])),
                1,
            ),
        },
        "housekeeping_ms_p50": percentile(housekeeping_ms, 50),
        "housekeeping_ms_max": max(housekeeping_ms) if housekeeping_ms else None,
        "fetch_ms_p50_first5pct": percentile([1000 * dt for _, dt, _ in timings[:k]], 50),
        "fetch_ms_p50_last5pct": percentile([1000 * dt for _, dt, _ in timings[-k:]], 50),
        "probe_start_ms_p50": probe_start,
        "probe_end_ms_p50": probe_end,
        "samples": samples,
    }
    log(
        f"{layout}: {done.value} messages in {elapsed:.0f} s ({out['rate']:.0f}/s), max "
        f"{out['max_total_mb']} MB, end {out['end_total_mb']} MB, "
        f"probe {probe_start} -> {probe_end} ms"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a database this bench may drop pgskip in")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--retention", type=float, default=10.0)
    parser.add_argument("--partition-rows", type=int, default=100_000)
    parser.add_argument("--layouts", default="single,rotated")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--ack-deletes", action="store_true", help="acks delete (keep_completed=False)"
    )
    parser.add_argument(
        "--hold",
        default=None,
        help="FROM,TO: seconds into each run during which another session holds a snapshot",
    )
    parser.add_argument(
        "--compact-completed",
        action="store_true",
        help="a message marked completed keeps no payload (a trigger), both layouts",
    )
    parser.add_argument(
        "--payload-out-of-line",
        action="store_true",
        help="store payloads in TOAST (toast_tuple_target 128, STORAGE EXTERNAL), both layouts",
    )
    args = parser.parse_args()
    OUT_OF_LINE["on"] = args.payload_out_of_line
    COMPACT["on"] = args.compact_completed
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "layouts": {}}
    with psycopg.connect(args.url) as conn:
        results["server"] = {
            name: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]  # type: ignore[index]
            for name in ("server_version", "autovacuum_naptime", "shared_buffers", "fsync")
        }
    for layout in args.layouts.split(","):
        results["layouts"][layout] = run_layout(
            args.url,
            layout,
            args.messages,
            args.retention,
            args.partition_rows,
            keep=not args.ack_deletes,
            hold=tuple(float(x) for x in args.hold.split(",")) if args.hold else None,  # type: ignore[arg-type]
        )
    summary = {
        name: {k: v for k, v in r.items() if k != "samples"}
        for name, r in results["layouts"].items()
    }
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
