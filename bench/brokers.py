"""The brokers under test, started or found, each in its own place.

* ``pgskip``: an :class:`~kombu_pgskip.testing.embedded.EmbeddedPostgres` with ``fsync`` on (durable
  commits, as in production), database ``pgskip_bench``, schema migrated.
* ``pgskip-async``: the same database with the transport option ``durable_publish=False``:
  publishes commit with ``synchronous_commit=off``, the opt-in mode whose risk is that the last
  few hundred milliseconds of acknowledged publishes can be lost if the server crashes.
* ``sqlalchemy``: kombu's SQLAlchemy transport on the same cluster, database ``sqla_bench``.
* ``rabbitmq``: 127.0.0.1:5672 (guest/guest), pyamqp without publisher confirms: a publish
  returns once the frame is written to the socket, before RabbitMQ has the message on disk.
* ``rabbitmq-confirm``: the same server with ``confirm_publish=True`` in the transport options.
  py-amqp then puts every channel of the connection in confirm mode (``confirm.select`` before
  its first publish) and makes ``basic_publish`` wait for the broker's ``basic.ack`` (a
  ``basic.nack`` raises ``MessageNacked``): one round trip per publish. Celery publishes
  persistent messages (``task_default_delivery_mode`` 2) to durable queues (kombu's default),
  which RabbitMQ confirms once they are written to disk (or once consumed and acknowledged, if
  that comes first).
* ``redis``: 127.0.0.1:6379, database 13 (flushed between measurements), as configured there
  (the label records its ``appendonly``).
* ``redis-fsync``: a ``redis-server`` of its own, started for the run on a free port with
  ``--appendonly yes --appendfsync always`` and its files in a temporary directory beside the
  PostgreSQL cluster's (the same disk), stopped (and the directory removed) at the end: Redis
  writes and fsyncs the append-only file before it replies to a write. A consumer's writes
  are fsynced too: kombu's Redis transport writes on each delivery (the message into its
  unacked hash) and on each ack (out of it).

Redis and RabbitMQ are started if absent (``redis-server --daemonize yes ...``,
``rabbitmq-server -detached``); when that fails they are reported unavailable, never fatal.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from .common import log

REDIS_DB = 13
PG_DATABASES = ("pgskip_bench", "sqla_bench", "raw_bench")
#: The brokers on pgskip's database (emptied alike by :meth:`Broker.reset`).
PGSKIP_BROKERS = ("pgskip", "pgskip-async")


@dataclass
class Broker:
    name: str
    label: str
    kind: str = ""  # the server it runs on: pgskip, rabbitmq, redis, sqlalchemy (default: name)
    url: str | None = None  # what workers (and, unless publish_url, publishers) use
    publish_url: str | None = None
    db_url: str | None = None  # libpq URL of its database (PostgreSQL brokers)
    transport_options: dict[str, Any] = field(default_factory=dict)
    available: bool = False
    reason: str = ""
    slow: bool = False  # kombu's SQLAlchemy transport: smaller workloads, capped waits

    def __post_init__(self) -> None:
        self.kind = self.kind or self.name

    @property
    def publisher_url(self) -> str | None:
        return self.publish_url or self.url

    def reset(self) -> None:
        """Empty every queue of this broker (called before each measurement)."""
        if self.kind == "pgskip" and self.db_url:
            with psycopg.connect(self.db_url, autocommit=True) as conn:
                conn.execute("TRUNCATE pgskip.jobs, pgskip.consumers")
                conn.execute("DELETE FROM pgskip.queues")
                conn.execute("DELETE FROM pgskip.exchanges")
        elif self.kind == "sqlalchemy" and self.db_url:
            with psycopg.connect(self.db_url, autocommit=True) as conn:
                exists = conn.execute("SELECT to_regclass('kombu_message') IS NOT NULL").fetchone()
                if exists and exists[0]:
                    conn.execute("TRUNCATE kombu_message, kombu_queue CASCADE")
        elif self.kind == "redis" and self.url:
            import redis

            redis.Redis.from_url(self.url).flushdb()

    def delete_queues(self, names: list[str]) -> None:
        """Drop queues a measurement declared (RabbitMQ keeps them otherwise)."""
        if self.kind != "rabbitmq" or not self.url:
            return
        from kombu import Connection

        with contextlib.suppress(Exception), Connection(self.url) as conn:
            chan = conn.channel()
            for name in names:
                with contextlib.suppress(Exception):
                    chan.queue_delete(name)
                    chan.exchange_delete(name)


def _port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((host, port))
            return True
        except OSError:
            return False


def ensure_redis() -> Broker:
    broker = Broker("redis", "Redis (no AOF)", url=f"redis://127.0.0.1:6379/{REDIS_DB}")
    try:
        import redis
    except ImportError:
        broker.reason = "python package redis not installed"
        return broker
    if not _port_open(6379):
        exe = shutil.which("redis-server")
        if exe is None:
            broker.reason = "Redis not running and redis-server not installed"
            return broker
        log("Redis not running: starting redis-server")
        subprocess.run(
            [exe, "--daemonize", "yes", "--port", "6379", "--save", "", "--appendonly", "no"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        for _ in range(100):
            if _port_open(6379):
                break
            time.sleep(0.1)
    try:
        client = redis.Redis.from_url(broker.url or "", socket_timeout=5)
        client.ping()
        aof = client.config_get("appendonly").get("appendonly")
        broker.label = f"Redis (appendonly={aof})"
        broker.available = True
    except Exception as exc:
        broker.reason = f"Redis unreachable: {exc}"
    return broker


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisFsync:
    """A ``redis-server`` of the run's own: every write in the append-only file, fsynced before
    the reply (``appendonly yes``, ``appendfsync always``), on a free port, its files in a
    temporary directory under ``base_dir``. :meth:`stop` ends it and removes the directory."""

    def __init__(self, base_dir: str | None = None) -> None:
        self.base_dir = base_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.port = 0

    def start(self) -> Broker:
        broker = Broker("redis-fsync", "Redis (appendonly yes, appendfsync always)", kind="redis")
        try:
            import redis
        except ImportError:
            broker.reason = "python package redis not installed"
            return broker
        exe = shutil.which("redis-server")
        if exe is None:
            broker.reason = "redis-server not installed"
            return broker
        self.dir = tempfile.mkdtemp(prefix="bench-redis-fsync-", dir=self.base_dir)
        self.port = _free_port()
        # The options a durable Redis runs with; no RDB snapshots (the AOF is the only file).
        argv = [
            exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            "redis.log",
        ]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        url = f"redis://127.0.0.1:{self.port}/{REDIS_DB}"
        deadline = time.monotonic() + 10.0
        last: Exception | None = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                client = redis.Redis.from_url(url, socket_timeout=5)
                client.ping()
                conf = client.config_get("append*")
                if conf.get("appendonly") != "yes" or conf.get("appendfsync") != "always":
                    raise RuntimeError(f"unexpected configuration {conf}")
                broker.url = url
                broker.available = True
                broker.label = (
                    f"Redis (appendonly yes, appendfsync always; port {self.port}, {self.dir})"
                )
                log(f"redis-fsync: redis-server on port {self.port}, files in {self.dir}")
                return broker
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        broker.reason = f"redis-server --appendfsync always did not start: {last}"
        self.stop()
        return broker

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def ensure_rabbitmq(start_timeout: float = 90.0) -> Broker:
    broker = Broker(
        "rabbitmq",
        "RabbitMQ (pyamqp, no confirms)",
        url="amqp://guest:guest@127.0.0.1:5672//",
    )
    if not _port_open(5672):
        exe = shutil.which("rabbitmq-server")
        if exe is None:
            broker.reason = "RabbitMQ not running and rabbitmq-server not installed"
            return broker
        log("RabbitMQ not running: starting rabbitmq-server -detached (takes a while)")
        subprocess.run([exe, "-detached"], capture_output=True, timeout=60, check=False)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline and not _port_open(5672):
            time.sleep(1.0)
    from kombu import Connection

    last: Exception | None = None
    for _ in range(10):
        try:
            with Connection(broker.url, connect_timeout=5) as conn:
                conn.connect()
            broker.available = True
            return broker
        except Exception as exc:  # not up yet, or refusing guest
            last = exc
            time.sleep(1.0)
    broker.reason = f"RabbitMQ unreachable: {last}"
    return broker


def rabbitmq_confirm(plain: Broker) -> Broker:
    """The RabbitMQ of ``plain`` with publisher confirms: each publish waits for the broker's
    ``basic.ack`` (persistent messages to durable queues: once on disk)."""
    return Broker(
        "rabbitmq-confirm",
        "RabbitMQ (pyamqp, publisher confirms, persistent messages, durable queues)",
        kind="rabbitmq",
        url=plain.url,
        transport_options={"confirm_publish": True},
        available=plain.available,
        reason=plain.reason,
    )


class BenchEnv:
    """Every broker of the run; ``with BenchEnv() as env: env.brokers["pgskip"]``."""

    def __init__(self, *, want: set[str] | None = None) -> None:
        self.want = want  # None: every broker (only ``redis-fsync`` costs a server of its own)
        self.pg: Any = None
        self.brokers: dict[str, Broker] = {}
        self.pg_settings: dict[str, str] = {}
        self.redis_fsync: RedisFsync | None = None

    def __enter__(self) -> BenchEnv:
        try:
            self._start_postgres()
            self.brokers["rabbitmq"] = ensure_rabbitmq()
            self.brokers["rabbitmq-confirm"] = rabbitmq_confirm(self.brokers["rabbitmq"])
            self.brokers["redis"] = ensure_redis()
            if self.want is None or "redis-fsync" in self.want:
                # Its append-only file on the disk of the PostgreSQL cluster's data directory.
                base = None if self.pg is None else str(Path(self.pg.base_path).parent)
                self.redis_fsync = RedisFsync(base)
                self.brokers["redis-fsync"] = self.redis_fsync.start()
        except BaseException:
            self.__exit__()
            raise
        for b in self.brokers.values():
            if not b.available:
                log(f"{b.name}: unavailable ({b.reason})")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.redis_fsync is not None:
            self.redis_fsync.stop()
            self.redis_fsync = None
        if self.pg is not None:
            self.pg.cleanup()
            self.pg = None

    def raw_db_url(self) -> str | None:
        return None if self.pg is None else self.pg.dsn("raw_bench")

    def _start_postgres(self) -> None:
        names = (*PGSKIP_BROKERS, "sqlalchemy")
        try:
            from kombu_pgskip import migrate
            from kombu_pgskip.testing.embedded import EmbeddedPostgres

            self.pg = EmbeddedPostgres(fsync=True, pg_cron=False).start()
            with psycopg.connect(self.pg.dsn(), autocommit=True) as conn:
                for db in PG_DATABASES:
                    conn.execute(f'CREATE DATABASE "{db}"')
                for name in (
                    "fsync",
                    "synchronous_commit",
                    "wal_sync_method",
                    "shared_buffers",
                    "max_wal_size",
                    "server_version",
                ):
                    row = conn.execute(f"SHOW {name}").fetchone()
                    self.pg_settings[name] = str(row[0]) if row else "?"
            pg_url = self.pg.dsn("pgskip_bench")
            migrate(pg_url, schema="pgskip")
            migrate(self.pg.dsn("raw_bench"), schema="pgskip")  # for the ceilings' table shape
            host = f"postgres@127.0.0.1:{self.pg.port}"
            self.brokers["pgskip"] = Broker(
                "pgskip",
                "pgskip (fsync on, sync commit)",
                kind="pgskip",
                url=f"pgskip://{host}/pgskip_bench",
                db_url=pg_url,
                available=True,
            )
            self.brokers["pgskip-async"] = Broker(
                "pgskip-async",
                "pgskip, durable_publish=False (opt-in asynchronous commit of publishes)",
                kind="pgskip",
                url=f"pgskip://{host}/pgskip_bench",
                transport_options={"durable_publish": False},
                db_url=pg_url,
                available=True,
            )
            try:
                import sqlalchemy  # noqa: F401

                self.brokers["sqlalchemy"] = Broker(
                    "sqlalchemy",
                    "kombu SQLAlchemy transport (PostgreSQL)",
                    url=f"sqla+postgresql://{host}/sqla_bench",
                    db_url=self.pg.dsn("sqla_bench"),
                    available=True,
                    slow=True,
                )
            except ImportError:
                self.brokers["sqlalchemy"] = Broker(
                    "sqlalchemy", "kombu SQLAlchemy transport", reason="sqlalchemy not installed"
                )
            log(f"PostgreSQL {self.pg_settings.get('server_version')} on port {self.pg.port}")
        except Exception as exc:
            log(f"PostgreSQL could not start: {exc}")
            for name in names:
                self.brokers[name] = Broker(name, name, reason=f"PostgreSQL did not start: {exc}")
