"""The tiny Celery app every benchmark worker runs, whatever the broker.

Its task ``bench.noop`` does nothing but append ``<index> <time.time()>`` to a file of its own
process in ``$BENCH_STAMP_DIR``: the benchmark reads those files afterwards, so the same
broker-neutral clock measures every broker. ``bench.span`` sleeps for the seconds it is given
and appends ``<index> <start> <end>`` to a ``spans-<pid>.txt`` file there (:mod:`bench.limits`
counts how many ran at once). Configuration comes from the environment:

* ``BENCH_BROKER_URL``: the broker (``pgskip://``, ``amqp://``, ``redis://``, ``sqla+...``)
* ``BENCH_QUEUE``: the queue to consume (a fresh name per measurement)
* ``BENCH_TRANSPORT_OPTIONS``: JSON for ``broker_transport_options``
* ``BENCH_STAMP_DIR``: where the start stamps go
* ``BENCH_ACKS_LATE``: ``1`` for ``task_acks_late`` with ``worker_prefetch_multiplier = 1`` (the
  settings Celery recommends for tasks that must survive a worker's crash)
* ``BENCH_CELERY_DEFAULTS``: ``1`` for remote control on, as a worker runs out of the box
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery import Celery

import kombu_pgskip  # noqa: F401  (registers the pgskip:// scheme)

_lock = threading.Lock()
_out: Any = None
_out_pid = 0


def _stamp_file() -> Any:
    global _out, _out_pid
    pid = os.getpid()
    if _out is None or _out_pid != pid:
        directory = os.environ.get("BENCH_STAMP_DIR") or "/tmp"
        _out = open(os.path.join(directory, f"stamps-{pid}.txt"), "a", buffering=1)  # noqa: SIM115
        _out_pid = pid
    return _out


def make_app(
    broker_url: str,
    queue: str,
    transport_options: dict[str, Any] | None = None,
    *,
    acks_late: bool = False,
    celery_defaults: bool = False,
) -> Celery:
    """The same app in workers and publishers: only the broker differs between brokers."""
    app = Celery("benchapp", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        broker_transport_options=dict(transport_options or {}),
        broker_connection_retry_on_startup=True,
        # Identical for every broker: no remote control, no events (workers also run with
        # --without-gossip --without-mingle --without-heartbeat).
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
    )
    if acks_late:
        app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1)
    if celery_defaults:
        # What `celery -A proj worker` runs with out of the box: remote control on (its
        # workers also run with gossip, mingle and heartbeats: bench.workers.Worker).
        app.conf.update(worker_enable_remote_control=True)

    @app.task(name="bench.noop", shared=False)
    def noop(i: int = 0) -> None:
        t = time.time()
        with _lock:
            _stamp_file().write(f"{i} {t:.6f}\n")

    @app.task(name="bench.span", shared=False)
    def span(i: int = 0, seconds: float = 0.0) -> None:
        t0 = time.time()
        if seconds:
            time.sleep(seconds)
        t1 = time.time()
        directory = os.environ.get("BENCH_STAMP_DIR") or "/tmp"
        with _lock, open(os.path.join(directory, f"spans-{os.getpid()}.txt"), "a") as out:
            out.write(f"{i} {t0:.6f} {t1:.6f}\n")

    return app


app = make_app(
    os.environ.get("BENCH_BROKER_URL", "memory://"),
    os.environ.get("BENCH_QUEUE", "bench"),
    json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
    acks_late=os.environ.get("BENCH_ACKS_LATE") == "1",
    celery_defaults=os.environ.get("BENCH_CELERY_DEFAULTS") == "1",
)
