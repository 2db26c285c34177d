"""Where pgskip's time goes: ``python -m bench.profile [--tasks N] [--out DIR]``.

1. Worker side: a backlog of ``N`` tasks, then a ``-P threads -c 4`` worker drains it while
   ``py-spy`` samples it (collapsed stacks in ``worker.txt``, summarised as the share of samples
   per function in ``profile.json``; flamegraph.pl or inferno draw a flame graph from it), with
   ``pg_stat_statements`` and ``pg_stat_wal`` counting statements, rows and WAL flushes per task.
2. Publisher: ``N`` durable ``apply_async`` calls under cProfile (``publisher.pstats``), with the
   same statement counts.
3. CPU per publish (``--publish-cpu`` runs only this): client CPU (the process's CPU time),
   server CPU (the backend's utime + stime from ``/proc``) and wall time per durable publish,
   for a kombu ``Producer`` to a named direct exchange (routed through its bindings by
   ``publish_routed``, one statement, at every publish) and to the default exchange (the
   queue named by the routing key: ``insert_message`` then ``announce``) and for Celery's
   ``apply_async``; medians of 5 rounds of 2,000. CPU time is far less disturbed by other load
   than wall time, so it shows what a change to the publish path saves.
4. Plans of the worker's fetch (``--fetch-plans`` runs only this): server CPU and wall time per
   ``ack_fetch`` on the event-loop fetcher's connection (``AsyncFetcher``) with PostgreSQL's
   default ``plan_cache_mode`` (a custom plan, planned for every fetch) and with the forced
   generic plan the fetcher uses, for fetches of 4 and of 100 rows (each acking the previous
   batch) from a table of 60,000 pending rows; medians of 5 alternating rounds.
5. End to end, where the CPU goes (``--e2e-cpu`` runs only this): an idle ``-P threads -c 4``
   worker, one publisher calling ``apply_async`` 3,000 times back to back, for each
   ``fetch_cooldown`` in turn (fixed at 0, 0.002 and 0.005, and the default 0.002 adapting up
   to ``fetch_cooldown_max`` 0.02; ``--e2e-cooldowns`` picks others; rounds alternate): the
   rate, the worker's ``ack_fetch`` statements per task and the share of them that took
   nothing, its statements of acks alone per task (``pg_stat_statements``), CPU per task of the
   publisher, the worker's process tree and all the database's client backends together (the
   publisher's, the worker's fetch, LISTEN and heartbeat connections; utime + stime from
   ``/proc``), and the time from just before each ``apply_async`` to the task's start (p50,
   p99) in that stream. ``--e2e-workers N`` runs N such workers on the one queue (every
   notification then wakes all of them; their CPU is summed). ``--e2e-gap S`` pauses S seconds
   after each ``apply_async`` (1,000 tasks then): a trickle that leaves the workers idle
   between tasks, where every task wakes every idle worker.
6. Blocking kombu consumers (``--blocking`` runs only this): ``N`` processes each running a
   kombu ``Consumer`` (prefetch 10, acking each message) in a ``drain_events`` loop, as a
   ``ConsumerMixin`` does, on one queue; one kombu producer publishing 2,000 durable messages
   at a fixed rate (``--blocking-rate``, default 500/s). For each ``N`` of
   ``--blocking-consumers`` (default 1,3,6) and each ``--e2e-cooldowns`` setting in turn
   (rounds alternate): ``ack_fetch`` statements per message and ack statements of their own
   (acks no fetch carried) per message, the consumers' CPU per message,
   the time from publish to the consumer's callback (p50, p99), and how many of the notified
   fetches took nothing.

7. A routed publish beside a large fleet (``--fleet`` runs only this): wall time per
   ``Store.publish_routed`` (the publish path through a named exchange without kombu;
   ``synchronous_commit=off`` on its connection, so that the figure is the statement's and not
   the disk's) to a queue bound to a direct exchange and consumed by one consumer registered
   after the fleet, with the consumer rows of a fleet of workers of ``--fleet-sizes`` (default
   1,1000,3000; each worker has a row for ``celery`` and one for its own remote-control queue),
   for three shapes of the queue: without ``x-expires``; with an ``x-expires`` of 10 s, used
   within it; and with that ``x-expires`` run out since its last use, which ``publish_routed``
   answers by looking for a live consumer of the queue in ``consumers`` (a scan: no index
   covers ``consumers.queues``). A Celery remote-control queue (``x-expires`` 10 s) is in that
   last shape from the end of its 10 s until its consumer's next heartbeat marks it used
   (every ``lease_seconds / 3``, 10 s by default). Medians of 5 rounds of 1,000 after 50.
   Measures how the one read of ``consumers`` a publish makes grows with the number of
   workers.

8. What the partitions of ``jobs`` cost a fetch (``--fetch-partitions`` runs only this): wall
   time and server CPU per ``ack_fetch`` as the event-loop fetcher runs it (prepared, its
   generic plan, asynchronous commit), each fetch taking the one message inserted before it
   and acking the one before, against the same statement with ``slot = 0`` in every read of
   ``jobs``, which its plan reads ``jobs_kept`` alone for (one partition, with the same
   indexes: what the statement costs on one table), and against the statement an idle worker
   sends for a message a notification named (*named*: ``take_announced``, the message by its
   id on its slot; no acks, the message before marked completed outside the timing), and
   against the floor of that take (*floor*: a bare ``UPDATE`` of the message by its id on its
   slot, setting what the take sets and returning what it returns, prepared with a generic plan
   on a psycopg connection with asynchronous commit; no queue, pause, limit or expiry
   conditions, no urgent probe). The message waits 10 ms before its fetch (*idle*: the backend
   and this process asleep in between, as for a task that arrives at an idle worker) or not at
   all (*busy*). Medians of 5 alternating rounds of 200 after 20.

9. From a commit to an idle consumer's rows (``--notified-fetch`` runs only this): one
   process publishes a durable message through kombu every ``gap`` (20 ms, as the latency
   benchmark), another waits on the transport's LISTEN connection (``Poller``) as an idle
   worker does and, on each notification, sends one statement on a connection of its own
   before the fetch that takes the message: ``SELECT 1`` (the round trip to a backend that
   was idle), ``ack_fetch`` of a queue that holds nothing on ``jobs`` and on ``jobs_kept``
   alone (what the statement costs before it takes anything, with and without the ring's
   partitions), or, for ``fetch``, the transport's fetch itself; ``fetch_on_listener`` sends
   that fetch on the LISTEN connection, one backend for both. Times from the publish's
   return to the notification and to that statement's answer, p50 over 200 messages; medians
   of 3 alternating rounds.

10. The sweep under a held snapshot (``--sweep-held`` runs only this): another session holds a
    REPEATABLE READ snapshot while ``--sweep-messages`` messages (default 200,000) go through
    ``jobs`` as a worker takes them (pending, running, completed; in batches of 5,000), so that
    every running version stays in the index of running rows. Then the wall time per sweep on
    a local connection, medians of 7: ``sweep(20)``, which reads every running row at every
    call (as pg_cron's job does, and every worker's sweep did before migration 0030), and a
    worker's ``sweep(20, '1 minute')`` within the minute after a read, which does not read
    them. A worker sweeps every ``sweep_interval`` (10 s), so a fleet of N workers made that
    read N times per 10 s; a worker's sweep now makes it once a minute per database.

It runs its own EmbeddedPostgres (fsync on) with ``pg_stat_statements`` preloaded.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import functools
import json
import pstats
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from .brokers import Broker
from .common import REPO, descendants, log, median, percentile
from .workers import (
    StampDir,
    Worker,
    idle_worker,
    new_queue,
    publish_backlog,
    publisher_app,
    warm_up,
)

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


def _backend_cpu_s(pid: int) -> float:
    """utime + stime of a local PostgreSQL backend, in seconds."""
    import os

    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def publish_cpu(broker: Broker, *, rounds: int = 5, n: int = 2000) -> dict[str, Any]:
    """Client CPU, backend CPU and wall time per durable publish, in microseconds."""
    from kombu import Connection, Exchange, Producer, Queue

    app = publisher_app(broker, new_queue("cpu"))
    task = app.tasks["bench.noop"]
    body = {"i": 0, "pad": "x" * 200}
    out: dict[str, Any] = {"rounds": rounds, "calls_per_round": n}
    with Connection(broker.url, transport_options=broker.transport_options) as conn:
        chan = conn.channel()
        named = Exchange("bench.cpu", "direct", durable=True)
        Queue("bench.cpu", named, routing_key="bench.cpu", durable=True)(chan).declare()
        named_publish = Producer(
            chan, exchange=named, routing_key="bench.cpu", serializer="json"
        ).publish

        calls: dict[str, Callable[..., Any]] = {
            "kombu_named_exchange": named_publish,
            "kombu_default_exchange": Producer(
                chan, exchange=Exchange(""), routing_key="bench.cpu", serializer="json"
            ).publish,
            "celery_apply_async": lambda *_a, **_k: task.apply_async(kwargs={"i": 0}),
        }
        for call in calls.values():
            for _ in range(50):
                call(body, delivery_mode=2)
        kombu_pid = chan.store.conn.info.backend_pid
        with psycopg.connect(broker.db_url or "", autocommit=True) as admin:
            pids = {
                r[0]
                for r in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'kombu-pgskip'"
                )
            }
            celery_pid = (pids - {kombu_pid}).pop()
            samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    pid = celery_pid if name.startswith("celery") else kombu_pid
                    c0, b0, w0 = time.process_time(), _backend_cpu_s(pid), time.perf_counter()
                    for _ in range(n):
                        call(body, delivery_mode=2)
                    w1, b1, c1 = time.perf_counter(), _backend_cpu_s(pid), time.process_time()
                    samples[name].append(
                        (1e6 * (c1 - c0) / n, 1e6 * (b1 - b0) / n, 1e6 * (w1 - w0) / n)
                    )
                admin.execute("TRUNCATE pgskip.jobs")
    app.close()
    for name, rows in samples.items():
        out[name] = {
            key: round(float(median(r[i] for r in rows) or 0.0), 1)
            for i, key in enumerate(("client_cpu_us", "server_cpu_us", "wall_us"))
        }
    return out


def fetch_plans(url: str, *, rounds: int = 5) -> dict[str, Any]:
    """Server CPU and wall time per ``ack_fetch`` with a custom plan per fetch (PostgreSQL's
    default choice) and with the generic plan the event-loop fetcher forces, in microseconds."""
    import uuid

    from kombu_pgskip.fetcher import AsyncFetcher

    payload = sample_message_json()
    consumer = uuid.uuid4()
    out: dict[str, Any] = {"rounds": rounds, "pending_rows": 60_000}
    samples: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    with psycopg.connect(url, autocommit=True) as admin:
        fetchers = {}
        for mode in ("auto", "force_generic_plan"):
            fetcher = AsyncFetcher(url, schema="pgskip", asynchronous_commit=False,
                                   connect_timeout=10)  # fmt: skip
            fetcher.fileno()  # connects and prepares
            assert fetcher._conn is not None
            fetcher._conn.execute(f"SET plan_cache_mode TO {mode}")
            fetchers[mode] = fetcher
        try:
            for _ in range(rounds):
                for limit, calls in ((4, 1000), (100, 200)):
                    for mode, fetcher in fetchers.items():
                        admin.execute("TRUNCATE pgskip.jobs")
                        admin.execute(
                            "INSERT INTO pgskip.jobs (queue, payload) "
                            "SELECT 'plans', %s::json FROM generate_series(1, 60000)",
                            (payload,),
                        )
                        admin.execute("VACUUM ANALYZE pgskip.jobs")
                        assert fetcher._conn is not None
                        pid = fetcher._conn.info.backend_pid
                        tags: list[tuple[int, int]] = []
                        for i in range(calls + 10):
                            if i == 10:
                                b0, w0 = _backend_cpu_s(pid), time.perf_counter()
                            fetcher.send(tags, ["plans"], limit, consumer)
                            result = fetcher.wait()
                            assert result is not None
                            tags = [r.tag for r in result[1]]
                        w1, b1 = time.perf_counter(), _backend_cpu_s(pid)
                        samples[f"{mode}_limit_{limit}"].append(
                            (1e6 * (b1 - b0) / calls, 1e6 * (w1 - w0) / calls)
                        )
        finally:
            for fetcher in fetchers.values():
                fetcher.close()
    out.update(_round_medians(samples, ("server_cpu_us", "wall_us")))
    return out


def _round_medians(
    samples: dict[str, list[tuple[float, float]]], keys: tuple[str, str]
) -> dict[str, dict[str, float]]:
    """Each name's rounds reduced to the median of each figure, named by ``keys``."""
    return {
        name: {
            key: round(float(median(r[i] for r in rows) or 0.0), 1) for i, key in enumerate(keys)
        }
        for name, rows in samples.items()
    }


