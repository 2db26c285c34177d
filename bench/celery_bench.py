"""Celery through each broker: worker side (a backlog, then the worker starts), end to end (one
publisher, publish to task start), the scaling curve, and where a pgskip publish spends its time.

Throughput is measured on the tasks' own start stamps: tasks started / (last start - first
start) for the worker side, tasks / (last start - first publish) end to end.
"""

from __future__ import annotations

import time
from typing import Any

from .brokers import Broker
from .common import log, percentile
from .workers import (
    StampDir,
    Worker,
    idle_worker,
    new_queue,
    publish_backlog,
    publisher_app,
    stop_all,
    warm_up,
)


def _rate(stamps: list[tuple[int, float]]) -> float | None:
    times = sorted(t for i, t in stamps if i >= 0)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def worker_side(
    broker: Broker,
    *,
    pool: str,
    concurrency: int,
    n: int,
    timeout: float,
    processes: int = 1,
    acks_late: bool = False,
    celery_defaults: bool = False,
) -> dict[str, Any]:
    """``n`` tasks wait in the broker, then ``processes`` workers start and drain them (with
    ``acks_late``: ``task_acks_late`` and ``worker_prefetch_multiplier = 1``)."""
    broker.reset()
    queue = new_queue("ws")
    app = publisher_app(broker, queue, celery_defaults=celery_defaults)
    stamps = StampDir()
    workers: list[Worker] = []
    try:
        publish_s = publish_backlog(broker, app, n)
        t_start = time.time()
        workers = [
            Worker(
                broker,
                queue,
                stamps,
                pool=pool,
                concurrency=concurrency,
                name=f"ws{k}",
                acks_late=acks_late,
                celery_defaults=celery_defaults,
            ).start()
            for k in range(processes)
        ]
        done = stamps.wait_for(n, timeout + 10.0 * processes)
        got = stamps.read()
        first = min((t for i, t in got if i >= 0), default=None)
        result: dict[str, Any] = {
            "tasks": n,
            "completed": done,
            "rate": _rate(got),
            "backlog_publish_s": round(publish_s, 3),
            "first_task_after_s": None if first is None else round(first - t_start, 3),
        }
        if done < n:
            result["note"] = f"timed out: {done} of {n} tasks started"
            if done == 0:
                result["worker_log"] = workers[0].log_tail()
        return result
    finally:
        stop_all(workers)
        stamps.cleanup()
        app.close()
        broker.delete_queues([queue])


def end_to_end(
    broker: Broker,
    *,
    n: int,
    timeout: float,
    celery_defaults: bool = False,
    via_exchange: bool = False,
) -> dict[str, Any]:
    """An idle worker (``-P threads -c 4``); one publisher sends ``n`` tasks back to back.
    ``celery_defaults``: the worker as it runs out of the box (remote control, gossip, mingle
    and heartbeats on).

    Celery sends a task routed by default to the default exchange (``""``, the routing key
    naming the queue), which pgskip inserts without routing. ``via_exchange``: each
    ``apply_async`` names the queue's exchange and routing key, as a task routed through an
    exchange (``task_routes`` with ``exchange``) is published: pgskip routes it through the
    exchange's bindings at every publish (``Store.publish_routed``: one statement,
    ``publish_routed``)."""
    broker.reset()
    with idle_worker(broker, "e2e", celery_defaults=celery_defaults) as (app, stamps, (worker,)):
        if not warm_up(app, stamps):
            return {"error": "worker did not start", "worker_log": worker.log_tail()}
        task = app.tasks["bench.noop"]
        route: dict[str, Any] = {}
        if via_exchange:
            queue = app.amqp.queues[app.conf.task_default_queue]
            route = {"exchange": queue.exchange.name, "routing_key": queue.routing_key}
        durations: list[float] = []
        t0 = time.time()
        for i in range(n):
            c0 = time.perf_counter()
            task.apply_async(kwargs={"i": i}, **route)
            durations.append(time.perf_counter() - c0)
        t_pub = time.time()
        done = stamps.wait_for(n, timeout)
        got = [(i, t) for i, t in stamps.read() if i >= 0]
        last = max((t for _, t in got), default=None)
        result: dict[str, Any] = {
            "tasks": n,
            "completed": done,
            "rate": None if last is None or done < n else n / (last - t0),
            "publish_rate": n / (t_pub - t0),
            "publish_us_p50": round(1e6 * (percentile(durations, 50) or 0), 1),
            "publish_us_p99": round(1e6 * (percentile(durations, 99) or 0), 1),
        }
        if done < n:
            result["note"] = f"timed out: {done} of {n} tasks started"
            result["rate_partial"] = None if last is None else done / (last - t0)
        return result


