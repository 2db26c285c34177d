"""Prometheus metrics of a pgskip schema: a ``prometheus_client`` collector and its HTTP server.

:class:`PgSkipCollector` reads the state of the broker at each scrape, over a connection of its
own to the broker's database, with a few statements that each read only what a partial index
covers (``sql/metrics.sql``; the completed rows, most of a large ``jobs`` table, are never
read). Register it with any registry::

    from prometheus_client import REGISTRY
    from kombu_pgskip.metrics import PgSkipCollector

    REGISTRY.register(PgSkipCollector(app.conf.broker_url, schema="pgskip"))

or serve it on its own with ``celery -A proj pgskip metrics --port 9808`` (:func:`serve`).

Per queue: pending, scheduled, running and failed messages, the redelivered ones among those
pending and running, the age of the oldest pending message, the live consumers of the queue,
whether it is paused, and its limits.
For the schema: the consumers whose lease holds and those whose lease ran out, the database's
xmin horizon (how old the oldest snapshot that stops vacuum is), how long rotations of
``jobs``' slots have been refused a slot's lock, the ``jobs`` table's size, live and dead row
versions and inserted rows, and, where pg_cron is installed and this role may
read its jobs, whether each of the schema's pg_cron jobs is active and how its last run ended.
docs/metrics.md describes each metric.

Each statement runs under ``statement_timeout`` (the ``timeout``), and a scrape waits at most
that long for one still running, so a scrape never hangs: when the database cannot be read the
scrape returns ``pgskip_up 0`` (and the scrape's duration) and logs why at WARNING level, once
per distinct reason; the next scrape connects again.

Needs the ``metrics`` extra: ``pip install "kombu-pgskip[metrics]"``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from . import cron, exceptions
from .migrate import DEFAULT_SCHEMA
from .sql import queries_in
from .urls import SAFE_SEARCH_PATH, Connection, connect, mask_url, scrub, with_dbname

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the pgskip metrics need prometheus_client, which is not installed: "
        'pip install "kombu-pgskip[metrics]"'
    ) from exc

logger = logging.getLogger(__name__)

#: Seconds each statement of a scrape may run (``statement_timeout``), and that a scrape waits
#: for another one still running.
DEFAULT_TIMEOUT = 5.0
#: Seconds before pg_cron is looked for again after it was not found or could not be read.
CRON_RETRY_S = 60.0
#: Holders of the xmin horizon read per scrape (the oldest ones).
XMIN_HOLDERS = 10

_PENDING, _SCHEDULED, _RUNNING, _FAILED = "pending", "scheduled", "running", "failed"
#: The limits of a queue (pgskip limit), as the `limit` label of pgskip_queue_limit says them.
_LIMIT_KINDS = ("max_running", "max_running_per_key", "rate")

#: name -> (type, HELP text, label names) of every metric family the collector yields.
#: Counter families are named without ``_total``; their samples end with it.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "pgskip_up": (
        "gauge",
        "1 when this scrape read the broker's database, 0 when it could not (the exporter "
        "logs why)",
        (),
    ),
    "pgskip_scrape_duration_seconds": (
        "gauge",
        "Seconds this scrape of the broker's database took",
        (),
    ),
    "pgskip_pending_messages": (
        "gauge",
        "Messages ready for delivery in the queue (status pending)",
        ("queue",),
    ),
    "pgskip_scheduled_messages": (
        "gauge",
        "Messages of the queue waiting for their eta or countdown (status scheduled)",
        ("queue",),
    ),
    "pgskip_running_messages": (
        "gauge",
        "Messages of the queue delivered to a consumer and not yet acknowledged (status running)",
        ("queue",),
    ),
    "pgskip_failed_messages": (
        "gauge",
        "Failed messages (dead letters) of the queue kept until failed_retention",
        ("queue",),
    ),
    "pgskip_redelivered_messages": (
        "gauge",
        "Messages of the queue, pending or running (status), that were delivered before: "
        "their consumer's lease ran out or they were requeued",
        ("queue", "status"),
    ),
    "pgskip_oldest_pending_age_seconds": (
        "gauge",
        "Seconds since the first pending message of the queue took its place in it: its publish"
        " (a countdown's too: it keeps its place), or its retry (0 when none is pending)",
        ("queue",),
    ),
    "pgskip_queue_paused": (
        "gauge",
        "1 while the queue is paused for every worker (pgskip pause), else 0",
        ("queue",),
    ),
    "pgskip_queue_limit": (
        "gauge",
        "A limit of the queue for every worker (pgskip limit): max_running and"
        " max_running_per_key in messages running at once, rate in starts per second",
        ("queue", "limit"),
    ),
    "pgskip_queue_consumers": (
        "gauge",
        "Consumers whose lease holds that consume the queue",
        ("queue",),
    ),
    "pgskip_consumers_alive": (
        "gauge",
        "Consumers (worker channels) whose lease holds",
        (),
    ),
    "pgskip_consumers_lease_expired": (
        "gauge",
        "Consumers whose lease ran out and that no sweep has removed yet: their running "
        "messages return to pending at the next sweep",
        (),
    ),
    "pgskip_xmin_horizon_age_transactions": (
        "gauge",
        "Transactions since the xmin of the oldest snapshot, transaction, prepared transaction "
        "or replication slot of the database (0 when none): vacuum cannot remove row versions "
        "newer than it",
        (),
    ),
    "pgskip_xmin_horizon_age_seconds": (
        "gauge",
        "Seconds the oldest holder of the database's xmin horizon has held it, as far as this "
        "role can see (0 when none)",
        (),
    ),
    "pgskip_jobs_ring_blocked_seconds": (
        "gauge",
        "Seconds since rotations of the jobs table's slots were first refused a slot's lock "
        "(0 while they get their locks): no slot is emptied meanwhile",
        (),
    ),
    "pgskip_jobs_table_size_bytes": (
        "gauge",
        "Size on disk of the jobs table with its indexes and TOAST",
        (),
    ),
    "pgskip_jobs_live_tuples": (
        "gauge",
        "Live row versions of the jobs table (statistics collector's estimate)",
        (),
    ),
    "pgskip_jobs_dead_tuples": (
        "gauge",
        "Dead row versions of the jobs table that vacuum has not removed yet (statistics "
        "collector's estimate)",
        (),
    ),
    "pgskip_jobs_last_autovacuum_timestamp_seconds": (
        "gauge",
        "When autovacuum last vacuumed the jobs table (Unix time; absent when it never did "
        "since the statistics were reset)",
        (),
    ),
    "pgskip_jobs_inserted": (
        "counter",
        "Rows inserted into the jobs table (messages published, periodic ones included) since "
        "the statistics were reset",
        (),
    ),
    "pgskip_cron_job_active": (
        "gauge",
        "1 when the schema's pg_cron job is active, 0 when it is not (absent without pg_cron)",
        ("cron_job",),
    ),
    "pgskip_cron_job_last_run_succeeded": (
        "gauge",
        "1 when the last finished run of the schema's pg_cron job succeeded, 0 when it failed "
        "(absent before its first finished run, and without pg_cron)",
        ("cron_job",),
    ),
    "pgskip_cron_job_last_run_timestamp_seconds": (
        "gauge",
        "When the last finished run of the schema's pg_cron job ended (Unix time; absent "
        "before its first finished run, for a run that never connected, and without pg_cron)",
        ("cron_job",),
    ),
}


def exposed_names() -> set[str]:
    """The names of the samples the collector can expose (counters with ``_total``), as
    PromQL queries name them."""
    return {
        name + "_total" if kind == "counter" else name for name, (kind, _, _) in FAMILIES.items()
    }


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    kind, help_text, labels = FAMILIES[name]
    if kind == "counter":
        return CounterMetricFamily(name, help_text, labels=list(labels))
    return GaugeMetricFamily(name, help_text, labels=list(labels))


class PgSkipCollector:
    """A ``prometheus_client`` collector of one schema's broker state (see the module).

    ``url``: the broker URL (``pgskip://`` or ``postgresql://``); ``schema``: the broker's
    schema; ``timeout``: seconds each statement may run (``statement_timeout`` on the
    collector's connection) and a scrape waits for another one still running;
    ``cron_database``: where pg_cron lives, when it cannot be found by itself (as
    ``--cron-database`` of ``beat-list``). Thread-safe: concurrent scrapes take turns.
    """

    def __init__(
        self,
        url: str,
        schema: str = DEFAULT_SCHEMA,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        cron_database: str | None = None,
        cron_retry: float = CRON_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0:
            raise exceptions.ConfigurationError(f"timeout must be positive, not {timeout!r}")
        self.url = url
        self.schema = schema
        self.timeout = timeout
        self.cron_database = cron_database
        self.cron_retry = cron_retry
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._cron_server: cron.CronServer | None = None
        self._cron_conn: Connection | None = None
        self._cron_retry_at = 0.0
        #: Why the last scrape could not read the database (None after one that could).
        self.last_error: str | None = None

    # -- prometheus_client's collector interface --------------------------------------------

    def describe(self) -> Iterator[Metric]:
        """Every family the collector yields, without samples (for the registry's name check;
        it reads nothing from the database)."""
        for name in FAMILIES:
            yield _family(name)

    def collect(self) -> Iterator[Metric]:
        """The families of one scrape; only ``pgskip_up`` 0 and the duration when the database
        cannot be read."""
        started = time.perf_counter()
        families: list[Metric] = []
        error: str | None
        if not self._lock.acquire(timeout=self.timeout):
            error = f"a previous scrape has been running for more than {self.timeout:g}s"
        else:
            try:
                families = self._scrape()
                error = None
            except (psycopg.Error, exceptions.PgSkipError) as exc:
                self._close_connections()
                error = self._explain(exc)
            finally:
                self._lock.release()
        self._note(error)
        up = _family("pgskip_up")
        up.add_metric([], 0.0 if error else 1.0)
        duration = _family("pgskip_scrape_duration_seconds")
        duration.add_metric([], time.perf_counter() - started)
        yield from families
        yield up
        yield duration

    def close(self) -> None:
        """Close the collector's connections (the next scrape opens them again)."""
        with self._lock:
            self._close_connections()

    # -- the scrape -----------------------------------------------------------------------

    def _scrape(self) -> list[Metric]:
        conn = self._connection()
        q = queries_in("metrics.sql", self.schema)
        families = self._queue_families(conn, q)
        families += self._consumer_families(conn, q)
        families += self._horizon_families(conn)
        families += self._table_families(conn, q)
        families += self._ring_families(conn, q)
        families += self._cron_families()
        return families

    def _queue_families(self, conn: Connection, q: dict[str, Any]) -> list[Metric]:
        counts: dict[tuple[str, str], tuple[int, int, float | None]] = {}
        for status, queue, messages, redelivered, oldest in conn.execute(q["queue_counts"]):
            counts[(str(status), str(queue))] = (int(messages), int(redelivered), oldest)
        declared = [str(r[0]) for r in conn.execute(q["declared_queues"])]
        paused = {str(r[0]) for r in conn.execute(q["paused_queues"])}
        limits = {str(r[0]): r[1:] for r in conn.execute(q["queue_limits"])}
        queues = sorted({*declared, *paused, *limits, *(queue for _, queue in counts)})
        consumers = {str(r[0]): int(r[1]) for r in conn.execute(q["queue_consumers"])}

        by_status = {
            _PENDING: _family("pgskip_pending_messages"),
            _SCHEDULED: _family("pgskip_scheduled_messages"),
            _RUNNING: _family("pgskip_running_messages"),
            _FAILED: _family("pgskip_failed_messages"),
        }
        redelivered = _family("pgskip_redelivered_messages")
        oldest = _family("pgskip_oldest_pending_age_seconds")
        queue_consumers = _family("pgskip_queue_consumers")
        queue_paused = _family("pgskip_queue_paused")
        queue_limit = _family("pgskip_queue_limit")
        for queue, values in sorted(limits.items()):
            for kind, value in zip(_LIMIT_KINDS, values, strict=True):
                if value is not None:
                    queue_limit.add_metric([queue, kind], float(value))
        for queue in queues:
            for status, family in by_status.items():
                family.add_metric([queue], counts.get((status, queue), (0, 0, None))[0])
            for status in (_PENDING, _RUNNING):
                redelivered.add_metric(
                    [queue, status], counts.get((status, queue), (0, 0, None))[1]
                )
            age = counts.get((_PENDING, queue), (0, 0, None))[2]
            oldest.add_metric([queue], 0.0 if age is None else float(age))
            queue_consumers.add_metric([queue], consumers.get(queue, 0))
            queue_paused.add_metric([queue], 1 if queue in paused else 0)
        return [
            *by_status.values(),
            redelivered,
            oldest,
            queue_consumers,
            queue_paused,
            queue_limit,
        ]

    def _consumer_families(self, conn: Connection, q: dict[str, Any]) -> list[Metric]:
        row = conn.execute(q["consumer_counts"]).fetchone()
        alive, expired = (0, 0) if row is None else (int(row[0]), int(row[1]))
        alive_family = _family("pgskip_consumers_alive")
        alive_family.add_metric([], alive)
        expired_family = _family("pgskip_consumers_lease_expired")
        expired_family.add_metric([], expired)
        return [alive_family, expired_family]

    def _horizon_families(self, conn: Connection) -> list[Metric]:
        query = queries_in("health.sql", self.schema)["xmin_holders"]
        rows = conn.execute(query, {"limit": XMIN_HOLDERS}).fetchall()
        ages = [int(r[6]) for r in rows if r[6] is not None]
        held = [float(r[7]) for r in rows if r[7] is not None]
        transactions = _family("pgskip_xmin_horizon_age_transactions")
        transactions.add_metric([], max(ages, default=0))
        seconds = _family("pgskip_xmin_horizon_age_seconds")
        seconds.add_metric([], max(0.0, max(held, default=0.0)))
        return [transactions, seconds]

    def _ring_families(self, conn: Connection, q: dict[str, Any]) -> list[Metric]:
        row = conn.execute(q["ring_blocked_seconds"]).fetchone()
        blocked = _family("pgskip_jobs_ring_blocked_seconds")
        blocked.add_metric([], 0.0 if row is None or row[0] is None else max(0.0, float(row[0])))
        return [blocked]

    def _table_families(self, conn: Connection, q: dict[str, Any]) -> list[Metric]:
        row = conn.execute(q["jobs_table"], {"schema": self.schema}).fetchone()
        if row is None:
            return []
        size, live, dead, inserted, last_autovacuum = row
        families: list[Metric] = []
        for name, value in (
            ("pgskip_jobs_table_size_bytes", size),
            ("pgskip_jobs_live_tuples", live),
            ("pgskip_jobs_dead_tuples", dead),
            ("pgskip_jobs_inserted", inserted),
            ("pgskip_jobs_last_autovacuum_timestamp_seconds", last_autovacuum),
        ):
            family = _family(name)
            if value is not None:
                family.add_metric([], float(value))
            families.append(family)
        return families

    def _cron_families(self) -> list[Metric]:
        """The schema's pg_cron jobs; nothing where pg_cron is not installed or not readable
        (looked for again every ``cron_retry`` seconds)."""
        if self._cron_server is None:
            if self._clock() < self._cron_retry_at:
                return []
            try:
                self._cron_server = cron.locate(self.url, self.cron_database, schedule=False)
            except (psycopg.Error, exceptions.PgSkipError) as exc:
                self._cron_off(f"pg_cron not found: {exc}")
                return []
        server = self._cron_server
        prefix = cron.job_prefix(server.app_database, self.schema)
        try:
            conn = self._cron_connection(server)
            jobs = cron.list_jobs(conn, prefix)
            runs = cron.recent_runs(conn, prefix, per_job=1)
        except (psycopg.Error, exceptions.PgSkipError) as exc:
            self._cron_off(f"cannot read pg_cron's jobs in {server.cron_database!r}: {exc}")
            return []
        active = _family("pgskip_cron_job_active")
        succeeded = _family("pgskip_cron_job_last_run_succeeded")
        ended = _family("pgskip_cron_job_last_run_timestamp_seconds")
        for job in jobs:
            active.add_metric([job.name[len(prefix) :]], 1.0 if job.active else 0.0)
        for run in runs:
            label = [run.job[len(prefix) :]]
            succeeded.add_metric(label, 1.0 if run.status == cron.SUCCEEDED else 0.0)
            if run.ended_at is not None:
                ended.add_metric(label, run.ended_at.timestamp())
        return [active, succeeded, ended]

    def _cron_off(self, reason: str) -> None:
        logger.debug(
            "pgskip metrics: no pg_cron metrics (%s); looking again in %.0fs",
            reason,
            self.cron_retry,
            extra={"action": "metrics_cron_off"},
        )
        self._close_cron_connection()
        self._cron_server = None
        self._cron_retry_at = self._clock() + self.cron_retry

    # -- connections ------------------------------------------------------------------------

    def _bound(self, conn: Connection) -> Connection:
        """``conn`` with the scrape's limits: each statement and lock wait at most
        ``timeout``."""
        limit = f"{max(1, math.ceil(self.timeout * 1000))}ms"
        conn.execute(
            "SELECT set_config('statement_timeout', %(limit)s, false),"
            " set_config('lock_timeout', %(limit)s, false),"
            " set_config('search_path', %(path)s, false)",
            {"limit": limit, "path": SAFE_SEARCH_PATH},
        )
        return conn

    def _connect_kwargs(self) -> dict[str, Any]:
        seconds = max(1, math.ceil(self.timeout))
        # TCP keepalives: a read on a connection whose server went away ends in seconds.
        return {
            "connect_timeout": max(2, seconds),
            "application_name": "kombu-pgskip metrics",
            "keepalives": 1,
            "keepalives_idle": seconds,
            "keepalives_interval": 1,
            "keepalives_count": 3,
        }

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed:
            conn = connect(self.url, **self._connect_kwargs())
            try:
                self._conn = self._bound(conn)
            except BaseException:
                conn.close()
                raise
        return self._conn

    def _cron_connection(self, server: cron.CronServer) -> Connection:
        if server.same_database:
            return self._connection()
        if self._cron_conn is None or self._cron_conn.closed:
            try:
                conn = psycopg.connect(
                    with_dbname(self.url, server.cron_database),
                    autocommit=True,
                    **self._connect_kwargs(),
                )
            except psycopg.OperationalError as exc:
                raise exceptions.ConnectionFailed(
                    f"cannot connect to database {server.cron_database!r} on the server of "
                    f"{mask_url(self.url)}: {scrub(str(exc).strip(), self.url)}"
                ) from None
            try:
                self._cron_conn = self._bound(conn)
            except BaseException:
                conn.close()
                raise
        return self._cron_conn

    def _close_cron_connection(self) -> None:
        if self._cron_conn is not None:
            self._cron_conn.close()
            self._cron_conn = None

    def _close_connections(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._close_cron_connection()

    # -- errors -----------------------------------------------------------------------------

    def _explain(self, exc: BaseException) -> str:
        where = f"{mask_url(self.url)} schema {self.schema!r}"
        if isinstance(exc, pg_errors.QueryCanceled):
            return (
                f"a metrics statement ran longer than {self.timeout:g}s (statement_timeout) "
                f"on {where}: {' '.join(str(exc).split())}"
            )
        out = exceptions.classify(exc, url_for_messages=mask_url(self.url))
        text = " ".join(str(out).split())
        return f"cannot read the broker's state at {where}: {text}"

    def _note(self, error: str | None) -> None:
        """Log a failing scrape once per distinct reason, and the first one that succeeds
        after."""
        if error is not None and error != self.last_error:
            logger.warning(
                "pgskip metrics: scrape failed: %s", error, extra={"action": "metrics_failed"}
            )
        elif error is None and self.last_error is not None:
            logger.info(
                "pgskip metrics: the broker's database can be read again",
                extra={"action": "metrics_recovered"},
            )
        self.last_error = error


def serve(
    url: str,
    schema: str = DEFAULT_SCHEMA,
    *,
    port: int,
    addr: str = "0.0.0.0",
    timeout: float = DEFAULT_TIMEOUT,
    cron_database: str | None = None,
    announce: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> None:
    """Serve the collector's metrics on ``http://addr:port/metrics`` until interrupted
    (Ctrl-C, SIGTERM) or ``stop`` is set. ``port`` 0 picks a free port; ``announce`` receives
    the line that names the address. Raises ``OSError`` when the address cannot be bound."""
    collector = PgSkipCollector(url, schema, timeout=timeout, cron_database=cron_database)
    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    stop = stop or threading.Event()
    restore: Sequence[tuple[int, Any]] = ()
    if threading.current_thread() is threading.main_thread():
        restore = [(signal.SIGTERM, signal.signal(signal.SIGTERM, lambda *_: stop.set()))]
    try:
        host = f"[{addr}]" if ":" in addr else addr
        announce(
            f"serving the metrics of {mask_url(url)} schema {schema!r} on "
            f"http://{host}:{server.server_port}/metrics"
        )
        for _ in collector.collect():  # a first scrape: logs what stops it, if anything does
            pass
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
        collector.close()
        for signum, handler in restore:
            signal.signal(signum, handler)


__all__ = ["DEFAULT_TIMEOUT", "FAMILIES", "PgSkipCollector", "exposed_names", "serve"]
