"""The Prometheus collector against real rows, its statements' plans, its failures, the pg_cron
jobs' last runs, and ``pgskip metrics`` serving it over HTTP in a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kombu_pgskip.__main__ import main
from kombu_pgskip.envelope import to_row
from kombu_pgskip.grants import apply_grants, grant_statements
from kombu_pgskip.metrics import PgSkipCollector, exposed_names
from kombu_pgskip.sql import queries_in
from kombu_pgskip.store import Store
from tests.helpers import REPO_ROOT, finished_slot_behind, make_url


def _insert(
    conn: psycopg.Connection[Any],
    queue: str,
    status: str,
    n: int = 1,
    *,
    redelivered: bool = False,
    due_ago: float = 0.0,
    locked_by: uuid.UUID | None = None,
) -> None:
    conn.execute(
        "INSERT INTO pgskip.jobs (queue, status, run_at, payload, task_name, redelivered,"
        " locked_by, locked_at, finished_at)"
        " SELECT %s, %s::pgskip.job_status, now() - %s * interval '1 second'"
        "          + CASE WHEN %s = 'scheduled' THEN interval '1 hour' ELSE interval '0' END,"
        "        '{}', 't', %s, %s, CASE WHEN %s::uuid IS NOT NULL THEN now() END,"
        "        CASE WHEN %s IN ('completed', 'failed') THEN now() END"
        "   FROM generate_series(1, %s)",
        (queue, status, due_ago, status, redelivered, locked_by, locked_by, status, n),
    )


def _consumer(conn: psycopg.Connection[Any], queues: list[str], lease: str) -> uuid.UUID:
    cid = uuid.uuid4()
    conn.execute(
        "INSERT INTO pgskip.consumers (id, hostname, pid, queues, lease_until)"
        " VALUES (%s, 'test', 1, %s, now() + %s::interval)",
        (cid, queues, lease),
    )
    return cid


def _registry(collector: PgSkipCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def _sample_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples}


@pytest.fixture
def collector(db_url: str) -> Iterator[PgSkipCollector]:
    c = PgSkipCollector(db_url)
    yield c
    c.close()


def test_collector_counts_each_status_per_queue(db_url: str, collector: PgSkipCollector) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        alive = _consumer(conn, ["emails"], "1 minute")
        _consumer(conn, ["emails", "reports"], "-1 second")
        _insert(conn, "emails", "pending", 2)
        _insert(conn, "emails", "pending", redelivered=True, due_ago=120)
        _insert(conn, "emails", "scheduled", 2)
        _insert(conn, "emails", "running", locked_by=alive)
        _insert(conn, "emails", "running", redelivered=True, locked_by=alive)
        _insert(conn, "emails", "failed")
        _insert(conn, "emails", "completed", 50)
        _insert(conn, "reports", "failed", 3)
        # declared and kept: its series read 0; an auto_delete queue (pidbox) has none
        conn.execute("INSERT INTO pgskip.queues (name) VALUES ('idle')")
        conn.execute(
            "INSERT INTO pgskip.queues (name, auto_delete) VALUES ('w1@host.celery.pidbox', true)"
        )
        # paused before anything declared it: its series are there too
        conn.execute("INSERT INTO pgskip.paused_queues (name) VALUES ('reports'), ('held')")
        # limited before anything declared it, with two of its three limits
        conn.execute(
            "INSERT INTO pgskip.queue_limits (name, max_running, rate) VALUES ('paced', 3, 2.5)"
        )
    registry = _registry(collector)

    assert _value(registry, "pgskip_up") == 1.0
    assert _value(registry, "pgskip_pending_messages", queue="emails") == 3
    assert _value(registry, "pgskip_scheduled_messages", queue="emails") == 2
    assert _value(registry, "pgskip_running_messages", queue="emails") == 2
    assert _value(registry, "pgskip_failed_messages", queue="emails") == 1
    assert _value(registry, "pgskip_failed_messages", queue="reports") == 3
    assert _value(registry, "pgskip_pending_messages", queue="reports") == 0
    assert _value(registry, "pgskip_redelivered_messages", queue="emails", status="pending") == 1
    assert _value(registry, "pgskip_redelivered_messages", queue="emails", status="running") == 1
    oldest = _value(registry, "pgskip_oldest_pending_age_seconds", queue="emails")
    assert oldest is not None and 120 <= oldest < 180
    assert _value(registry, "pgskip_oldest_pending_age_seconds", queue="reports") == 0
    for name in ("pending", "scheduled", "running", "failed"):
        assert _value(registry, f"pgskip_{name}_messages", queue="idle") == 0
    assert _value(registry, "pgskip_pending_messages", queue="w1@host.celery.pidbox") is None
    assert _value(registry, "pgskip_queue_consumers", queue="emails") == 1
    assert _value(registry, "pgskip_queue_consumers", queue="reports") == 0
    paused = {q: _value(registry, "pgskip_queue_paused", queue=q) for q in ("emails", "reports")}
    assert paused == {"emails": 0, "reports": 1}
    assert _value(registry, "pgskip_pending_messages", queue="held") == 0
    assert _value(registry, "pgskip_queue_paused", queue="held") == 1
    limit = {
        (q, kind): _value(registry, "pgskip_queue_limit", queue=q, limit=kind)
        for q in ("paced", "emails")
        for kind in ("max_running", "max_running_per_key", "rate")
    }
    assert {k: v for k, v in limit.items() if v is not None} == {
        ("paced", "max_running"): 3,
        ("paced", "rate"): 2.5,
    }
    assert _value(registry, "pgskip_pending_messages", queue="paced") == 0
    assert _value(registry, "pgskip_consumers_alive") == 1
    assert _value(registry, "pgskip_consumers_lease_expired") == 1
    size = _value(registry, "pgskip_jobs_table_size_bytes")
    assert size is not None and size > 0

    # every name a scrape exposes is one the collector declares (and docs/metrics.md lists)
    assert _sample_names(registry) <= exposed_names()
    families = {family.name for family in collector.describe()}
    assert {family.name for family in registry.collect()} <= families


def test_a_worker_role_can_read_them(db_url: str) -> None:
    role = f"metrics_{uuid.uuid4().hex[:8]}"
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN").format(psycopg.sql.Identifier(role)))
        _insert(conn, "emails", "pending", 2)
    try:
        apply_grants(db_url, grant_statements(dbname, "pgskip", workers=[role], publishers=[]))
        parts = urlsplit(db_url)
        as_worker = urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))
        collector = PgSkipCollector(as_worker)
        try:
            registry = _registry(collector)
            assert _value(registry, "pgskip_up") == 1.0, collector.last_error
            assert _value(registry, "pgskip_pending_messages", queue="emails") == 2
            assert _value(registry, "pgskip_jobs_table_size_bytes")
        finally:
            collector.close()
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            ident = psycopg.sql.Identifier(role)
            conn.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(ident))
            conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(ident))


def test_dead_tuples_and_inserted_rows_come_from_the_statistics(
    db_url: str, collector: PgSkipCollector
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE pgskip.jobs_1 SET (autovacuum_enabled = false)")
        _insert(conn, "q", "completed", 200)
        conn.execute("DELETE FROM pgskip.jobs")
    registry = _registry(collector)
    deadline = time.monotonic() + 15
    # Backends report their statistics a moment after their transactions end.
    while True:
        dead = _value(registry, "pgskip_jobs_dead_tuples")
        inserted = _value(registry, "pgskip_jobs_inserted_total")
        if ((dead or 0) >= 200 and (inserted or 0) >= 200) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert dead is not None and dead >= 200
    assert inserted is not None and inserted >= 200
    assert _value(registry, "pgskip_jobs_live_tuples") is not None


def test_redelivered_messages_of_an_expired_lease_after_a_sweep(
    db_url: str, collector: PgSkipCollector
) -> None:
    store = Store(db_url)
    try:
        for i in range(3):
            message = {
                "body": json.dumps({"i": i}),
                "headers": {"task": "t", "id": f"m{i}"},
                "properties": {"priority": 0, "delivery_info": {}},
            }
            store.publish(to_row("work", message, eta_threshold=2, max_message_size=10**6))
        consumer = uuid.uuid4()
        store.register_consumer(consumer, hostname="test", queues=["work"], lease=0.2)
        assert len(store.fetch(["work"], 2, consumer)) == 2
        registry = _registry(collector)
        assert _value(registry, "pgskip_running_messages", queue="work") == 2
        assert _value(registry, "pgskip_pending_messages", queue="work") == 1
        assert _value(registry, "pgskip_queue_consumers", queue="work") == 1
        time.sleep(0.4)
        assert _value(registry, "pgskip_consumers_alive") == 0
        assert _value(registry, "pgskip_consumers_lease_expired") == 1
        assert _value(registry, "pgskip_queue_consumers", queue="work") == 0
        requeued, failed, gone = store.sweep(max_attempts=5)
        assert (requeued, failed, gone) == (2, 0, 1)
        assert _value(registry, "pgskip_consumers_lease_expired") == 0
        assert _value(registry, "pgskip_pending_messages", queue="work") == 3
        assert _value(registry, "pgskip_redelivered_messages", queue="work", status="pending") == 2
        assert _value(registry, "pgskip_redelivered_messages", queue="work", status="running") == 0
    finally:
        store.close()


def test_xmin_horizon_age_names_a_held_snapshot(db_url: str, collector: PgSkipCollector) -> None:
    registry = _registry(collector)
    with psycopg.connect(db_url) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")  # the transaction's snapshot is taken, and kept
        with psycopg.connect(db_url, autocommit=True) as other:
            for _ in range(5):
                other.execute("SELECT pg_current_xact_id()")
        time.sleep(1.1)
        transactions = _value(registry, "pgskip_xmin_horizon_age_transactions")
        seconds = _value(registry, "pgskip_xmin_horizon_age_seconds")
        assert transactions is not None and transactions >= 5
        assert seconds is not None and seconds >= 1.0
        holder.rollback()


def test_ring_blocked_seconds_grow_while_a_transaction_holds_the_slots(
    db_url: str, collector: PgSkipCollector
) -> None:
    """A READ COMMITTED transaction left open after reading jobs holds no snapshot (the xmin
    horizon's age stays 0) but holds every slot's lock: rotations are refused until it ends."""
    registry = _registry(collector)
    store = Store(db_url)
    try:
        finished_slot_behind(store, db_url)
        assert _value(registry, "pgskip_jobs_ring_blocked_seconds") == 0
        with psycopg.connect(db_url) as shell:
            shell.execute("SELECT count(*) FROM pgskip.jobs")
            assert store.rotate() == (0, 0, 2)  # slot 1's lock refused
            time.sleep(1.1)
            blocked = _value(registry, "pgskip_jobs_ring_blocked_seconds")
            assert blocked is not None and blocked >= 1.0
            assert _value(registry, "pgskip_xmin_horizon_age_seconds") == 0
        assert store.rotate() == (1, 0, 2)
        assert _value(registry, "pgskip_jobs_ring_blocked_seconds") == 0
    finally:
        store.close()


def test_counts_read_only_the_partial_indexes_not_the_completed_rows(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        _insert(conn, "q", "completed", 20_000)
        for status in ("pending", "scheduled", "running", "failed"):
            _insert(conn, "q", status, 3)
        conn.execute("ANALYZE pgskip.jobs")
        plan = conn.execute(
            psycopg.sql.SQL("EXPLAIN (FORMAT JSON) {}").format(
                queries_in("metrics.sql", "pgskip")["queue_counts"]
            )
        ).fetchone()
    assert plan is not None
    scans: list[tuple[str, str | None]] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "jobs_1":  # the current slot, which holds the rows
            scans.append((node["Node Type"], node.get("Index Name")))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0][0]["Plan"])
    assert len(scans) == 4, scans
    assert all(kind != "Seq Scan" for kind, _ in scans), scans
    assert {index for _, index in scans} <= {
        "jobs_dequeue_1", "jobs_scheduled_1", "jobs_running_rows_1", "jobs_failed_1", None,
    }, scans  # fmt: skip


def test_a_scrape_that_cannot_read_the_database_reports_up_0_and_says_why(
    empty_db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    collector = PgSkipCollector(empty_db_url)
    try:
        registry = _registry(collector)
        assert _value(registry, "pgskip_up") == 0.0
        assert _value(registry, "pgskip_pending_messages", queue="celery") is None
        assert collector.last_error is not None
        assert "pgskip migrate" in collector.last_error
        assert "scrape failed" in caplog.text
    finally:
        collector.close()


def test_a_scrape_waits_no_longer_than_its_timeout(db_url: str) -> None:
    collector = PgSkipCollector(db_url, timeout=0.5)
    try:
        registry = _registry(collector)
        assert _value(registry, "pgskip_up") == 1.0
        with psycopg.connect(db_url) as locker:
            locker.execute("LOCK TABLE pgskip.jobs IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            assert _value(registry, "pgskip_up") == 0.0
            assert time.monotonic() - started < 3
            assert collector.last_error is not None and "longer than 0.5s" in collector.last_error
            locker.rollback()
        assert _value(registry, "pgskip_up") == 1.0
        assert collector.last_error is None
    finally:
        collector.close()


def test_pg_cron_jobs_last_status(db_url: str, pg_cron_database: str) -> None:
    dbname = db_url.rsplit("/", 1)[1]
    prefix = f"pgskip:{dbname}:pgskip:"
    cron_url = make_url(db_url, pg_cron_database)
    with psycopg.connect(cron_url, autocommit=True) as conn:
        ids = {}
        for what in ("sweep", "prune"):
            row = conn.execute(
                "SELECT cron.schedule_in_database(%s, '0 0 1 1 *', 'SELECT 1', %s)",
                (prefix + what, dbname),
            ).fetchone()
            assert row is not None
            ids[what] = int(row[0])
        try:
            conn.execute("SELECT cron.alter_job(%s, active := false)", (ids["prune"],))
            for what, status in (("sweep", "failed"), ("sweep", "succeeded"), ("prune", "failed")):
                conn.execute(
                    "INSERT INTO cron.job_run_details (jobid, runid, command, status,"
                    " return_message, start_time, end_time)"
                    " VALUES (%s, nextval('cron.runid_seq'), 'SELECT 1', %s, 'x',"
                    " now() - interval '1 minute', now() - interval '1 minute')",
                    (ids[what], status),
                )
            collector = PgSkipCollector(db_url)
            try:
                registry = _registry(collector)
                assert _value(registry, "pgskip_cron_job_active", cron_job="sweep") == 1
                assert _value(registry, "pgskip_cron_job_active", cron_job="prune") == 0
                assert _value(registry, "pgskip_cron_job_last_run_succeeded", cron_job="sweep") == 1
                assert _value(registry, "pgskip_cron_job_last_run_succeeded", cron_job="prune") == 0
                ended = _value(
                    registry, "pgskip_cron_job_last_run_timestamp_seconds", cron_job="sweep"
                )
                assert ended is not None and abs(time.time() - 60 - ended) < 30
                assert _sample_names(registry) <= exposed_names()
            finally:
                collector.close()
        finally:
            conn.execute(
                "DELETE FROM cron.job_run_details WHERE jobid = ANY(%s)", (list(ids.values()),)
            )
            for jobid in ids.values():
                conn.execute("SELECT cron.unschedule(%s::bigint)", (jobid,))


def test_no_pg_cron_metrics_where_pg_cron_is_not_found(db_url: str) -> None:
    # The test database itself has no pg_cron extension.
    collector = PgSkipCollector(db_url, cron_database=db_url.rsplit("/", 1)[1])
    try:
        registry = _registry(collector)
        assert _value(registry, "pgskip_up") == 1.0
        assert not {n for n in _sample_names(registry) if n.startswith("pgskip_cron_")}
    finally:
        collector.close()


def test_without_prometheus_client_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "kombu_pgskip.metrics", raising=False)
    result = CliRunner().invoke(
        main, ["metrics", "--url", "pgskip://nobody@127.0.0.1:1/none", "--port", "0"]
    )
    assert result.exit_code == 1, result.output
    assert 'pip install "kombu-pgskip[metrics]"' in result.stderr


_SERVING = re.compile(r"on (http://127\.0\.0\.1:\d+/metrics)")


def _serve(args: list[str], broker: str) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PGSKIP_URL", "PGSKIP_OWNER_URL")}
    env.update(PGSKIP_BROKER_URL=broker, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        args,
        cwd=REPO_ROOT / "tests" / "apps",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = _SERVING.search(line)
    if match is None:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"no address announced: {line!r}; stderr: {err}")
    return proc, match.group(1)


def _scrape(address: str) -> dict[str, list[Any]]:
    with urllib.request.urlopen(address, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err


@pytest.mark.parametrize("how", ["python -m", "celery -A"])
def test_the_metrics_command_serves_them_over_http(db_url: str, how: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        _insert(conn, "default", "pending", 4)
        _insert(conn, "default", "failed")
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    common = ["metrics", "--port", "0", "--addr", "127.0.0.1"]
    if how == "python -m":
        args = [sys.executable, "-m", "kombu_pgskip", *common, "--url", db_url]
    else:
        args = [sys.executable, "-m", "celery", "-A", "taskapp", "pgskip", *common]
    proc, address = _serve(args, broker)
    try:
        families = _scrape(address)
        pending = {s.labels["queue"]: s.value for s in families["pgskip_pending_messages"]}
        assert pending == {"default": 4}
        failed = {s.labels["queue"]: s.value for s in families["pgskip_failed_messages"]}
        assert failed == {"default": 1}
        assert [s.value for s in families["pgskip_up"]] == [1.0]
        for name in (
            "pgskip_oldest_pending_age_seconds",
            "pgskip_consumers_alive",
            "pgskip_xmin_horizon_age_transactions",
            "pgskip_jobs_table_size_bytes",
            "pgskip_jobs_dead_tuples",
        ):
            assert name in families, name
        samples = {s.name for samples in families.values() for s in samples}
        assert {n for n in samples if n.startswith("pgskip_")} <= exposed_names()
    finally:
        _stop(proc)