def in_slot(fetcher: Any, slot: int) -> bytes:
    """The fetcher's ``ack_fetch`` reading one slot of ``jobs`` wherever it reads ``jobs``, as
    the take by id does (``fetcher.py``): 0 is ``jobs_kept``, what the statement costs on one
    table."""
    from kombu_pgskip.fetcher import _one_slot

    return _one_slot(fetcher._query, "pgskip").replace(b"{slot}", str(slot).encode())


def fetch_partitions(url: str, *, rounds: int = 5, calls: int = 200) -> dict[str, Any]:
    """Wall time and server CPU per ``ack_fetch`` on the partitioned ``jobs`` against the same
    statement on one of its partitions, in microseconds (part 8 above)."""
    import uuid

    from kombu_pgskip.fetcher import AsyncFetcher

    payload = sample_message_json()
    consumer = uuid.uuid4()
    # From an empty table: statistics left by an earlier part (fetch_plans analyzes 60,000
    # rows) would otherwise choose the generic plans, prepared below, for another table.
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("TRUNCATE pgskip.jobs")
        row = admin.execute("SELECT pgskip.current_slot()").fetchone()
        current = int(row[0]) if row else 1
    bare = psycopg.connect(url, autocommit=True)
    bare.execute("SET synchronous_commit TO off")
    bare.execute("SET plan_cache_mode TO force_generic_plan")
    floor = (
        "UPDATE pgskip.jobs"
        "   SET status = 'running', locked_by = %s, locked_at = now(),"
        "       attempts = attempts + 1, delivery = (SELECT pg_current_xact_id()::text::bigint)"
        f" WHERE slot = {current} AND id = %s AND status = 'pending'"
        " RETURNING id, queue, payload, redelivered, attempts, expires_at, run_at::text"
    )
    fetchers: dict[str, AsyncFetcher] = {}
    for layout in ("partitioned", "one_partition", "named"):
        fetcher = AsyncFetcher(url, schema="pgskip", asynchronous_commit=True,
                               connect_timeout=10)  # fmt: skip
        if layout == "one_partition":
            fetcher._query = in_slot(fetcher, 0)
        fetcher.fileno()  # connects and prepares
        fetchers[layout] = fetcher
    # The message of a fetch from jobs_kept is written to its slot (0), the others to the
    # current slot (nothing rotates the ring here).
    slot = {
        "partitioned": "pgskip.current_slot()",
        "one_partition": "0",
        "named": str(current),
        "floor": str(current),
    }
    layouts: list[tuple[str, AsyncFetcher | None]] = [*fetchers.items(), ("floor", None)]
    samples: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    try:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SET synchronous_commit TO off")
            for _ in range(rounds):
                for gap, phase in ((0.01, "idle"), (0.0, "busy")):
                    for layout, sender in layouts:
                        conn = bare if sender is None else sender._conn
                        assert conn is not None
                        pid = conn.info.backend_pid
                        tags: list[tuple[int, int]] = []
                        walls: list[float] = []
                        cpu = 0.0
                        for i in range(calls + 20):
                            row = admin.execute(
                                "INSERT INTO pgskip.jobs (queue, payload, slot) "
                                f"VALUES ('partitions', %s::json, {slot[layout]}) "
                                "RETURNING id, slot",
                                (payload,),
                            ).fetchone()
                            assert row is not None
                            named = (int(row[0]), int(row[1])) if layout == "named" else None
                            if gap:
                                time.sleep(gap)
                            if sender is None:
                                b0, w0 = _backend_cpu_s(pid), time.perf_counter()
                                taken = bare.execute(
                                    floor, (consumer, int(row[0])), prepare=True
                                ).fetchall()
                                w1, b1 = time.perf_counter(), _backend_cpu_s(pid)
                                assert len(taken) == 1, taken
                                tags = [(int(row[0]), 0)]
                            else:
                                b0, w0 = _backend_cpu_s(pid), time.perf_counter()
                                sender.send(tags, ["partitions"], 4, consumer, named=named)
                                result = sender.wait()
                                w1, b1 = time.perf_counter(), _backend_cpu_s(pid)
                                assert result is not None and len(result[1]) == 1, result
                                tags = [r.tag for r in result[1]]
                            if layout in ("named", "floor"):  # no acks carried
                                admin.execute(
                                    "UPDATE pgskip.jobs SET status = 'completed' WHERE id = %s",
                                    (tags[0][0],),
                                )
                                tags = []
                            if i >= 20:
                                walls.append(w1 - w0)
                                cpu += b1 - b0
                        samples[f"{layout}_{phase}"].append(
                            (1e6 * (median(walls) or 0.0), 1e6 * cpu / calls)
                        )
    finally:
        bare.close()
        for fetcher in fetchers.values():
            fetcher.close()
    out: dict[str, Any] = {"rounds": rounds, "calls": calls, "idle_gap_s": 0.01}
    out.update(_round_medians(samples, ("wall_us_p50", "server_cpu_us")))
    return out


