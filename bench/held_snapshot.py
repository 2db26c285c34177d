"""A held snapshot: dequeue throughput and ``jobs`` size before, during and after.

A real ``celery worker`` (threads pool, 4 threads) consumes a steady flow of ``--rate`` messages
per second. Three phases:

``before``
    normal operation (autovacuum and HOT pruning reclaim the dead row versions each message
    leaves behind: one insert and two updates per message);
``during``
    another session holds a REPEATABLE READ snapshot, idle in transaction, so no dead row
    version newer than it can be removed; the worker must log a WARNING naming that session
    (``xmin_horizon_warning``);
``after``
    the transaction ends and one ``VACUUM`` runs (what autovacuum does within
    ``autovacuum_naptime``).

Each phase reports the steady throughput (tasks completed per second at the offered rate), the
*drain rate* of a burst of ``--probe`` messages published at once at the end of the phase (how
fast the worker can dequeue: the capacity the bloat eats into), the size of ``jobs`` with its
indexes and its growth per 1,000 messages, and the dead row versions a ``VACUUM`` at the end of
the phase found but could not remove.

Run (a throwaway embedded PostgreSQL unless ``--url`` is given; several minutes)::

    python -m bench.held_snapshot --hold 300
    python -m bench.held_snapshot --url postgresql://postgres@host/db --json out.json

The test ``tests/chaos/test_held_snapshot.py`` runs the same code for about 50 seconds.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from tests.helpers import REPO_ROOT, CeleryWorker

APPS_DIR = str(REPO_ROOT / "tests" / "apps")
SCHEMA = "pgskip"
TASK = "safetyapp.noop"
HOLDER_APP = "held-snapshot"
HOLDER_QUERY = "SELECT count(*) FROM pgskip.jobs /* held snapshot */"
_NOT_REMOVABLE = re.compile(r"(\d+) are dead but not yet removable")
_WARNING = re.compile(r"^.*WARNING.*xmin horizon.*$", re.MULTILINE)
_INSERT = sql.SQL(
    "INSERT INTO {s}.jobs (queue, payload, task_name, task_id, slot)"
    " SELECT %(queue)s, jsonb_set(%(payload)s::jsonb, '{{headers,id}}', to_jsonb(u))::json,"
    " %(task)s, u, (SELECT slot FROM {s}.jobs_rotation) FROM (SELECT gen_random_uuid()::text AS u"
    " FROM generate_series(1, %(n)s)) AS g"
).format(s=sql.Identifier(SCHEMA))
T = TypeVar("T")


@dataclass
class Phase:
    name: str
    seconds: float
    completed: int
    throughput: float  # tasks completed per second at the offered rate
    drain_rate: float | None  # msg/s draining the backlog plus a burst of --probe messages
    total_bytes: int  # jobs + its indexes + TOAST, at the end of the phase
    table_bytes: int
    index_bytes: int
    growth_bytes: int  # total_bytes growth during the phase
    growth_per_1000: float  # bytes of growth per 1,000 messages completed
    dead_not_removable: int  # from VACUUM VERBOSE at the end of the phase
    pending_at_end: int  # backlog when the phase ended (the worker could not keep up)


@dataclass
class Result:
    rate: int
    threshold: float
    phases: list[Phase] = field(default_factory=list)
    holder_pid: int | None = None
    warnings: list[str] = field(default_factory=list)
    left_at_end: int = 0  # messages still waiting after the last drain

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def table(self) -> str:
        head = (
            "| phase | seconds | tasks/s at offered rate | backlog at end | drain msg/s "
            "| jobs+indexes MB | growth KB / 1,000 msgs | dead rows VACUUM could not remove |"
        )
        lines = [head, "|---|---|---|---|---|---|---|---|"]
        for p in self.phases:
            drain = "-" if p.drain_rate is None else f"{p.drain_rate:,.0f}"
            lines.append(
                f"| {p.name} | {p.seconds:.0f} | {p.throughput:,.0f} | {p.pending_at_end:,} | "
                f"{drain} | {p.total_bytes / 1e6:.1f} | {p.growth_per_1000 / 1024:,.0f} | "
                f"{p.dead_not_removable:,} |"
            )
        return "\n".join(lines)


class Load(threading.Thread):
    """Inserts ``rate`` copies of a real Celery message per second (fresh task ids), in batches.

    The rows are what ``publish`` writes; inserting them in batches keeps the load generator's
    own CPU out of the measurement.
    """

    def __init__(self, url: str, queue: str, payload: str, rate: int, tick: float = 0.05):
        super().__init__(name="held-snapshot-load", daemon=True)
        self.url, self.queue, self.payload, self.rate, self.tick = url, queue, payload, rate, tick
        self.stop_event = threading.Event()
        self.paused = threading.Event()
        self.published = 0
        self.error: BaseException | None = None

    def burst(self, conn: psycopg.Connection[Any], n: int) -> None:
        insert_messages(conn, self.queue, self.payload, n)

    def run(self) -> None:
        try:
            with psycopg.connect(
                self.url, autocommit=True, application_name="held-snapshot-load"
            ) as conn:
                carry = 0.0
                next_at = time.monotonic()
                while not self.stop_event.is_set():
                    if not self.paused.is_set():
                        carry += self.rate * self.tick
                        n = int(carry)
                        carry -= n
                        if n:
                            self.burst(conn, n)
                            self.published += n
                    next_at = max(next_at + self.tick, time.monotonic() - self.tick)
                    self.stop_event.wait(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:  # reported by the caller
            self.error = exc


def insert_messages(conn: psycopg.Connection[Any], queue: str, payload: str, n: int) -> None:
    """``n`` copies of the message ``payload`` into ``queue``, each with a fresh task id, in one
    statement: the rows ``publish`` writes, without the publisher's CPU."""
    conn.execute(_INSERT, {"queue": queue, "payload": payload, "task": TASK, "n": n})