def publish_breakdown(
    pgskip: Broker, pgskip_async: Broker, raw_url: str, *, n: int
) -> dict[str, Any]:
    """Where one durable ``apply_async`` to pgskip spends its time, in microseconds.

    * Celery + kombu: the same ``apply_async`` to kombu's in-memory transport;
    * pgskip envelope: ``to_row`` (JSON encoding of the kombu message);
    * SQL: time inside the store's executor running the per-message statements
      (``OwnConnection.run_then``: the INSERT, its commit and its NOTIFY; ``run_direct``: the
      INSERT with its NOTIFY with asynchronous commits, and routing);
    * commit wait: SQL time minus the SQL time of the same statement with
      ``synchronous_commit=off`` (the WAL flush the publisher waits for);
    * the floor of one durable publish (:func:`publish_floor`): a bare psycopg INSERT of the
      same payload and its commit, against the same ``apply_async``, interleaved.
    """
    import psycopg

    import kombu_pgskip.channel as channel_mod
    import kombu_pgskip.executor as executor_mod

    out: dict[str, Any] = {"messages": n}
    mem = publisher_app(Broker("memory", "memory", url="memory://", available=True), "bench.mem")
    task = mem.tasks["bench.noop"]
    for i in range(200):
        task.apply_async(kwargs={"i": i})
    t0 = time.perf_counter()
    for i in range(n):
        task.apply_async(kwargs={"i": i})
    out["celery_kombu_memory_us"] = round(1e6 * (time.perf_counter() - t0) / n, 1)
    mem.close()

    # The per-message statements, as the store's own connection runs them: run_then (the
    # insert, then its NOTIFY) and run_direct (the insert with its NOTIFY with asynchronous
    # commits, and routing); a call inside another is counted once.
    orig_run = executor_mod.OwnConnection.run_direct
    orig_then = executor_mod.OwnConnection.run_then
    orig_to_row = channel_mod.to_row
    acc = {"sql": 0.0, "to_row": 0.0}
    depth = [0]

    def timed(orig: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            depth[0] += 1
            c0 = time.perf_counter()
            try:
                return orig(self, *args)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    acc["sql"] += time.perf_counter() - c0

        return run

    def timed_to_row(*a: Any, **kw: Any) -> Any:
        c0 = time.perf_counter()
        try:
            return orig_to_row(*a, **kw)
        finally:
            acc["to_row"] += time.perf_counter() - c0

    executor_mod.OwnConnection.run_direct = timed(orig_run)  # type: ignore[method-assign]
    executor_mod.OwnConnection.run_then = timed(orig_then)  # type: ignore[method-assign]
    channel_mod.to_row = timed_to_row
    try:
        for broker in (pgskip, pgskip_async):
            broker.reset()
            queue = new_queue("pb")
            app = publisher_app(broker, queue)
            task = app.tasks["bench.noop"]
            for i in range(50):
                task.apply_async(kwargs={"i": i})
            acc["sql"] = acc["to_row"] = 0.0
            t0 = time.perf_counter()
            for i in range(n):
                task.apply_async(kwargs={"i": i})
            total = (time.perf_counter() - t0) / n
            key = "sync" if broker is pgskip else "async"
            out[f"{key}_total_us"] = round(1e6 * total, 1)
            out[f"{key}_sql_us"] = round(1e6 * acc["sql"] / n, 1)
            out[f"{key}_to_row_us"] = round(1e6 * acc["to_row"] / n, 1)
            out[f"{key}_rate"] = round(1 / total, 1)
            app.close()
    finally:
        executor_mod.OwnConnection.run_direct = orig_run  # type: ignore[method-assign]
        executor_mod.OwnConnection.run_then = orig_then  # type: ignore[method-assign]
        channel_mod.to_row = orig_to_row

    # The pgskip publish statement alone, as the transport runs it, with a real payload.
    with psycopg.connect(pgskip.db_url or "", autocommit=True) as conn:
        row = conn.execute(
            "SELECT queue, payload::text, task_name, task_id FROM pgskip.jobs LIMIT 1"
        ).fetchone()
    if row is not None:
        from kombu_pgskip.store import NewMessage, Store

        message = NewMessage(row[0], 0, "pending", None, row[1], row[2], row[3], None)
        for key, opts in (("sync", ""), ("async", "-c synchronous_commit=off")):
            store = Store(pgskip.db_url or "", check=False, options=opts)
            for _ in range(50):
                store.publish(message)
            t0 = time.perf_counter()
            for _ in range(n):
                store.publish(message)
            out[f"statement_{key}_us"] = round(1e6 * (time.perf_counter() - t0) / n, 1)
            store.close()
        out["payload_bytes"] = len(row[1])
        if raw_url:
            out.update(publish_floor(pgskip, raw_url, row[1], n=n))
    s = out
    if "sync_total_us" in s and "async_sql_us" in s:
        s["summary_us"] = {
            "celery_and_kombu": round(
                s["sync_total_us"] - s["sync_sql_us"] - s["sync_to_row_us"], 1
            ),
            "pgskip_to_row": s["sync_to_row_us"],
            "sql_without_commit_wait": s["async_sql_us"],
            "commit_wait": round(s["sync_sql_us"] - s["async_sql_us"], 1),
            "total": s["sync_total_us"],
        }
    pgskip.reset()
    log(
        f"publish breakdown: {s.get('summary_us')}; apply_async / bare INSERT and commit: "
        f"{s.get('apply_async_over_floor')}"
    )
    return out


FLOOR_DDL = """
DROP TABLE IF EXISTS bench_publish_floor;
CREATE TABLE bench_publish_floor (id bigserial PRIMARY KEY, payload json NOT NULL);
"""
FLOOR_INSERT = "INSERT INTO bench_publish_floor (payload) VALUES (%s::json)"


def publish_floor(pgskip: Broker, raw_url: str, payload: str, *, n: int) -> dict[str, Any]:
    """What one durable publish costs at the least, beside what pgskip's costs, in microseconds.

    In five rounds, each a block of ``n / 5`` calls of each of the three in turn (so a change in
    the machine's load falls on all three alike):

    * ``apply_async``: the durable pgskip ``apply_async`` (Celery, kombu, the transport);
    * ``insert_autocommit``: the bare INSERT of ``payload`` (a Celery message as pgskip stores
      it) into a table with a json column, on a psycopg connection of its own in autocommit:
      the statement is its own transaction, committed (the WAL flushed) before the reply, in
      one round trip, as pgskip's publish statement runs;
    * ``insert_then_commit``: the same INSERT, then ``COMMIT`` (two round trips).

    ``apply_async_over_floor`` is ``apply_async`` over the cheaper of the two bare ones.
    """
    import psycopg

    rounds = 5
    per = max(1, n // rounds)
    with psycopg.connect(raw_url, autocommit=True) as conn:
        conn.execute(FLOOR_DDL)
    app = publisher_app(pgskip, new_queue("floor"))
    task = app.tasks["bench.noop"]
    spent = {"apply_async": 0.0, "insert_autocommit": 0.0, "insert_then_commit": 0.0}
    try:
        with (
            psycopg.connect(raw_url, autocommit=True) as auto,
            psycopg.connect(raw_url, autocommit=False) as txn,
        ):
            for _ in range(50):
                task.apply_async(kwargs={"i": -2})
                auto.execute(FLOOR_INSERT, (payload,), prepare=True)
                txn.execute(FLOOR_INSERT, (payload,), prepare=True)
                txn.commit()
            for r in range(rounds):
                t0 = time.perf_counter()
                for i in range(per):
                    task.apply_async(kwargs={"i": r * per + i})
                t1 = time.perf_counter()
                for _ in range(per):
                    auto.execute(FLOOR_INSERT, (payload,), prepare=True)
                t2 = time.perf_counter()
                for _ in range(per):
                    txn.execute(FLOOR_INSERT, (payload,), prepare=True)
                    txn.commit()
                t3 = time.perf_counter()
                spent["apply_async"] += t1 - t0
                spent["insert_autocommit"] += t2 - t1
                spent["insert_then_commit"] += t3 - t2
        with psycopg.connect(raw_url, autocommit=True) as conn:
            conn.execute("DROP TABLE bench_publish_floor")
    finally:
        app.close()
    calls = rounds * per
    us = {k: round(1e6 * v / calls, 1) for k, v in spent.items()}
    floor = min(us["insert_autocommit"], us["insert_then_commit"])
    return {
        "floor_calls": calls,
        "floor_apply_async_us": us["apply_async"],
        "floor_insert_autocommit_us": us["insert_autocommit"],
        "floor_insert_then_commit_us": us["insert_then_commit"],
        "floor_payload_bytes": len(payload),
        "apply_async_over_floor": round(us["apply_async"] / floor, 3) if floor else None,
    }