def sweep_held(url: str, *, messages: int = 200_000, calls: int = 7) -> dict[str, Any]:
    """Wall time per sweep() with and without its read of every running row, under a held
    snapshot that keeps every running version of ``messages`` messages (part 10 above)."""
    import uuid

    payload = sample_message_json()
    batch = 5_000
    out: dict[str, Any] = {"messages": messages, "calls": calls}
    with (
        psycopg.connect(url, autocommit=True) as holder,
        psycopg.connect(url, autocommit=True) as conn,
    ):
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgskip.sweep_scans")
        consumer = uuid.uuid4()
        conn.execute(
            "INSERT INTO pgskip.consumers (id, hostname, pid, queues, lease_until)"
            " VALUES (%s, 'bench', 0, '{held}', now() + interval '1 hour')",
            (consumer,),
        )
        t0 = time.perf_counter()
        for _ in range(messages // batch):
            ids = [
                r[0]
                for r in conn.execute(
                    "INSERT INTO pgskip.jobs (queue, payload)"
                    " SELECT 'held', %s::json FROM generate_series(1, %s) RETURNING id",
                    (payload, batch),
                ).fetchall()
            ]
            conn.execute(
                "UPDATE pgskip.jobs SET status = 'running', locked_by = %s, locked_at = now()"
                " WHERE id = ANY(%s)",
                (consumer, ids),
            )
            conn.execute(
                "UPDATE pgskip.jobs SET status = 'completed', finished_at = now(),"
                " locked_by = NULL WHERE id = ANY(%s)",
                (ids,),
            )
        out["load_s"] = time.perf_counter() - t0
        conn.execute("SET jit = off")

        def timed(statement: str) -> float:
            walls = []
            for _ in range(calls):
                w0 = time.perf_counter()
                conn.execute(statement).fetchall()
                walls.append(time.perf_counter() - w0)
            return 1e3 * (median(walls) or 0.0)

        out["reads_ms"] = timed("SELECT * FROM pgskip.sweep(20)")
        out["skips_ms"] = timed("SELECT * FROM pgskip.sweep(20, '1 minute')")
        holder.execute("ROLLBACK")
    return out


_NOTIFIED_PUBLISHER = """
import json, sys, time
from kombu import Connection, Exchange, Queue
url, n, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
returned = []
with Connection(url) as conn:
    queue = Queue("notified", Exchange("notified", type="direct"), routing_key="notified")
    producer = conn.Producer()
    producer.publish({}, exchange=queue.exchange, routing_key="notified", declare=[queue])
    time.sleep(1.0)
    for i in range(n):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="notified")
        returned.append(time.time())
        time.sleep(gap)
json.dump(returned, sys.stdout)
"""

NOTIFIED_ARMS = (
    "select_1",
    "fetch_empty_jobs",
    "fetch_empty_jobs_kept",
    "fetch",
    "fetch_on_listener",
)


def _notified_round(
    broker: Broker, url: str, arm: str, *, samples: int, gap: float
) -> dict[str, float]:
    """One round of part 9: p50s in microseconds after the publish returned."""
    import select
    import sys
    import uuid

    from kombu_pgskip.fetcher import AsyncFetcher
    from kombu_pgskip.poller import Poller, Ready

    consumer = uuid.uuid4()
    fetcher = AsyncFetcher(url, schema="pgskip", asynchronous_commit=True, connect_timeout=10)
    probe = AsyncFetcher(url, schema="pgskip", asynchronous_commit=True, connect_timeout=10)
    if arm == "fetch_empty_jobs_kept":
        probe._query = in_slot(probe, 0)
    poller = Poller(url, schema="pgskip", listen=True, connect_timeout=10)
    publisher: subprocess.Popen[bytes] | None = None
    try:
        fetcher.fileno(), probe.fileno()  # connect and prepare
        if arm == "fetch_on_listener":
            from psycopg import sql

            assert fetcher._conn is not None
            for channel in poller._channels:
                fetcher._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            poller._listener = fetcher._conn
        poller.ensure_listener()
        publisher = subprocess.Popen(
            [sys.executable, "-c", _NOTIFIED_PUBLISHER, broker.url or "", str(samples), str(gap)],
            stdout=subprocess.PIPE,
        )
        notified: list[float] = []
        answered: list[float] = []
        tags: list[tuple[int, int]] = []
        taken = 0
        deadline = time.monotonic() + samples * gap + 60
        while taken < samples + 1 and time.monotonic() < deadline:
            poller.waiting = True
            ready = poller.wait(1.0)
            poller.waiting = False
            if ready is not Ready.NOTIFIED or not poller.notifications().queues:
                continue
            t_notified = time.time()
            if arm == "select_1":
                assert probe._conn is not None
                pgconn = probe._conn.pgconn
                pgconn.send_query(b"SELECT 1")
                while True:
                    select.select([pgconn.socket], [], [], 5.0)
                    pgconn.consume_input()
                    if not pgconn.is_busy():
                        break
                while pgconn.get_result() is not None:
                    pass
            elif arm.startswith("fetch_empty"):
                probe.send([], ["notified.nothing"], 4, consumer)
                probe.wait()
            t_answered = time.time()  # the fetch arms time the fetch below instead
            fetcher.send(tags, ["notified"], 4, consumer)
            result = fetcher.wait()
            assert result is not None
            if arm in ("fetch", "fetch_on_listener"):
                t_answered = time.time()
            tags = [row.tag for row in result[1]]
            for _ in result[1]:
                notified.append(t_notified)
                answered.append(t_answered)
            taken += len(result[1])
        out, _ = publisher.communicate(timeout=60)
        returned = json.loads(out)
    finally:
        if publisher is not None and publisher.poll() is None:
            publisher.kill()
        fetcher.close()
        probe.close()
        poller.close()
    # the first message taken is the one published with the queue's declaration
    pairs = list(zip(returned, notified[1:], answered[1:], strict=False))
    return {
        "notified_us_p50": 1e6 * (median([n - r for r, n, _ in pairs]) or 0.0),
        "answered_us_p50": 1e6 * (median([a - r for r, _, a in pairs]) or 0.0),
    }


def notified_fetch(
    broker: Broker, url: str, *, rounds: int = 3, samples: int = 200, gap: float = 0.02
) -> dict[str, Any]:
    """Part 9 above."""
    samples_by_arm: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for r in range(rounds):
        for arm in NOTIFIED_ARMS if r % 2 == 0 else NOTIFIED_ARMS[::-1]:
            got = _notified_round(broker, url, arm, samples=samples, gap=gap)
            log(f"notified fetch, {arm}: {got}")
            samples_by_arm[arm].append((got["notified_us_p50"], got["answered_us_p50"]))
    out: dict[str, Any] = {"rounds": rounds, "samples": samples, "gap_s": gap}
    out.update(_round_medians(samples_by_arm, ("notified_us_p50", "answered_us_p50")))
    return out


# (fetch_cooldown, fetch_cooldown_max): fixed at 0, 2 ms and 5 ms, and the default.
Cooldown = tuple[float, float]
E2E_COOLDOWNS: tuple[Cooldown, ...] = (
    (0.0, 0.0),
    (0.002, 0.002),
    (0.005, 0.005),
    (0.002, 0.02),
)


def e2e_cpu(
    broker: Broker,
    admin: psycopg.Connection[Any],
    *,
    cooldowns: tuple[Cooldown, ...] = E2E_COOLDOWNS,
    rounds: int = 3,
    n: int = 3000,
    workers: int = 1,
    gap: float = 0.0,
) -> dict[str, Any]:
    """Per task, end to end: fetch statements and CPU of every process, by ``fetch_cooldown``
    and ``fetch_cooldown_max``; ``workers`` worker processes on the one queue."""

    def cpu_s(pid: int) -> float:
        try:
            return _backend_cpu_s(pid)
        except OSError:
            return 0.0

    samples: dict[Cooldown, list[dict[str, float]]] = {c: [] for c in cooldowns}
    for _ in range(rounds):
        for cooldown in cooldowns:
            b = dataclasses.replace(
                broker,
                transport_options={
                    "fetch_cooldown": cooldown[0],
                    "fetch_cooldown_max": cooldown[1],
                },
            )
            with idle_worker(b, "e2ecpu", workers) as (app, stamps, started):
                if not warm_up(app, stamps):
                    raise RuntimeError(f"worker did not start: {started[0].log_tail()}")
                task = app.tasks["bench.noop"]
                task.apply_async(kwargs={"i": -1})
                time.sleep(1.0)
                backends = [
                    r[0]
                    for r in admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                        " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
                    )
                ]
                tree = [pid for w in started for pid in (w.pid, *descendants(w.pid))]
                _reset(admin)
                c0, w0 = time.process_time(), sum(cpu_s(p) for p in tree)
                b0 = sum(cpu_s(p) for p in backends)
                sent: list[float] = []
                t0 = time.time()
                for i in range(n):
                    sent.append(time.time())
                    task.apply_async(kwargs={"i": i})
                    if gap:
                        time.sleep(gap)
                stamps.wait_for(n, 180)
                started = {i: t for i, t in stamps.read() if i >= 0}
                last = max(started.values())
                waits = [started[i] - sent[i] for i in range(n) if i in started]
                c1, w1 = time.process_time(), sum(cpu_s(p) for p in tree)
                b1 = sum(cpu_s(p) for p in backends)
                fetches = admin.execute(
                    "SELECT coalesce(sum(calls), 0), coalesce(sum(rows), 0) FROM pg_stat_statements"
                    " WHERE query LIKE 'WITH acked AS%%'"
                ).fetchone()
                acks = admin.execute(ACK_CALLS).fetchone()
                row = {
                    "rate": n / (last - t0),
                    "fetches_per_task": float(fetches[0] if fetches else 0) / n,
                    "acks_alone_per_task": float(acks[0] if acks else 0) / n,
                    # ack_fetch returns one row per message taken, and one message-less row
                    # when nothing was due: each task is taken once, the rest are empty fetches.
                    "empty_fetch_share": max(0.0, float(fetches[1]) - n)
                    / max(1.0, float(fetches[0]))
                    if fetches
                    else 0.0,
                    "publisher_cpu_us": 1e6 * (c1 - c0) / n,
                    "worker_cpu_us": 1e6 * (w1 - w0) / n,
                    "backends_cpu_us": 1e6 * (b1 - b0) / n,
                    "publish_to_start_ms_p50": 1e3 * (percentile(waits, 50) or 0.0),
                    "publish_to_start_ms_p99": 1e3 * (percentile(waits, 99) or 0.0),
                }
                samples[cooldown].append(row)
                log(f"e2e cpu, {_cooldown_name(cooldown)}: {row['rate']:.0f} tasks/s")
    out: dict[str, Any] = {"rounds": rounds, "tasks": n, "worker_processes": workers}
    if gap:
        out["gap_s"] = gap
    for cooldown, rows in samples.items():
        out[_cooldown_name(cooldown)] = {
            key: round(float(median(r[key] for r in rows if key in r) or 0.0), 2) for key in rows[0]
        } | {"rates": [round(r["rate"]) for r in rows]}
    return out