def noop_worker(broker_url: str, queue: str, **options: float) -> CeleryWorker:
    """A ``celery worker`` of ``safetyapp`` (threads pool, 4 threads) consuming ``queue``;
    ``options`` are transport options (``lease_seconds=30`` ...)."""
    return CeleryWorker(
        "safetyapp",
        broker_url,
        queues=[queue],
        pool="threads",
        concurrency=4,
        cwd=APPS_DIR,
        extra_env={f"PGSKIP_OPT_{k.upper()}": str(v) for k, v in options.items()},
    )


def in_fresh_database(server_url: str | None, prefix: str, measure: Callable[[str], T]) -> T:
    """``measure(url)`` on a new migrated database ``<prefix>_<random>``, dropped afterwards, on
    the server of the superuser URL ``server_url`` (None: a throwaway embedded PostgreSQL)."""
    from kombu_pgskip.migrate import migrate
    from kombu_pgskip.testing.embedded import EmbeddedPostgres
    from tests.helpers import make_url

    def on(server_dsn: str) -> T:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            url = make_url(server_dsn, name)
            migrate(url)
            return measure(url)
        finally:
            with psycopg.connect(server_dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )

    if server_url:
        return on(server_url)
    with EmbeddedPostgres(fsync=False) as pg:
        return on(pg.dsn("postgres"))


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sample_payload(broker_url: str, queue: str) -> str:
    """A real message for ``safetyapp.noop`` as pgskip stores it (published, read, deleted)."""
    from celery import Celery

    import kombu_pgskip  # noqa: F401

    app = Celery("held_snapshot_sample", broker=broker_url, set_as_current=False)
    try:
        app.send_task(TASK, queue=queue)
    finally:
        app.close()
    url = broker_url.replace("pgskip://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("DELETE FROM {}.jobs WHERE queue = %s RETURNING payload::text").format(
                sql.Identifier(SCHEMA)
            ),
            (queue,),
        ).fetchone()
    assert row is not None
    return str(row[0])


