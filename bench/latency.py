"""Latency from publish to task start on an idle worker (``-P threads -c 4``).

One task at a time, ``gap`` seconds apart (the publisher sleeps, or busy-waits with ``spin``),
so the worker is idle when each arrives. For
``apply_async`` the clock starts just before the call (the call includes pgskip's commit); for
``apply_async_in`` it starts when the caller's transaction has committed.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from .brokers import Broker
from .common import percentile
from .workers import StampDir, Worker, new_queue, publisher_app, warm_up


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def latency(
    broker: Broker, *, samples: int, gap: float, in_transaction: bool = False, spin: bool = False
) -> dict[str, Any]:
    """``spin``: the publisher busy-waits between samples instead of sleeping, so the figure
    leaves out the publisher's own wake-up from an idle CPU (several ms on this VM when the
    machine is quiet); the worker idles either way."""
    broker.reset()
    queue = new_queue("lat")
    app = publisher_app(broker, queue)
    stamps = StampDir()
    worker = Worker(broker, queue, stamps, pool="threads", concurrency=4, name="lat")
    conn: Any = None
    try:
        worker.start()
        if not warm_up(app, stamps):
            return {"error": "worker did not start", "worker_log": worker.log_tail()}
        task = app.tasks["bench.noop"]
        sent: dict[int, float] = {}
        call_s: list[float] = []
        if in_transaction:
            from kombu_pgskip import apply_async_in

            conn = psycopg.connect(broker.db_url or "")
        for i in range(samples):
            if in_transaction:
                c0 = time.perf_counter()
                with conn.transaction():
                    apply_async_in(conn, task, kwargs={"i": i})
                sent[i] = time.time()
                call_s.append(time.perf_counter() - c0)
            else:
                t0 = time.time()
                c0 = time.perf_counter()
                task.apply_async(kwargs={"i": i})
                call_s.append(time.perf_counter() - c0)
                sent[i] = t0
            if spin:
                _spin(gap)
            else:
                time.sleep(gap)
        stamps.wait_for(samples, 30.0 if not broker.slow else 60.0)
        lat = sorted(1000.0 * (t - sent[i]) for i, t in stamps.read() if i >= 0 and i in sent)
        return {
            "samples": samples,
            "received": len(lat),
            "p50_ms": percentile(lat, 50),
            "p90_ms": percentile(lat, 90),
            "p99_ms": percentile(lat, 99),
            "max_ms": lat[-1] if lat else None,
            "publish_call_ms_p50": 1000.0 * (percentile(call_s, 50) or 0.0),
            "publisher_wait": "busy-wait" if spin else "sleep",
            "all_ms": [round(x, 3) for x in lat],
        }
    finally:
        if conn is not None:
            conn.close()
        worker.stop()
        stamps.cleanup()
        app.close()
        broker.delete_queues([queue])