# Acks written by a statement of their own (not carried by a fetch): Store.ack.
ACK_CALLS = (
    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
    " WHERE query LIKE 'UPDATE %%jobs AS jobs%%finished_at = now(), locked_by = %%'"
    " AND query NOT LIKE '%%last_error%%'"
)


def _blocking_consumer(
    url: str, options: dict[str, Any], queue_name: str, ready: Any, stop: Any, results: Any
) -> None:
    """One blocking consumer process (part 6): latencies, CPU and what its cooldown saw."""
    from kombu import Connection, Consumer, Exchange, Queue

    from kombu_pgskip import policy

    seen = {"empty": 0, "rows": 0}
    observe = policy.Cooldown.observe

    def counted(self: Any, rows: int) -> None:
        seen["empty" if rows == 0 else "rows"] += 1
        observe(self, rows)

    policy.Cooldown.observe = counted  # type: ignore[method-assign,assignment]
    queue = Queue(queue_name, Exchange(queue_name), queue_name)
    waits: list[float] = []

    def take(body: Any, message: Any) -> None:
        waits.append(time.time() - body["t"])
        message.ack()

    with Connection(url, transport_options=options) as conn:
        consumer = Consumer(conn.channel(), [queue], callbacks=[take], prefetch_count=10)
        with consumer:
            ready.set()
            c0 = time.process_time()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)
            cpu = time.process_time() - c0
    results.put((waits, cpu, seen["empty"], seen["rows"]))


