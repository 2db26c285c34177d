"""The Celery app the chaos suite (tests/chaos/) runs in real ``celery worker`` processes.

Its one task appends ``start|finish <id> <pid> <host> <time> <tag> <redelivered>`` lines to the file
named by ``$PGSKIP_CHAOS_LOG``, opened with ``O_APPEND``: each line is one ``write()``, so lines
from many processes never interleave, and the log survives database restarts, network cuts and
SIGKILL (the database itself is what is being broken, so it cannot be the witness).

Transport options come from ``$PGSKIP_OPT_<NAME>`` (as in taskapp). Celery's per-task INFO lines
("received", "succeeded") are turned down to WARNING: at 100,000 tasks they cost more CPU than
the tasks, and the chaos suite counts from its own log.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from celery import Celery, signals

BROKER_URL = os.environ.get("PGSKIP_BROKER_URL", "pgskip://postgres@127.0.0.1:5432/postgres")
LOG_PATH = os.environ.get("PGSKIP_CHAOS_LOG", "/tmp/pgskip-chaos.log")
TASK_NAME = "chaosapp.work"

app = Celery("chaosapp", broker=BROKER_URL)
app.conf.update(
    task_default_queue="chaos",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,  # a chaos run restarts the database: never give up
    worker_hijack_root_logger=True,
    broker_transport_options={
        k[len("PGSKIP_OPT_") :].lower(): v
        for k, v in os.environ.items()
        if k.startswith("PGSKIP_OPT_")
    },
)

_fd = -1
_fd_pid = 0
_host = os.environ.get("PGSKIP_CHAOS_HOST") or socket.gethostname()


def _append(line: str) -> None:
    global _fd, _fd_pid
    if _fd < 0 or _fd_pid != os.getpid():
        _fd = os.open(LOG_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    os.write(_fd, line.encode())


@signals.after_setup_logger.connect  # type: ignore[untyped-decorator,unused-ignore]
def _quiet_per_task_logs(**_: Any) -> None:
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)


@app.task(  # type: ignore[untyped-decorator,unused-ignore]
    bind=True, name=TASK_NAME, acks_late=True, reject_on_worker_lost=True
)
def work(self: Any, msg_id: int, sleep: float = 0.0) -> None:
    # Celery 5.7 passes the redelivered flag to tasks but not the delivery tag ("-" then).
    info = self.request.delivery_info or {}
    tag = f"{info.get('delivery_tag', '-')} {int(bool(info.get('redelivered')))}"
    _append(f"start {msg_id} {os.getpid()} {_host} {time.time():.6f} {tag}\n")
    if sleep:
        time.sleep(sleep)
    _append(f"finish {msg_id} {os.getpid()} {_host} {time.time():.6f} {tag}\n")