def _one(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _sizes(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
    row = conn.execute(
        "SELECT sum(pg_total_relation_size(relid)), sum(pg_relation_size(relid)),"
        " sum(pg_indexes_size(relid)) FROM pg_partition_tree('pgskip.jobs') WHERE isleaf"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _completed(conn: psycopg.Connection[Any]) -> int:
    return int(_one(conn, "SELECT count(*) FROM pgskip.jobs WHERE status = 'completed'"))


def _waiting(conn: psycopg.Connection[Any], queue: str) -> int:
    return int(
        _one(
            conn,
            "SELECT count(*) FROM pgskip.jobs WHERE queue = %s AND status IN ('pending','running')",
            (queue,),
        )
    )


def _drain(conn: psycopg.Connection[Any], queue: str, timeout: float) -> float | None:
    """Wait (publishing paused) until ``queue`` has nothing waiting or running, at most
    ``timeout`` seconds; returns the rate in msg/s at which it drained (None: nothing to do)."""
    t0 = time.monotonic()
    start = left = _waiting(conn, queue)
    while left and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
        left = _waiting(conn, queue)
    took = time.monotonic() - t0
    return (start - left) / took if start and took > 0 else None


def _left_to_move(conn: psycopg.Connection[Any]) -> int:
    """Completed messages the ring's rotate() is still to move to ``jobs_kept`` (those of the
    slots behind the current one, as migration 0028's move selects them)."""
    return int(
        _one(
            conn,
            "SELECT count(*) FROM pgskip.jobs AS j, pgskip.jobs_rotation AS r"
            " WHERE j.slot NOT IN (0, r.slot) AND j.status = 'completed'"
            "   AND j.finished_at > now() - r.completed_retention + interval '1 minute'",
        )
    )


def vacuum_not_removable(conn: psycopg.Connection[Any], settle: float = 30.0) -> int:
    """``VACUUM (VERBOSE) pgskip.jobs``: the dead row versions it found but could not remove.

    It first waits (at most ``settle`` seconds) for the worker's rotate() to have moved the
    completed messages it moves: rows a move deletes while VACUUM runs are dead but not yet
    removable for that VACUUM, whatever holds the horizon."""
    deadline = time.monotonic() + settle
    while _left_to_move(conn) and time.monotonic() < deadline:
        time.sleep(0.2)
    notices: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        notices.append(diag.message_primary or "")

    conn.add_notice_handler(keep)
    try:
        conn.execute("VACUUM (VERBOSE) pgskip.jobs")
    finally:
        conn.remove_notice_handler(keep)
    found = [int(m.group(1)) for n in notices for m in _NOT_REMOVABLE.finditer(n)]
    return max(found) if found else 0


@contextmanager
def held_snapshot(url: str) -> Iterator[int]:
    """A REPEATABLE READ transaction that read ``jobs`` and stays idle; yields its pid."""
    conn = psycopg.connect(url, application_name=HOLDER_APP)
    try:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute(HOLDER_QUERY)
        yield int(conn.info.backend_pid)
    finally:
        conn.rollback()
        conn.close()


def run(
    db_url: str,
    *,
    rate: int = 500,
    before: float = 60.0,
    hold: float = 300.0,
    after: float = 120.0,
    threshold: float = 60.0,
    probe: int = 5000,
    lease_seconds: float = 30.0,
    drain_timeout: float = 60.0,
    log: Any = None,
) -> Result:
    """Run the three phases against the migrated database ``db_url`` and return the figures."""
    say = log or (lambda msg: None)
    broker_url = db_url.replace("postgresql://", "pgskip://", 1)
    queue = f"held.{uuid.uuid4().hex[:8]}"
    payload = sample_payload(broker_url, queue)
    result = Result(rate=rate, threshold=threshold)
    worker = noop_worker(
        broker_url, queue, xmin_horizon_warning=threshold, lease_seconds=lease_seconds
    )
    load = Load(db_url, queue, payload, rate)
    with psycopg.connect(db_url, autocommit=True) as conn, worker:
        load.start()
        try:

            def phase(name: str, seconds: float) -> None:
                say(f"phase {name}: {seconds:.0f}s at {rate} msg/s")
                load.paused.clear()
                size0 = _sizes(conn)[0]
                done0 = _completed(conn)
                t0 = time.monotonic()
                time.sleep(seconds)
                done = _completed(conn) - done0
                elapsed = time.monotonic() - t0
                load.paused.set()
                pending = _waiting(conn, queue)  # the backlog the offered rate left
                drain_rate = None
                if probe:
                    load.burst(conn, probe)
                    drain_rate = _drain(conn, queue, timeout=drain_timeout)
                else:
                    _drain(conn, queue, timeout=drain_timeout)
                total, table, index = _sizes(conn)
                dead = vacuum_not_removable(conn)
                result.phases.append(
                    Phase(
                        name=name,
                        seconds=elapsed,
                        completed=done,
                        throughput=done / elapsed,
                        drain_rate=drain_rate,
                        total_bytes=total,
                        table_bytes=table,
                        index_bytes=index,
                        growth_bytes=total - size0,
                        growth_per_1000=(total - size0) * 1000 / max(1, done + probe),
                        dead_not_removable=dead,
                        pending_at_end=pending,
                    )
                )
                say(f"  {result.phases[-1]}")

            phase("before", before)
            with held_snapshot(db_url) as pid:
                result.holder_pid = pid
                phase("during", hold)
            conn.execute("VACUUM pgskip.jobs")  # what autovacuum does within its naptime
            phase("after", after)
            # Publishing stays paused: what is left once the queue drained (or the drain
            # timed out) is what was not delivered.
            _drain(conn, queue, timeout=drain_timeout)
            result.left_at_end = _waiting(conn, queue)
        finally:
            load.stop_event.set()
            load.join(timeout=10)
        result.warnings = _WARNING.findall(worker.log_text())
    if load.error is not None:
        raise RuntimeError(f"the load generator failed: {load.error}") from load.error
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="superuser URL of a database (default: embedded server)")
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--before", type=float, default=60.0)
    parser.add_argument("--hold", type=float, default=300.0)
    parser.add_argument("--after", type=float, default=120.0)
    parser.add_argument("--threshold", type=float, default=60.0)
    parser.add_argument("--probe", type=int, default=5000)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    result = in_fresh_database(
        args.url,
        "held_snapshot",
        lambda url: run(
            url,
            rate=args.rate,
            before=args.before,
            hold=args.hold,
            after=args.after,
            threshold=args.threshold,
            probe=args.probe,
            log=log_to_stderr,
        ),
    )
    print(result.table())
    print(f"\nworker warnings ({len(result.warnings)}):")
    for line in result.warnings:
        print("  " + line.strip())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