def blocking_consumers(
    broker: Broker,
    admin: psycopg.Connection[Any],
    *,
    cooldowns: tuple[Cooldown, ...] = E2E_COOLDOWNS,
    consumers: tuple[int, ...] = (1, 3, 6),
    rate: float = 500.0,
    rounds: int = 2,
    n: int = 2000,
) -> dict[str, Any]:
    """Part 6: blocking kombu consumers on one queue, a producer at ``rate`` messages/s."""
    import multiprocessing as mp

    from kombu import Connection, Exchange, Producer, Queue

    url = broker.url or ""
    samples: dict[tuple[int, Cooldown], list[dict[str, float]]] = {
        (c, cd): [] for c in consumers for cd in cooldowns
    }
    for _ in range(rounds):
        for count in consumers:
            for cooldown in cooldowns:
                name = new_queue("blocking")
                queue = Queue(name, Exchange(name), name)
                options = {
                    "polling_interval": 5,
                    "fetch_cooldown": cooldown[0],
                    "fetch_cooldown_max": cooldown[1],
                }
                stop, results = mp.Event(), mp.Queue()  # type: ignore[var-annotated]
                readies = [mp.Event() for _ in range(count)]
                with Connection(url) as conn:
                    producer = Producer(conn.channel(), exchange=queue.exchange, routing_key=name)
                    producer.publish({"t": time.time()}, declare=[queue])  # declared, warmed
                    procs = [
                        mp.Process(
                            target=_blocking_consumer,
                            args=(url, options, name, ready, stop, results),
                        )
                        for ready in readies
                    ]
                    for proc in procs:
                        proc.start()
                    for ready in readies:
                        ready.wait(30)
                    time.sleep(0.5)
                    _reset(admin)
                    t0 = time.time()
                    for i in range(n):
                        ahead = t0 + i / rate - time.time()
                        if ahead > 0:
                            time.sleep(ahead)
                        producer.publish({"i": i, "t": time.time()})
                deadline = time.time() + 60
                while time.time() < deadline:
                    left = admin.execute(
                        "SELECT count(*) FROM pgskip.jobs WHERE queue = %s"
                        " AND status <> 'completed'",
                        (name,),
                    ).fetchone()
                    if left and left[0] == 0:
                        break
                    time.sleep(0.05)
                time.sleep(0.3)  # the last acks written
                fetches = admin.execute(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
                    " WHERE query LIKE 'WITH acked AS%%'"
                ).fetchone()
                acks = admin.execute(ACK_CALLS).fetchone()
                stop.set()
                got = [results.get(timeout=60) for _ in procs]
                for proc in procs:
                    proc.join(30)
                waits = [w for g in got for w in g[0]][1:]  # not the warm-up message
                empty, taking = sum(g[2] for g in got), sum(g[3] for g in got)
                row = {
                    "received": float(len(waits)),
                    "fetches_per_message": float(fetches[0] if fetches else 0) / n,
                    "ack_statements_per_message": float(acks[0] if acks else 0) / n,
                    "consumers_cpu_us": 1e6 * sum(g[1] for g in got) / n,
                    "publish_to_callback_ms_p50": 1e3 * (percentile(waits, 50) or 0.0),
                    "publish_to_callback_ms_p99": 1e3 * (percentile(waits, 99) or 0.0),
                    "notified_fetches_empty_share": empty / max(1, empty + taking),
                }
                samples[(count, cooldown)].append(row)
                log(
                    f"blocking, {count} consumers, {_cooldown_name(cooldown)}: "
                    f"{row['fetches_per_message']:.2f} fetches/message, "
                    f"p50 {row['publish_to_callback_ms_p50']:.2f} ms"
                )
    out: dict[str, Any] = {"rounds": rounds, "messages": n, "rate": rate}
    for (count, cooldown), rows in samples.items():
        out.setdefault(f"{count} consumers", {})[_cooldown_name(cooldown)] = {
            key: round(float(median(r[key] for r in rows) or 0.0), 2) for key in rows[0]
        }
    return out


