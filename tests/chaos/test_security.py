"""Security: what a publisher controls reaches SQL and pg_cron only as bound values or quoted
literals; the least-privilege roles of docs/security.md work, and hold; no password leaks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from psycopg import errors as pg_errors
from psycopg import sql

from kombu_pgskip import DuplicateTask, apply_async_in, exceptions
from kombu_pgskip.migrate import migrate
from kombu_pgskip.periodic import beat_sync
from tests.conftest import PgServer
from tests.helpers import REPO_ROOT, make_url
from tests.periodic_support import fire, fired_slots, jobs, make_app
from tests.safety_support import (
    APPS_DIR,
    Role,
    broker,
    count_jobs,
    create_runs_table,
    login_role,
    require_passwords,
    rows,
    safety_app,
    safety_worker,
    scalar,
    wait_for_runs,
)

EVIL = [
    "x'); DROP TABLE pgskip.jobs; --",
    "$$; DROP TABLE pgskip.jobs; $$",
    '"; DROP TABLE "pgskip"."jobs"; --',
    "\\'; DROP TABLE pgskip.jobs; --\\",
    "%(queue)s %s {schema} {} $1 :name",
    "ü🚀 ' \" ; -- é",
]
TABLES = (
    "jobs",
    "queues",
    "exchanges",
    "bindings",
    "consumers",
    "migrations",
    "beat_entries",
)


def assert_tables_intact(db_url: str) -> None:
    for table in TABLES:
        assert scalar(db_url, "SELECT to_regclass(%s) IS NOT NULL", (f"pgskip.{table}",)), table


@pytest.mark.parametrize("evil", EVIL)
def test_publisher_values_are_bound_through_declare_bind_publish_and_consume(
    db_url: str, evil: str
) -> None:
    with Connection(broker(db_url)) as conn:
        for kind in ("direct", "topic", "fanout"):
            exchange = Exchange(f"{evil}.{kind}", type=kind)
            queue = Queue(f"{evil}.{kind}", exchange, routing_key=evil)
            queue(conn.channel()).declare()
            Producer(conn.channel()).publish(
                {evil: [evil]}, exchange=exchange, routing_key=evil, headers={evil: evil}
            )
            message = queue(conn.channel()).get(no_ack=False)
            assert message is not None, kind
            assert message.payload == {evil: [evil]} and message.headers[evil] == evil
            assert message.delivery_info["routing_key"] == evil
            message.ack()
        assert set(scalar(db_url, "SELECT array_agg(name) FROM pgskip.exchanges")) >= {
            f"{evil}.{k}" for k in ("direct", "topic", "fanout")
        }
    assert_tables_intact(db_url)
    assert scalar(db_url, "SELECT count(*) FROM pgskip.jobs WHERE status = 'completed'") == 3


def test_apply_async_in_binds_task_name_queue_args_and_headers(db_url: str) -> None:
    app = safety_app(broker(db_url))
    with psycopg.connect(db_url) as conn, conn.transaction():
        for evil in EVIL:
            apply_async_in(
                conn,
                app.signature(evil, args=(evil,), kwargs={evil: evil}),
                queue=evil,
                headers={"x-evil": evil},
            )
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT queue, task_name, payload FROM pgskip.jobs ORDER BY id"
        ).fetchall()
    assert [(r[0], r[1]) for r in rows] == [(e, e) for e in EVIL]
    for (_, _, payload), evil in zip(rows, EVIL, strict=True):
        assert payload["headers"]["task"] == evil and payload["headers"]["x-evil"] == evil
    assert_tables_intact(db_url)


@pytest.mark.parametrize("where", ["args", "headers", "task name"])
def test_nul_characters_are_refused_before_anything_is_written(db_url: str, where: str) -> None:
    app = safety_app(broker(db_url))
    nul = "a\x00b"
    by_place: dict[str, dict[str, Any]] = {
        "args": {"args": (nul,)},
        "headers": {"headers": {"h": nul}},
        "task name": {},
    }
    options = by_place[where]
    name = nul if where == "task name" else "safetyapp.noop"
    with pytest.raises(exceptions.ConfigurationError, match="NUL character"):
        app.send_task(name, **options)
    with psycopg.connect(db_url) as conn, pytest.raises(exceptions.ConfigurationError):
        apply_async_in(conn, app.signature(name, **options))
    assert count_jobs(db_url) == 0


def test_beat_sync_entry_names_and_args_never_reach_the_pg_cron_command(
    db_url: str, pg_cron_database: str
) -> None:
    schedule = {
        evil: {"task": "periodic_tests.add", "schedule": 60, "args": (evil, evil)} for evil in EVIL
    }
    app = make_app(schedule)
    cron_url = make_url(db_url, pg_cron_database)
    dbname = db_url.rsplit("/", 1)[1]
    try:
        result = beat_sync(app, db_url, "pgskip")
        assert {c.name for c in result.changes} == set(EVIL)
        with psycopg.connect(cron_url) as conn:
            commands = conn.execute(
                "SELECT command FROM cron.job WHERE starts_with(jobname, %s)",
                (f"pgskip:{dbname}:pgskip:",),
            ).fetchall()
        assert commands and all(evil not in c[0] for c in commands for evil in EVIL)
        assert ('SELECT "pgskip".fire_due()',) in commands
        fired = fire(db_url, datetime.now(timezone.utc) + timedelta(minutes=2))
        assert fired >= len(EVIL)
        bodies = {tuple(j["body"][0]) for j in jobs(db_url)}
        assert bodies == {(e, e) for e in EVIL}
        assert all(fired_slots(db_url, evil) for evil in EVIL)
    finally:
        with psycopg.connect(cron_url, autocommit=True) as conn:
            conn.execute(
                "SELECT cron.unschedule(jobid) FROM cron.job WHERE starts_with(jobname, %s)",
                (f"pgskip:{dbname}:",),
            )
    assert_tables_intact(db_url)


# -- least privilege ---------------------------------------------------------------------------


class Roles:
    def __init__(self, owner: Role, worker: Role, publisher: Role, db_url: str) -> None:
        self.owner, self.worker, self.publisher, self.db_url = owner, worker, publisher, db_url

    def url(self, role: Role) -> str:
        return role.url(self.db_url)


@pytest.fixture
def roles(pg_server: PgServer, empty_db_url: str) -> Iterator[Roles]:
    """An empty database, and owner, worker and publisher roles with real passwords.

    As docs/security.md: a superuser creates the roles and lets the owner create the schema;
    the owner migrates and grants. Nothing else is granted here.
    """
    require_passwords(pg_server)
    dbname = empty_db_url.rsplit("/", 1)[1]
    dbs = (dbname,)
    with (
        login_role(pg_server.dsn, f"owner_{uuid.uuid4().hex[:6]}", databases=dbs) as owner,
        login_role(pg_server.dsn, f"worker_{uuid.uuid4().hex[:6]}", databases=dbs) as worker,
        login_role(pg_server.dsn, f"pub_{uuid.uuid4().hex[:6]}", databases=dbs) as publisher,
    ):
        with psycopg.connect(empty_db_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                    sql.Identifier(dbname), sql.Identifier(owner.name)
                )
            )
            # PostgreSQL 15 no longer lets every role create in public; make sure of it.
            conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        migrate(owner.url(empty_db_url))
        create_runs_table(empty_db_url)
        yield Roles(owner, worker, publisher, empty_db_url)


def _grant_cli(roles: Roles, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PGSKIP_BROKER_URL": broker(roles.url(roles.worker)),
        "PGSKIP_OWNER_URL": roles.url(roles.owner),
        "PYTHONPATH": str(REPO_ROOT),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "safetyapp", "pgskip", "grant",
         "--worker", roles.worker.name, "--publisher", roles.publisher.name, *extra],
        cwd=APPS_DIR, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_least_privilege_roles_run_a_real_worker_and_hold(roles: Roles) -> None:
    db_url = roles.db_url
    dry = _grant_cli(roles, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    published = (
        '"queue", "priority", "status", "run_at", "payload", "task_name", "task_id", "expires_at", '
        '"unique_key", "concurrency_key", "slot"'
    )
    assert (
        f'GRANT INSERT ({published}) ON "pgskip"."jobs" TO "{roles.publisher.name}";' in dry.stdout
    )
    assert "nothing was granted" in dry.stdout
    # Nothing granted yet: the publisher is refused, with the pointer to the grants.
    with pytest.raises(exceptions.PermissionDenied, match="pgskip grant"):
        safety_app(broker(roles.url(roles.publisher))).send_task("safetyapp.noop")
    done = _grant_cli(roles)
    assert done.returncode == 0, done.stderr
    assert roles.owner.password not in done.stdout + done.stderr
    assert _grant_cli(roles).returncode == 0  # idempotent

    publisher_url = roles.url(roles.publisher)
    app = safety_app(broker(publisher_url))
    # Sweeps, lease renewals and the xmin-horizon check every second: all of the worker's
    # statements run as the worker role within the test.
    fast = {"PGSKIP_OPT_SWEEP_INTERVAL": "0.5", "PGSKIP_OPT_LEASE_SECONDS": "6",
            "PGSKIP_OPT_XMIN_HORIZON_WARNING": "1"}  # fmt: skip
    worker = safety_worker(
        broker(roles.url(roles.worker)), db_url, queues=["default"], extra_env=fast
    )
    with worker:
        app.send_task("safetyapp.record", args=["published"], queue="default")
        with psycopg.connect(publisher_url) as conn, conn.transaction():
            # countdown: stored 'scheduled', promoted by the worker role
            apply_async_in(conn, app.signature("safetyapp.record", args=["in my transaction"]),
                           queue="default", countdown=3)  # fmt: skip
        # A unique key, written and enforced as the publisher role.
        app.send_task(
            "safetyapp.record", args=["later"], queue="default", countdown=3600, pgskip_unique="k"
        )
        with pytest.raises(DuplicateTask):
            app.send_task("safetyapp.record", args=["again"], queue="default", pgskip_unique="k")
        wait_for_runs(db_url, 2)
        time.sleep(2.5)  # more heartbeats (every 2 s) and sweeps
        log = worker.log_text()
    assert "permission denied" not in log.lower() and "failed" not in log, log
    ran = {json.loads(a)[0] for (a,) in rows(db_url, "SELECT args FROM safety_runs")}
    assert ran == {"published", "in my transaction"}
    for role in (roles.owner, roles.worker, roles.publisher):
        assert role.password not in log

    # What the publisher may not do: read bodies, change or delete messages, purge, delete queues.
    with psycopg.connect(publisher_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(id) FROM pgskip.jobs").fetchone() == (3,)
        for forbidden in (
            "SELECT payload FROM pgskip.jobs",
            "SELECT unique_key FROM pgskip.jobs",
            "UPDATE pgskip.jobs SET unique_key = NULL",
            "SELECT last_error FROM pgskip.jobs",
            "UPDATE pgskip.jobs SET status = 'pending'",
            "DELETE FROM pgskip.jobs",
            "DELETE FROM pgskip.queues",
            "DELETE FROM pgskip.consumers",
            "INSERT INTO pgskip.consumers (id, hostname, pid, lease_until)"
            " VALUES (gen_random_uuid(), 'h', 1, now())",
            "SELECT * FROM pgskip.beat_entries",
            "CREATE TABLE pgskip.mine (x int)",
        ):
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(forbidden)
    with Connection(broker(publisher_url)) as conn, pytest.raises(exceptions.PermissionDenied):
        conn.default_channel.queue_purge("default")

    # What the worker may not do: change the schema, run migrations, touch periodic tasks.
    worker_url = roles.url(roles.worker)
    with psycopg.connect(worker_url, autocommit=True) as conn:
        for forbidden in (
            "CREATE TABLE pgskip.mine (x int)",
            "ALTER TABLE pgskip.jobs ADD COLUMN x int",
            "DROP TABLE pgskip.jobs",
            "INSERT INTO pgskip.migrations (version, name, checksum) VALUES (99, 'x', 'x')",
            "SELECT * FROM pgskip.beat_entries",
        ):
            with pytest.raises((pg_errors.InsufficientPrivilege, pg_errors.WrongObjectType)):
                conn.execute(forbidden)
    owner = psycopg.connect(roles.url(roles.owner), autocommit=True)
    with owner:
        # Pretend migration 0003 is new: the worker role must not be able to apply it.
        record = owner.execute("DELETE FROM pgskip.migrations WHERE version = 3 RETURNING *")
        saved = record.fetchone()
        try:
            with pytest.raises(exceptions.PermissionDenied, match="pgskip grant"):
                migrate(worker_url)
        finally:
            columns = ", ".join(["%s"] * len(saved))
            owner.execute(f"INSERT INTO pgskip.migrations VALUES ({columns})", saved)
    assert_tables_intact(db_url)


def test_no_password_in_reprs_logs_or_connect_errors(pg_server: PgServer, db_url: str) -> None:
    require_passwords(pg_server)
    dbname = db_url.rsplit("/", 1)[1]
    with login_role(pg_server.dsn, databases=(dbname,)) as role:
        from kombu_pgskip.grants import apply_grants, grant_statements

        apply_grants(db_url, grant_statements(dbname, "pgskip", workers=[role.name], publishers=[]))
        url = broker(role.url(db_url))
        with Connection(url) as conn:
            channel = conn.channel()
            # (kombu's Connection.info() returns the credentials by design: not a repr.)
            texts = [repr(conn), repr(conn.transport), repr(channel), conn.as_uri(),
                     repr(channel.store), repr(channel.consumer_store)]  # fmt: skip
        assert all(role.password not in t for t in texts), texts
        wrong = url.replace(role.password, "Wr0ng-" + role.password)
        with pytest.raises(exceptions.ConnectionFailed) as info, Connection(wrong) as conn:
            conn.connect()
        assert role.password not in str(info.value) and "Wr0ng" not in str(info.value)
        worker = safety_worker(wrong, db_url, queues=["default"])
        worker.start(wait_ready=False)
        try:
            worker.wait_for_log(r"password authentication failed", timeout=30)
        finally:
            worker.kill9()
        log = worker.log_text()
        worker.remove_log()
        assert role.password not in log, log
