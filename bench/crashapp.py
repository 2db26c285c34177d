"""The Celery app of the crash scenario (:mod:`bench.crash`), whatever the broker.

Its one task, ``crash.work(i, seconds)``, sleeps ``seconds`` between appending
``start <i> <pgid> <time>`` and ``finish <i> <pgid> <time>`` to ``$BENCH_CRASH_LOG`` (the
process group: the worker's, whichever pool process runs the task), opened with
``O_APPEND`` (one ``write()`` per line: lines of many processes never interleave, and the file
survives the SIGKILL the scenario deals). Configuration comes from the environment, as for
:mod:`bench.benchapp`: ``BENCH_BROKER_URL``, ``BENCH_QUEUE``, ``BENCH_TRANSPORT_OPTIONS`` (JSON).
Tasks are ``acks_late`` with ``reject_on_worker_lost``, as Celery recommends for tasks that must
survive a worker's crash (workers run with ``--prefetch-multiplier 1``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import kombu_pgskip  # noqa: F401  (registers the pgskip:// scheme)

TASK = "crash.work"


def make_app(broker_url: str, queue: str, transport_options: dict[str, Any]) -> Celery:
    """The same app in the workers and in the scenario's publisher."""
    app = Celery("crashapp", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        broker_transport_options=dict(transport_options),
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
    )

    @app.task(  # type: ignore[untyped-decorator,unused-ignore]
        name=TASK, shared=False, acks_late=True, reject_on_worker_lost=True
    )
    def work(i: int, seconds: float = 0.0) -> None:
        _append(f"start {i} {os.getpgrp()} {time.time():.6f}\n")
        if seconds:
            time.sleep(seconds)
        _append(f"finish {i} {os.getpgrp()} {time.time():.6f}\n")

    return app


_fd = -1
_fd_pid = 0


def _append(line: str) -> None:
    global _fd, _fd_pid
    if _fd < 0 or _fd_pid != os.getpid():
        path = os.environ.get("BENCH_CRASH_LOG") or "/tmp/bench-crash.log"
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    os.write(_fd, line.encode())


app = make_app(
    os.environ.get("BENCH_BROKER_URL", ""),
    os.environ.get("BENCH_QUEUE", "bench.crash"),
    json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
)