def sample_message_json() -> str:
    """A kombu message as the transport stores it (about 600 bytes)."""
    body = "eyJpIjogMCwgInBhZCI6ICJ4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4In0="
    return json.dumps(
        {
            "body": body * 6,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {"delivery_mode": 2, "priority": 0, "body_encoding": "base64"},
        }
    )


def _cooldown_name(cooldown: Cooldown) -> str:
    base, ceiling = cooldown
    name = f"fetch_cooldown={base}"
    if ceiling > base:
        name += f", fetch_cooldown_max={ceiling}"
    return name


def _cooldowns(text: str) -> tuple[Cooldown, ...]:
    """``0.002:0.02,0.005`` as ((0.002, 0.02), (0.005, 0.005))."""
    out = []
    for part in text.split(","):
        base, _, ceiling = part.partition(":")
        out.append((float(base), float(ceiling or base)))
    return tuple(out)


FLEET_SHAPES: dict[str, tuple[int | None, bool]] = {
    # name: (the queue's x-expires in ms, its last use longer ago than that)
    "no_expires": (None, False),
    "expires_used": (10_000, False),
    "expires_lapsed": (10_000, True),
}
#: Puts the queue's last use this many seconds back (part 7).
MARK_USED = (
    "UPDATE pgskip.queues SET last_used_at = now() - make_interval(secs => %s) WHERE name = %s"
)


