"""Worker memory with many far-future tasks (countdown one hour).

An idle worker (``-P threads -c 4``) is running; ``n`` tasks with ``countdown=3600`` are
published; the resident memory of the worker's whole process tree is sampled while they arrive
and for ``settle`` seconds after. pgskip keeps them in the database (status ``scheduled``);
RabbitMQ, Redis and the SQLAlchemy transport hand them to the worker, which holds them until due.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .brokers import Broker
from .common import rss_tree_kb
from .workers import StampDir, Worker, new_queue, publish_backlog, publisher_app, warm_up


def _waiting_in_broker(broker: Broker, queue: str) -> int | None:
    """How many of the published messages the broker still holds (not delivered)."""
    try:
        if broker.kind == "pgskip" and broker.db_url:
            import psycopg

            with psycopg.connect(broker.db_url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM pgskip.jobs WHERE queue = %s "
                    "AND status IN ('scheduled', 'pending')",
                    (queue,),
                ).fetchone()
                return int(row[0]) if row else None
        if broker.kind == "rabbitmq":
            from kombu import Connection

            with Connection(broker.url) as conn:
                return int(conn.channel().queue_declare(queue=queue, passive=True).message_count)
        if broker.kind == "redis":
            import redis

            return int(redis.Redis.from_url(broker.url or "").llen(queue))
        if broker.kind == "sqlalchemy" and broker.db_url:
            import psycopg

            with psycopg.connect(broker.db_url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM kombu_message m JOIN kombu_queue q ON q.id = m.queue_id "
                    "WHERE q.name = %s AND m.visible",
                    (queue,),
                ).fetchone()
                return int(row[0]) if row else None
    except Exception:
        return None
    return None


def memory(broker: Broker, *, n: int, settle: float) -> dict[str, Any]:
    broker.reset()
    queue = new_queue("mem")
    app = publisher_app(broker, queue)
    stamps = StampDir()
    worker = Worker(broker, queue, stamps, pool="threads", concurrency=4, name="mem")
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        worker.start()
        if not warm_up(app, stamps):
            return {"error": "worker did not start", "worker_log": worker.log_tail()}
        time.sleep(1.0)
        baseline = rss_tree_kb(worker.pid)
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((round(time.monotonic() - t0, 2), rss_tree_kb(worker.pid)))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        publish_s = publish_backlog(broker, app, n, countdown=3600)
        time.sleep(settle)
        stop.set()
        sampler.join()
        final = rss_tree_kb(worker.pid)
        waiting = _waiting_in_broker(broker, queue)
        peak = max([baseline, final, *(kb for _, kb in samples)])
        return {
            "tasks": n,
            "publish_s": round(publish_s, 2),
            "settle_s": settle,
            "baseline_mb": round(baseline / 1024, 1),
            "final_mb": round(final / 1024, 1),
            "peak_mb": round(peak / 1024, 1),
            "growth_mb": round((final - baseline) / 1024, 1),
            "series": [(t, round(kb / 1024, 1)) for t, kb in samples],
            "worker_alive": worker.alive(),
            # Messages still in the broker at the end (not in the worker's memory).
            "waiting_in_broker": waiting,
        }
    finally:
        stop.set()
        worker.stop()
        stamps.cleanup()
        app.close()
        broker.delete_queues([queue])
