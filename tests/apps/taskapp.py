"""The Celery app the acceptance tests run in real `celery worker` processes.

Every task records what it did in the ``test_runs`` table of the broker's own database, so a
test can count, per message, how many times its task started and finished, across processes.
"""

from __future__ import annotations

import os
import time

import psycopg
from celery import Celery

import kombu_pgskip

BROKER_URL = os.environ.get("PGSKIP_BROKER_URL", "pgskip://postgres@127.0.0.1:5432/postgres")
DB_URL = kombu_pgskip.urls.to_conninfo(BROKER_URL)

app = Celery("taskapp", broker=BROKER_URL)
app.conf.update(
    task_default_queue="default",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    broker_transport_options={
        k[len("PGSKIP_OPT_") :].lower(): v
        for k, v in os.environ.items()
        if k.startswith("PGSKIP_OPT_")
    },
    task_acks_on_failure_or_timeout=True,
)
if os.environ.get("PGSKIP_RESULT_BACKEND"):
    app.conf.result_backend = os.environ["PGSKIP_RESULT_BACKEND"]
if os.environ.get("PGSKIP_CONTROL_QUEUE_EXPIRES"):
    # How long a dead worker's remote-control queue outlives it (Celery's default: 10 s).
    app.conf.control_queue_expires = float(os.environ["PGSKIP_CONTROL_QUEUE_EXPIRES"])

_conn: psycopg.Connection[tuple[object, ...]] | None = None
_pid = 0


def _db() -> psycopg.Connection[tuple[object, ...]]:
    global _conn, _pid
    if _conn is None or _conn.closed or _pid != os.getpid():
        _conn = psycopg.connect(DB_URL, autocommit=True)
        _pid = os.getpid()
    return _conn


def ensure_table(url: str = DB_URL) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS test_runs ("
            " id bigserial PRIMARY KEY, key text NOT NULL, event text NOT NULL,"
            " pid int NOT NULL, hostname text, redelivered boolean,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )


def _log(
    key: str, event: str, redelivered: bool | None = None, hostname: str | None = None
) -> None:
    global _conn
    sql = (
        "INSERT INTO test_runs (key, event, pid, hostname, redelivered) VALUES (%s, %s, %s, %s, %s)"
    )
    try:
        _db().execute(sql, (key, event, os.getpid(), hostname, redelivered))
    except psycopg.OperationalError:
        # The server restarted under this process (restart tests): log on a new connection.
        _conn = None
        _db().execute(sql, (key, event, os.getpid(), hostname, redelivered))


@app.task(bind=True, name="taskapp.record")
def record(self, key: str, sleep: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    info = self.request.delivery_info or {}
    _log(key, "start", info.get("redelivered"), self.request.hostname)
    if sleep:
        time.sleep(sleep)
    _log(key, "finish", info.get("redelivered"), self.request.hostname)
    return key


@app.task(bind=True, name="taskapp.record_late", acks_late=True, reject_on_worker_lost=True)
def record_late(self, key: str, sleep: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    info = self.request.delivery_info or {}
    _log(key, "start", info.get("redelivered"), self.request.hostname)
    if sleep:
        time.sleep(sleep)
    _log(key, "finish", info.get("redelivered"), self.request.hostname)
    return key


@app.task(bind=True, name="taskapp.spawn")
def spawn(self, key: str) -> str:  # type: ignore[no-untyped-def]
    """Publishes a child task from inside the worker (a prefork child's own connection)."""
    _log(key, "start", None, self.request.hostname)
    record.apply_async(args=(f"{key}-child",), queue=self.request.delivery_info.get("routing_key"))
    _log(key, "finish", None, self.request.hostname)
    return key


@app.task(bind=True, name="taskapp.retry_once", max_retries=1, default_retry_delay=0)
def retry_once(self, key: str) -> str:  # type: ignore[no-untyped-def]
    """Logs the priority each delivery arrived with, and retries once."""
    priority = (self.request.delivery_info or {}).get("priority")
    _log(key, f"priority={priority}", None, self.request.hostname)
    if self.request.retries == 0:
        raise self.retry()
    return key


@app.task(bind=True, name="taskapp.sync_account", acks_late=True, max_retries=1)
def sync_account(self, key: str, hold: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    """Logs ``try=N`` for each run, holds ``hold`` seconds, and retries once after a second:
    published with a unique key, the retry holds the key until it has run."""
    _log(key, f"try={self.request.retries}", None, self.request.hostname)
    if hold:
        time.sleep(hold)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    _log(key, "finish", None, self.request.hostname)
    return key


@app.task(bind=True, name="taskapp.count_once", acks_late=True)
def count_once(self, key: str, hold: float = 0.0, after: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    """Adds one to the ``test_counter`` row and records ``key`` in ``test_effects``, in the
    transaction that also finishes its message (kombu_pgskip.completing), holding it ``hold``
    seconds; then works ``after`` seconds more before returning (and so before its ack): the
    effect happens once per message, whatever kills the worker and whenever."""
    with kombu_pgskip.completing(self) as conn:
        conn.execute("UPDATE test_counter SET n = n + 1")
        conn.execute("INSERT INTO test_effects (key) VALUES (%s)", (key,))
        if hold:
            time.sleep(hold)
    if after:
        time.sleep(after)
    return key


@app.task(bind=True, name="taskapp.count_then_fail", acks_late=True)
def count_then_fail(self, key: str) -> str:  # type: ignore[no-untyped-def]
    """As count_once, then raises inside the block: nothing of it commits."""
    with kombu_pgskip.completing(self) as conn:
        conn.execute("UPDATE test_counter SET n = n + 1")
        raise ValueError(f"{key}: the work failed")