def fleet(
    url: str, *, sizes: tuple[int, ...] = (1, 1000, 3000), rounds: int = 5, n: int = 1000
) -> dict[str, Any]:
    """Wall time per ``Store.publish_routed`` (us) by queue shape and fleet size (part 7)."""
    import uuid

    from kombu_pgskip.store import NewMessage, Store

    queue = "reports"
    out: dict[str, Any] = {"rounds": rounds, "calls_per_round": n}

    def empty(admin: psycopg.Connection[Any]) -> None:
        for table in ("consumers", "jobs", "queues", "exchanges"):  # bindings go with them
            admin.execute(f"DELETE FROM pgskip.{table}")

    with psycopg.connect(url, autocommit=True) as admin:
        for name, (expires, lapsed) in FLEET_SHAPES.items():
            out[name] = {}
            for size in sizes:
                empty(admin)
                admin.execute(
                    "INSERT INTO pgskip.consumers (id, hostname, pid, queues, lease_until)"
                    " SELECT gen_random_uuid(), 'fleet', g, ARRAY['celery', 'w' || g || '.pidbox'],"
                    "        now() + interval '1 hour'"
                    "   FROM generate_series(1, %s) AS g",
                    (size,),
                )
                store = Store(url, check=False, options="-c synchronous_commit=off")
                try:
                    store.declare_exchange(queue, "direct")
                    store.declare_queue(
                        queue, arguments=None if expires is None else {"x-expires": expires}
                    )
                    store.bind(queue, queue, queue, type="direct")
                    store.register_consumer(uuid.uuid4(), hostname="own", queues=[queue], lease=600)
                    admin.execute("VACUUM ANALYZE pgskip.consumers")

                    age = 3600 if lapsed else 0
                    message = NewMessage(queue, 0, "pending", None, '{"x": 1}', "t", "x", None)
                    publish = functools.partial(
                        store.publish_routed, message, exchange=queue, routing_key=queue, queues=()
                    )
                    admin.execute(MARK_USED, (age, queue))
                    for _ in range(50):
                        if publish() != [queue]:
                            raise RuntimeError(f"fleet {name}: {queue} not found live")
                    per_round = []
                    for _ in range(rounds):
                        admin.execute(MARK_USED, (age, queue))
                        t0 = time.perf_counter()
                        for _ in range(n):
                            publish()
                        per_round.append(1e6 * (time.perf_counter() - t0) / n)
                finally:
                    store.close()
                out[name][str(size)] = {
                    "publish_us": round(median(per_round) or 0.0, 1),
                    "rounds_us": [round(x, 1) for x in per_round],
                }
                log(f"fleet {name}, {size} workers: {out[name][str(size)]['publish_us']} us")
        empty(admin)
    return out


def _ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of counts (``1,3,6``)."""
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    from kombu_pgskip import migrate
    from kombu_pgskip.testing.embedded import EmbeddedPostgres

    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "profile"))
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--publish-cpu", action="store_true", help="only the CPU per publish (part 3)"
    )
    parser.add_argument(
        "--fetch-plans", action="store_true", help="only the fetch's plan choice (part 4)"
    )
    parser.add_argument(
        "--fetch-partitions",
        action="store_true",
        help="only what the partitions of jobs cost a fetch (part 8)",
    )
    parser.add_argument(
        "--notified-fetch",
        action="store_true",
        help="only from a commit to an idle consumer's rows (part 9)",
    )
    parser.add_argument(
        "--e2e-cpu", action="store_true", help="only end-to-end CPU and fetches per task (part 5)"
    )
    parser.add_argument(
        "--e2e-workers", type=int, default=1, help="worker processes for --e2e-cpu (one queue)"
    )
    parser.add_argument(
        "--e2e-gap",
        type=float,
        default=0.0,
        help="seconds between publishes for --e2e-cpu (default 0: back to back; 1,000 tasks"
        " when set)",
    )
    parser.add_argument(
        "--e2e-cooldowns",
        type=_cooldowns,
        default=E2E_COOLDOWNS,
        help="fetch_cooldown[:fetch_cooldown_max],... for --e2e-cpu and --blocking"
        " (default 0,0.002,0.005,0.002:0.02)",
    )
    parser.add_argument(
        "--blocking", action="store_true", help="only blocking kombu consumers (part 6)"
    )
    parser.add_argument(
        "--blocking-consumers",
        type=_ints,
        default=(1, 3, 6),
        help="consumer processes for --blocking, each count in turn (default 1,3,6)",
    )
    parser.add_argument(
        "--blocking-rate", type=float, default=500.0, help="messages/s for --blocking"
    )
    parser.add_argument(
        "--fleet", action="store_true", help="only a routed publish beside a large fleet (part 7)"
    )
    parser.add_argument(
        "--sweep-held", action="store_true", help="only the sweep under a held snapshot (part 10)"
    )
    parser.add_argument(
        "--sweep-messages",
        type=int,
        default=200_000,
        help="messages taken while the snapshot is held, for --sweep-held",
    )
    parser.add_argument(
        "--fleet-sizes",
        type=_ints,
        default=(1, 1000, 3000),
        help="workers in the fleet for --fleet, each in turn (default 1,1000,3000)",
    )
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
        if (
            args.publish_cpu
            or args.fetch_plans
            or args.fetch_partitions
            or args.notified_fetch
            or args.e2e_cpu
            or args.blocking
            or args.fleet
            or args.sweep_held
        ):
            report = {}
            if args.sweep_held:
                report["sweep_held"] = sweep_held(url, messages=args.sweep_messages)
            if args.fleet:
                report["fleet"] = fleet(url, sizes=args.fleet_sizes)
            if args.publish_cpu:
                report["publish_cpu"] = publish_cpu(broker)
            if args.fetch_plans:
                report["fetch_plans"] = fetch_plans(url)
            if args.fetch_partitions:
                report["fetch_partitions"] = fetch_partitions(url)
            if args.notified_fetch:
                report["notified_fetch"] = notified_fetch(broker, url)
            if args.e2e_cpu:
                report["e2e_cpu"] = e2e_cpu(
                    broker,
                    conn,
                    workers=args.e2e_workers,
                    cooldowns=args.e2e_cooldowns,
                    gap=args.e2e_gap,
                    n=1000 if args.e2e_gap else 3000,
                )
            if args.blocking:
                report["blocking_consumers"] = blocking_consumers(
                    broker,
                    conn,
                    cooldowns=args.e2e_cooldowns,
                    consumers=args.blocking_consumers,
                    rate=args.blocking_rate,
                )
            conn.close()
            return _write(out, report)

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
        report["publish_cpu"] = publish_cpu(broker)
        report["fetch_plans"] = fetch_plans(url)
        conn.close()
    finally:
        pg.cleanup()
    return _write(out, report)


def _write(out: Path, report: dict[str, Any]) -> int:
    (out / "profile.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    log(f"profile written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
