"""A hostile publisher or worker cannot destroy messages, change a queue's arguments, or run code
as another role (docs/security.md, "What each role can do").

Every test sets up what most deploys have: a superuser creates the roles and a database, the
owner migrates and runs `pgskip grant --worker W --publisher P`, and the app roles may create
objects in ``public`` (the role that runs Django or Alembic migrations). Then the publisher or
the worker, logged in with its password, tries what the owner must not let it do, and the test
asserts that the messages waiting in ``celery``, the messages a live consumer holds and that
consumer's lease are exactly as before. Each test runs on the oldest and the newest PostgreSQL
the suite can start (``any_pg_server``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from psycopg import errors as pg_errors
from psycopg import sql

from kombu_pgskip import exceptions
from kombu_pgskip.doctor import run_doctor
from kombu_pgskip.grants import (
    PUBLISHER_FUNCTIONS,
    WORKER_FUNCTIONS,
    Grant,
    apply_grants,
    grant_statements,
)
from kombu_pgskip.maintenance import MaintenanceConfig, run_once
from kombu_pgskip.migrate import load_migrations, migrate
from kombu_pgskip.periodic import fire_due
from kombu_pgskip.queue_args import set_queue_arguments
from kombu_pgskip.store import NewMessage, Store
from tests.conftest import PgServer
from tests.helpers import REPO_ROOT, running_orphans
from tests.periodic_support import make_app
from tests.safety_support import (
    Role,
    broker,
    create_runs_table,
    login_role,
    require_passwords,
    rows,
    safety_app,
    safety_worker,
    scalar,
    wait_for_runs,
)

pytestmark = pytest.mark.chaos

SENTINEL_MESSAGES = 50
SENTINEL_HELD = 5


@dataclass
class Deployment:
    """A migrated database, its three roles, and the messages and lease the tests guard."""

    db_url: str  # a superuser's
    owner: Role
    worker: Role
    publisher: Role
    consumer: uuid.UUID  # the live consumer holding SENTINEL_HELD messages of ``celery``

    def url(self, role: Role | str) -> str:
        return self.role(role).url(self.db_url)

    def role(self, role: Role | str) -> Role:
        return role if isinstance(role, Role) else getattr(self, role)

    def snapshot(self) -> dict[str, Any]:
        """What no role but the owner may change: the sentinel messages, the consumer's lease
        and the rows ``celery``'s routing and expiry depend on."""
        return {
            "jobs": rows(
                self.db_url,
                "SELECT id, status, locked_by, attempts, run_at, expires_at, priority,"
                " payload::text FROM pgskip.jobs WHERE queue = 'celery' ORDER BY id",
            ),
            "consumer": rows(
                self.db_url,
                "SELECT id, lease_until, queues FROM pgskip.consumers"
                f" WHERE id = '{self.consumer}'",
            ),
            "queue": rows(
                self.db_url,
                "SELECT durable, auto_delete, arguments::text, max_priority, message_ttl, expires"
                " FROM pgskip.queues WHERE name = 'celery'",
            ),
            "exchange": rows(self.db_url, "SELECT * FROM pgskip.exchanges WHERE name = 'celery'"),
            "bindings": rows(
                self.db_url, "SELECT * FROM pgskip.bindings WHERE queue = 'celery' ORDER BY 1, 3"
            ),
        }


def _superuser(db_url: str, *statements: str | sql.Composable) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@contextmanager
def _deployment(
    server: PgServer, db_url: str, *, app_roles_create_in_public: bool
) -> Iterator[Deployment]:
    require_passwords(server)
    dbname = db_url.rsplit("/", 1)[1]
    dbs = (dbname,)
    tag = uuid.uuid4().hex[:6]
    with (
        login_role(server.dsn, f"owner_{tag}", databases=dbs) as owner,
        login_role(server.dsn, f"worker_{tag}", databases=dbs) as worker,
        login_role(server.dsn, f"publisher_{tag}", databases=dbs) as publisher,
    ):
        _superuser(
            db_url,
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(dbname), sql.Identifier(owner.name)
            ),
            "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
            # What a shadowing function logs: every role may write it, none may be hidden.
            "CREATE TABLE public.pwned (role text NOT NULL, what text NOT NULL)",
            "GRANT SELECT, INSERT ON public.pwned TO PUBLIC",
        )
        if app_roles_create_in_public:
            _superuser(
                db_url,
                sql.SQL("GRANT CREATE ON SCHEMA public TO {}, {}").format(
                    sql.Identifier(worker.name), sql.Identifier(publisher.name)
                ),
            )
        owner_url = owner.url(db_url)
        migrate(owner_url)
        apply_grants(
            owner_url,
            grant_statements(dbname, "pgskip", workers=[worker.name], publishers=[publisher.name]),
        )
        # The sentinels: 50 messages published to `celery` (declared as Celery does), 5 of
        # them held by a live consumer with an hour's lease.
        with Connection(broker(publisher.url(db_url))) as conn:
            producer = Producer(conn.channel())
            queue = Queue("celery", Exchange("celery", "direct"), routing_key="celery")
            queue(conn.default_channel).declare()
            for i in range(SENTINEL_MESSAGES):
                producer.publish({"i": i}, exchange="celery", routing_key="celery")
        consumer = uuid.uuid4()
        store = Store(broker(worker.url(db_url)))
        try:
            store.register_consumer(consumer, hostname="sentinel", queues=["celery"], lease=3600)
            assert len(store.fetch(["celery"], SENTINEL_HELD, consumer)) == SENTINEL_HELD
        finally:
            store.close()
        yield Deployment(db_url, owner, worker, publisher, consumer)


@pytest.fixture
def hostile(any_pg_server: PgServer, versioned_empty_db_url: str) -> Iterator[Deployment]:
    """A deployment whose worker and publisher roles may create objects in ``public``."""
    with _deployment(any_pg_server, versioned_empty_db_url, app_roles_create_in_public=True) as d:
        yield d


@pytest.fixture
def tidy(any_pg_server: PgServer, versioned_empty_db_url: str) -> Iterator[Deployment]:
    """A deployment as docs/security.md sets one up: nobody but superusers creates in public."""
    with _deployment(any_pg_server, versioned_empty_db_url, app_roles_create_in_public=False) as d:
        yield d


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kombu_pgskip <args> --url url``."""
    return subprocess.run(
        [sys.executable, "-m", "kombu_pgskip", *args, "--url", url],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _denied(conn: psycopg.Connection[Any], statement: str) -> None:
    with pytest.raises(pg_errors.InsufficientPrivilege), conn.transaction():
        conn.execute(statement)


ATTACKERS = ["publisher", "worker"]
#: The schema's trigger functions: each one is attached below, as an attacker would, to tables
#: of the attacker's own.
TRIGGER_FUNCTIONS: set[str] = {"claim_unique_key()"}


# -- 1. declarations ------------------------------------------------------------------------------


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_a_redeclaration_or_an_update_changes_no_queue_argument(
    hostile: Deployment, attacker: str
) -> None:
    before = hostile.snapshot()
    with Connection(broker(hostile.url(attacker))) as conn:
        for redeclared in (
            Queue("celery", expires=0.001),
            Queue("celery", message_ttl=0.001),
            Queue("celery", max_priority=1),
            Queue("celery", auto_delete=True),
        ):
            with pytest.raises(exceptions.PreconditionFailed, match="PRECONDITION_FAILED"):
                redeclared(conn.channel()).declare()
        with pytest.raises(exceptions.PreconditionFailed, match="type 'direct'"):
            Exchange("celery", "fanout")(conn.channel()).declare()
    with psycopg.connect(hostile.url(attacker), autocommit=True) as conn:
        for statement in (
            "UPDATE pgskip.queues SET expires = 1 WHERE name = 'celery'",
            "UPDATE pgskip.queues SET message_ttl = 1 WHERE name = 'celery'",
            "UPDATE pgskip.queues SET max_priority = 0 WHERE name = 'celery'",
            "UPDATE pgskip.queues SET auto_delete = true WHERE name = 'celery'",
            """UPDATE pgskip.queues SET arguments = '{"x-expires": 1}' WHERE name = 'celery'""",
            "INSERT INTO pgskip.queues (name, expires) VALUES ('celery', 1)"
            " ON CONFLICT (name) DO UPDATE SET expires = 1",
            "UPDATE pgskip.exchanges SET type = 'fanout' WHERE name = 'celery'",
            "UPDATE pgskip.bindings SET queue = 'elsewhere' WHERE queue = 'celery'",
        ):
            _denied(conn, statement)
    time.sleep(0.01)
    # Every way the queue could go: expiry, the sweep, the maintenance tick, as the owner.
    run_once(hostile.url("owner"), "pgskip", MaintenanceConfig())
    with psycopg.connect(hostile.url("owner"), autocommit=True) as conn:
        assert conn.execute("SELECT * FROM pgskip.expire_queues()").fetchone() == (0, 0)
    assert hostile.snapshot() == before


def test_a_publisher_inserts_only_the_columns_a_publish_writes(hostile: Deployment) -> None:
    before = hostile.snapshot()
    with psycopg.connect(hostile.url("publisher"), autocommit=True) as conn:
        for statement in (
            # a message that looks held by the live consumer, or already tried
            "INSERT INTO pgskip.jobs (queue, payload, status, locked_by)"
            f" VALUES ('celery', '{{}}', 'running', '{hostile.consumer}')",
            "INSERT INTO pgskip.jobs (queue, payload, attempts) VALUES ('celery', '{}', 99)",
            "INSERT INTO pgskip.jobs (queue, payload, finished_at) VALUES ('celery', '{}', now())",
            "INSERT INTO pgskip.queues (name, last_used_at) VALUES ('q', now() - interval '1 day')",
        ):
            _denied(conn, statement)
    assert hostile.snapshot() == before


# -- 2. functions --------------------------------------------------------------------------------


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_no_function_of_the_schema_runs_for_a_role_it_is_not_granted_to(
    hostile: Deployment, attacker: str
) -> None:
    before = hostile.snapshot()
    owner = psycopg.connect(hostile.url("owner"), autocommit=True)
    with owner:
        routines = owner.execute(
            "SELECT p.oid::regprocedure::text, p.proname::text, p.prokind::text,"
            " p.prorettype = 'trigger'::regtype FROM pg_proc AS p"
            " WHERE p.pronamespace = 'pgskip'::regnamespace"
        ).fetchall()
    granted = WORKER_FUNCTIONS if attacker == "worker" else PUBLISHER_FUNCTIONS
    allowed = {f.split("(")[0] for f in granted}
    triggers = [r[0] for r in routines if r[3]]
    assert {t.split(".")[-1] for t in triggers} == TRIGGER_FUNCTIONS
    with psycopg.connect(hostile.url(attacker), autocommit=True) as conn:
        for signature, name, _kind, _trigger in routines:
            may = conn.execute(
                "SELECT has_function_privilege(%s::regprocedure, 'EXECUTE')", (signature,)
            ).fetchone()
            assert may == ((name in allowed),), signature
        # A trigger of the attacker's own table, temporary or in public, on every event.
        conn.execute("CREATE TEMP TABLE t (x int)")
        conn.execute("CREATE TABLE public.mine (x int)")
        for table in ("t", "public.mine"):
            for event in ("INSERT", "UPDATE", "DELETE", "TRUNCATE"):
                level = "STATEMENT" if event == "TRUNCATE" else "ROW"
                for function in triggers:
                    _denied(
                        conn,
                        f"CREATE TRIGGER x AFTER {event} ON {table}"
                        f" FOR EACH {level} EXECUTE FUNCTION {function}",
                    )
        # Calls, as pg_cron makes them for the owner.
        for call in (
            "SELECT pgskip.fire_due()",
            "SELECT * FROM pgskip.prune('0 seconds', '0 seconds')",
            "SELECT pgskip.prune_completed_batch(now(), 1000)",
            "CALL pgskip.prune_in_batches('0 seconds', '0 seconds', 1)",
        ):
            _denied(conn, call)
        if attacker == "publisher":
            _denied(conn, "SELECT * FROM pgskip.expire_queues()")
            _denied(conn, "SELECT pgskip.sweep(1)")
        else:
            # The worker's own maintenance, with the worker's rights: the live consumer's rows
            # stay its own, whatever max_attempts.
            conn.execute("SELECT pgskip.sweep(1)")
    assert hostile.snapshot() == before


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_no_role_but_the_owner_reads_or_writes_the_unique_key_claims(
    hostile: Deployment, attacker: str
) -> None:
    """The claims of unique keys (``unique_keys``) are the owner's: the attacker can neither read
    nor change them, nor call the function that writes them, nor turn its trigger off, nor make
    a table of its own stand in for one the function uses; the keys it publishes are claimed in
    the schema's table, and a key another message holds stays that message's alone."""
    owner = Store(broker(hostile.url("owner")))
    try:
        held = owner.publish(NewMessage("keys", 0, "pending", None, "{}", "t", "1", None, "held"))
        other = owner.publish(NewMessage("keys", 0, "pending", None, "{}", "t", "2", None))
    finally:
        owner.close()
    assert held is not None and other is not None
    claims = "SELECT queue, unique_key, job_id FROM pgskip.unique_keys ORDER BY 1, 2"
    before = hostile.snapshot()
    with psycopg.connect(hostile.url(attacker), autocommit=True) as conn:
        for statement in (
            "SELECT * FROM pgskip.unique_keys",
            "SELECT count(*) FROM pgskip.unique_keys",
            "INSERT INTO pgskip.unique_keys VALUES ('keys', 'mine', 1)",
            "UPDATE pgskip.unique_keys SET job_id = 0",
            "DELETE FROM pgskip.unique_keys",
            "TRUNCATE pgskip.unique_keys",
            "LOCK TABLE pgskip.unique_keys",
            "SELECT pgskip.claim_unique_key()",
            "SELECT pgskip.prune_unique_keys(NULL)",
            "ALTER TABLE pgskip.jobs DISABLE TRIGGER jobs_claim_unique_key",
            "ALTER TABLE pgskip.jobs DISABLE TRIGGER ALL",
            "DROP TRIGGER jobs_reclaim_unique_key ON pgskip.jobs",
            "ALTER FUNCTION pgskip.claim_unique_key() SECURITY INVOKER",
            # Triggers do not fire for a replica's session: a superuser's setting.
            "SET session_replication_role = replica",
        ):
            _denied(conn, statement)
        # Tables of its own in front of the schema's, where a careless path would find them.
        conn.execute("CREATE TEMP TABLE unique_keys (queue text, unique_key text, job_id bigint)")
        conn.execute("CREATE TEMP TABLE jobs (id bigint, queue text, unique_key text, status text)")
        conn.execute("SET search_path TO pg_temp, public, pg_catalog")
        publish = (
            "INSERT INTO pgskip.jobs (queue, payload, unique_key) VALUES ('keys', '{}', %s)"
            " RETURNING id"
        )
        assert conn.execute(publish, ("held",)).fetchall() == [], "the key is held"
        mine = conn.execute(publish, ("mine",)).fetchall()
        assert len(mine) == 1
        assert conn.execute("SELECT count(*) FROM pg_temp.unique_keys").fetchone() == (0,)
        if attacker == "worker":
            # A worker may update messages: giving one a key another message holds leaves it
            # without one, and a key it holds cannot be taken over by retrying a copy.
            conn.execute(
                "UPDATE pgskip.jobs SET unique_key = 'held' WHERE id OPERATOR(pg_catalog.=) %s",
                (other,),
            )
            conn.execute(
                "UPDATE pgskip.jobs SET status = 'failed', unique_key = 'held'"
                " WHERE id OPERATOR(pg_catalog.=) %s",
                (other,),
            )
            conn.execute(
                "UPDATE pgskip.jobs SET status = 'pending' WHERE id OPERATOR(pg_catalog.=) %s",
                (other,),
            )
    keys = "SELECT id, status::text, unique_key FROM pgskip.jobs WHERE queue = 'keys' ORDER BY id"
    assert rows(hostile.db_url, keys) == [
        (held, "pending", "held"),
        (other, "pending", None),
        (mine[0][0], "pending", "mine"),
    ]
    assert rows(hostile.db_url, claims) == [("keys", "held", held), ("keys", "mine", mine[0][0])]
    assert hostile.snapshot() == before


# -- 3. shadowing built-ins -----------------------------------------------------------------------

#: (what, DDL creating it in public, a probe statement that calls it when public comes first).
#: Each function logs (current_user, what); run as any role but its creator, it tries to
#: complete every message and end every lease; it returns what the built-in would.
SHADOWS: list[tuple[str, str, str]] = []


def _shadow(what: str, signature: str, returns: str, result: str, probe: str) -> None:
    body = f"""
        BEGIN
            INSERT INTO public.pwned VALUES (pg_catalog.current_user(), '{what}');
            IF pg_catalog.current_user() OPERATOR(pg_catalog.<>) '{{attacker}}' THEN
                BEGIN
                    UPDATE pgskip.jobs SET status = 'completed', locked_by = NULL;
                    UPDATE pgskip.consumers SET lease_until = pg_catalog.now();
                EXCEPTION WHEN insufficient_privilege THEN NULL;
                END;
            END IF;
            {result}
        END"""
    ddl = f"CREATE FUNCTION public.{signature} RETURNS {returns} LANGUAGE plpgsql AS $f${body}$f$"
    SHADOWS.append((what, ddl, probe))


_shadow("nextval(text)", "nextval(s text)", "bigint",
        "RETURN pg_catalog.nextval(s::pg_catalog.regclass);",
        "SELECT nextval('public.probe_seq')")  # fmt: skip
_shadow("now()", "now()", "timestamptz", "RETURN pg_catalog.now();", "SELECT now()")
_shadow("unnest(text[])", "unnest(a text[])", "SETOF text",
        "RETURN QUERY SELECT pg_catalog.unnest(a);", "SELECT unnest(ARRAY['a'])")  # fmt: skip
_shadow("unnest(uuid[])", "unnest(a uuid[])", "SETOF uuid",
        "RETURN QUERY SELECT pg_catalog.unnest(a);",
        "SELECT unnest(ARRAY[gen_random_uuid()])")  # fmt: skip
_shadow("unnest(bigint[])", "unnest(a bigint[])", "SETOF bigint",
        "RETURN QUERY SELECT pg_catalog.unnest(a);", "SELECT unnest(ARRAY[1::bigint])")  # fmt: skip
_shadow("unnest(smallint[])", "unnest(a smallint[])", "SETOF smallint",
        "RETURN QUERY SELECT pg_catalog.unnest(a);",
        "SELECT unnest(ARRAY[1::smallint])")  # fmt: skip
_shadow("jsonb_build_object(text,text)", "jsonb_build_object(k text, v text)", "jsonb",
        "RETURN pg_catalog.jsonb_build_object(k, v);",
        "SELECT jsonb_build_object('a'::text, 'b'::text)")  # fmt: skip
_shadow("to_jsonb(text)", "to_jsonb(v text)", "jsonb", "RETURN pg_catalog.to_jsonb(v);",
        "SELECT to_jsonb('a'::text)")  # fmt: skip
_shadow("make_interval(secs numeric)", "make_interval(secs numeric)", "interval",
        "RETURN pg_catalog.make_interval(secs => secs::float8);",
        "SELECT make_interval(secs => 1.5)")  # fmt: skip
_shadow("array_position(bigint[],bigint)", "array_position(a bigint[], v bigint)", "integer",
        "RETURN pg_catalog.array_position(a, v);",
        "SELECT array_position(ARRAY[1::bigint], 1::bigint)")  # fmt: skip
_shadow("pg_notify(text,text)", "pg_notify(c text, p text)", "void",
        "PERFORM pg_catalog.pg_notify(c, p);", "SELECT pg_notify('x', 'y')")  # fmt: skip
_shadow("hashtext(text)", "hashtext(t text)", "integer", "RETURN pg_catalog.hashtext(t);",
        "SELECT hashtext('a')")  # fmt: skip
_shadow("format(text,text)", "format(f text, a text)", "text",
        "RETURN pg_catalog.format(f, a);", "SELECT format('%s'::text, 'a'::text)")  # fmt: skip
_shadow("jsonb_set(jsonb,text[],jsonb)", "jsonb_set(j jsonb, p text[], v jsonb)", "jsonb",
        "RETURN pg_catalog.jsonb_set(j, p, v, true);",
        """SELECT jsonb_set('{}'::jsonb, '{a}'::text[], '1'::jsonb)""")  # fmt: skip

#: Operators: (what, function DDL, operator DDL, probe).
OPERATORS = [
    ("||(text,integer)", "concat_int(a text, b integer)", "text",
     "RETURN a OPERATOR(pg_catalog.||) b::text;", "||", "text", "integer",
     "SELECT 'a'::text || 1"),
    ("*(bigint,interval)", "mul_interval(a bigint, b interval)", "interval",
     "RETURN a::float8 OPERATOR(pg_catalog.*) b;", "*", "bigint", "interval",
     "SELECT 2::bigint * interval '1 second'"),
    ("/(bigint,numeric)", "div_numeric(a bigint, b numeric)", "numeric",
     "RETURN a::numeric OPERATOR(pg_catalog./) b;", "/", "bigint", "numeric",
     "SELECT 2::bigint / 1000.0"),
    ("=(text,text)", "eq_text(a text, b text)", "boolean",
     "RETURN a OPERATOR(pg_catalog.=) b;", "=", "text", "text", "SELECT 'a'::text = 'a'::text"),
    ("<=(timestamptz,timestamptz)", "le_ts(a timestamptz, b timestamptz)", "boolean",
     "RETURN a OPERATOR(pg_catalog.<=) b;", "<=", "timestamptz", "timestamptz",
     "SELECT now() <= now()"),
]  # fmt: skip
for _what, _sig, _ret, _result, _op, _left, _right, _probe in OPERATORS:
    _shadow(_what, _sig, _ret, _result, _probe)


def _plant_shadows(url: str, attacker: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for _what, ddl, _probe in SHADOWS:
            conn.execute(ddl.replace("{attacker}", attacker))
        for _what, sig, _ret, _result, op, left, right, _probe in OPERATORS:
            conn.execute(
                f"CREATE OPERATOR public.{op} (LEFTARG = {left}, RIGHTARG = {right},"
                f" FUNCTION = public.{sig.split('(')[0]})"
            )
        # An operator over the schema's own status type would beat pg_catalog's
        # =(anyenum, anyenum) in any session with public on its path: the type is not
        # usable by other roles, so it cannot be made.
        with pytest.raises(pg_errors.InsufficientPrivilege), conn.transaction():
            conn.execute(
                "CREATE FUNCTION public.eq_status(a pgskip.job_status, b pgskip.job_status)"
                " RETURNS boolean LANGUAGE sql AS 'SELECT true'"
            )


def _probes_call_every_shadow(url: str, role: str) -> None:
    """The shadows are real: a session that looks in public first runs every one of them."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE public.probe_seq")
        conn.execute("SET search_path TO public, pg_catalog")
        for _what, _ddl, probe in SHADOWS:
            conn.execute(probe)
        ran = {r[0] for r in conn.execute("SELECT DISTINCT what FROM public.pwned").fetchall()}
        who = {r[0] for r in conn.execute("SELECT DISTINCT role FROM public.pwned").fetchall()}
    assert ran == {what for what, _ddl, _probe in SHADOWS}
    assert who == {role}


def _who_ran_a_shadow(d: Deployment) -> set[str]:
    return {r[0] for r in rows(d.db_url, "SELECT DISTINCT role FROM public.pwned")}


def _owner_duties(d: Deployment) -> None:
    """What the owner runs: migrations (into a second schema, from nothing), periodic tasks,
    maintenance, grants, doctor, queue-args; and, as pg_cron would in a session of its own
    whose search path looks in public first, each scheduled call."""
    owner_url = d.url("owner")
    assert migrate(owner_url, schema="pgskip_again") == [m.label for m in load_migrations()]
    app = make_app(
        {
            "every minute": {
                "task": "periodic_tests.add",
                "schedule": 60,
                "args": (1, 2),
                "options": {"queue": "periodic"},
            }
        }
    )
    from kombu_pgskip.periodic import beat_sync

    beat_sync(app, owner_url, "pgskip", use_cron=False)
    fire_due(owner_url, "pgskip", lookahead=timedelta(minutes=2))
    run_once(owner_url, "pgskip", MaintenanceConfig())
    dbname = d.db_url.rsplit("/", 1)[1]
    apply_grants(
        owner_url,
        grant_statements(dbname, "pgskip", workers=[d.worker.name], publishers=[d.publisher.name]),
    )
    run_doctor(owner_url, "pgskip")
    with Connection(broker(owner_url)) as conn:
        Queue("owners", expires=3600)(conn.channel()).declare()
    set_queue_arguments(owner_url, "pgskip", "owners", set={"x-expires": 7_200_000})
    with psycopg.connect(owner_url, autocommit=True) as conn:
        conn.execute("SET search_path TO public, pg_catalog")
        conn.execute("SELECT pgskip.fire_due()")
        conn.execute("SELECT * FROM pgskip.sweep(20)")
        conn.execute("SELECT * FROM pgskip.expire_queues()")
        conn.execute("CALL pgskip.prune_in_batches('0 seconds', '0 seconds', 1)")
        conn.execute("SELECT * FROM pgskip.prune('0 seconds', '0 seconds')")


def _publisher_duties(d: Deployment) -> None:
    """A publishing process: declares (queues, exchanges, bindings: the routing epoch's
    trigger runs as the owner), publishes plain, routed, topic, scheduled and many."""
    with Connection(broker(d.url("publisher"))) as conn:
        channel = conn.channel()
        direct = Exchange("orders", "direct")
        topic = Exchange("events", "topic")
        Queue("orders", direct, routing_key="orders", expires=3600)(channel).declare()
        Queue("audit", topic, routing_key="order.#")(channel).declare()
        producer = Producer(channel)
        producer.publish({"n": 1}, exchange=direct, routing_key="orders")
        producer.publish({"n": 2}, exchange=topic, routing_key="order.created")
        producer.publish({"n": 3}, exchange=direct, routing_key="orders", expiration=60)
        producer.publish({"n": 4}, routing_key="orders", headers={"eta": "2100-01-01T00:00:00"})
        store = channel.store
        message = NewMessage("orders", 0, "pending", None, "{}", None, None, 1000)
        store.publish_many([message, message.to("audit")])
        app = safety_app(broker(d.url("publisher")))
        app.send_task("safetyapp.noop", queue="later", countdown=3600)
    # A message with a unique key, twice, from a session that looks in public first: the
    # trigger that claims the key runs as the owner, with the schema's own path.
    with psycopg.connect(d.url("publisher"), autocommit=True) as conn:
        conn.execute("SET search_path TO public, pg_catalog")
        for written in (1, 0):
            done = conn.execute(
                "INSERT INTO pgskip.jobs (queue, payload, unique_key)"
                " VALUES ('orders', '{}', 'duties') RETURNING id"
            )
            assert len(done.fetchall()) == written


def _worker_duties(d: Deployment) -> None:
    """A consuming process: registers, fetches, acks, requeues, fails, renews, sweeps,
    promotes, drops expired messages, expires queues, deletes an auto_delete queue, leaves."""
    store = Store(broker(d.url("worker")))
    me = uuid.uuid4()
    try:
        store.declare_queue("work", auto_delete=True)
        message = NewMessage("work", 0, "pending", None, "{}", None, None, None)
        store.publish_many([message] * 6)
        store.register_consumer(me, hostname="w", queues=["work"], lease=60)
        rows_ = store.fetch(["work"], 3, me)
        store.ack([(rows_[0].id, rows_[0].attempts)], me)
        store.requeue([(rows_[1].id, rows_[1].attempts)], me, max_attempts=20)
        store.fail([(rows_[2].id, rows_[2].attempts)], me, "boom")
        store.ack_fetch([], ["work"], 2, me)
        store.renew_consumers([me], 60)
        store.sweep(max_attempts=20)
        store.promote_scheduled()
        store.drop_expired()
        store.expire_queues()
        store.size("work")
        store.queue_stats()
        store.delete_unused_queues(["work"], me)
        store.unregister_consumer(me)
    finally:
        store.close()
    with Connection(broker(d.url("worker"))) as conn:
        queue = Queue("orders", Exchange("orders", "direct"), routing_key="orders", expires=3600)
        got = queue(conn.channel()).get(no_ack=False)
        if got is not None:
            got.ack()
    # A message with a unique key fails and comes back with it (the claim runs as the owner
    # again), from a session that looks in public first: its own operators are pg_catalog's.
    with psycopg.connect(d.url("worker"), autocommit=True) as conn:
        conn.execute("SET search_path TO public, pg_catalog")
        keyed = conn.execute(
            "INSERT INTO pgskip.jobs (queue, payload, unique_key)"
            " VALUES ('orders', '{}', 'worker-duties') RETURNING id"
        ).fetchone()
        assert keyed is not None
        for status in ("failed", "pending"):
            conn.execute(
                "UPDATE pgskip.jobs SET status = %s WHERE id OPERATOR(pg_catalog.=) %s",
                (status, keyed[0]),
            )


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_built_ins_shadowed_in_public_run_for_no_other_role(
    hostile: Deployment, attacker: str
) -> None:
    before = hostile.snapshot()
    _plant_shadows(hostile.url(attacker), hostile.role(attacker).name)
    _probes_call_every_shadow(hostile.url(attacker), hostile.role(attacker).name)
    _superuser(hostile.db_url, "TRUNCATE public.pwned")

    _owner_duties(hostile)
    _publisher_duties(hostile)
    _worker_duties(hostile)

    assert _who_ran_a_shadow(hostile) <= {hostile.role(attacker).name}
    assert hostile.snapshot() == before


def test_a_real_worker_beside_a_publishers_shadows_runs_none_of_them(hostile: Deployment) -> None:
    before = hostile.snapshot()
    _plant_shadows(hostile.url("publisher"), hostile.publisher.name)
    create_runs_table(hostile.db_url)
    fast = {"PGSKIP_OPT_SWEEP_INTERVAL": "0.5", "PGSKIP_OPT_LEASE_SECONDS": "6"}
    worker = safety_worker(
        broker(hostile.url("worker")), hostile.db_url, queues=["default"], extra_env=fast
    )
    app = safety_app(broker(hostile.url("publisher")))
    with worker:
        for i in range(20):
            app.send_task("safetyapp.record", args=[i], queue="default")
        app.send_task("safetyapp.record", args=["later"], queue="default", countdown=3)
        wait_for_runs(hostile.db_url, 21)
        time.sleep(1.5)  # heartbeats, sweeps, promotions
        log = worker.log_text()
    assert "permission denied" not in log.lower(), log
    assert _who_ran_a_shadow(hostile) == set()
    assert hostile.snapshot() == before


# -- 4. an install from before migration 0012 ---------------------------------------------------


def _migrate_to(url: str, version: int) -> None:
    """Apply migrations up to ``version`` as the runner of their time did (search_path
    "pgskip, public")."""
    with psycopg.connect(url) as conn:
        conn.execute("CREATE SCHEMA pgskip")
        conn.execute(
            "CREATE TABLE pgskip.migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute("SET LOCAL search_path TO pgskip, public")
        for m in load_migrations():
            if m.version <= version:
                conn.execute(m.sql.encode())
                conn.execute(
                    "INSERT INTO pgskip.migrations VALUES (%s, %s, %s)",
                    (m.version, m.name, m.checksum),
                )


#: What `pgskip grant` gave before migration 0012.
OLD_WORKER_GRANTS = [
    "GRANT SELECT, INSERT, UPDATE, DELETE ON pgskip.jobs, pgskip.queues, pgskip.exchanges,"
    " pgskip.bindings, pgskip.consumers TO {r}",
    "GRANT SELECT ON pgskip.consumer_queues, pgskip.migrations, pgskip.routing_epoch TO {r}",
    "GRANT EXECUTE ON FUNCTION pgskip.expire_queues() TO {r}",
]
OLD_PUBLISHER_GRANTS = [
    "GRANT INSERT ON pgskip.jobs TO {r}",
    "GRANT SELECT (id, queue, status) ON pgskip.jobs TO {r}",
    "GRANT SELECT, INSERT, UPDATE ON pgskip.queues, pgskip.exchanges, pgskip.bindings TO {r}",
    "GRANT SELECT ON pgskip.consumers, pgskip.consumer_queues, pgskip.migrations,"
    " pgskip.routing_epoch TO {r}",
]


def test_migration_0012_closes_the_holes_of_an_older_install(
    any_pg_server: PgServer, versioned_empty_db_url: str
) -> None:
    require_passwords(any_pg_server)
    db_url = versioned_empty_db_url
    dbname = db_url.rsplit("/", 1)[1]
    with (
        login_role(any_pg_server.dsn, databases=(dbname,)) as worker,
        login_role(any_pg_server.dsn, databases=(dbname,)) as publisher,
    ):
        _superuser(
            db_url,
            "CREATE TABLE public.pwned (role text NOT NULL, what text NOT NULL)",
            "GRANT SELECT, INSERT ON public.pwned TO PUBLIC",
            sql.SQL("GRANT CREATE, USAGE ON SCHEMA public TO {}").format(
                sql.Identifier(publisher.name)
            ),
        )
        _migrate_to(db_url, 11)
        _superuser(
            db_url,
            sql.SQL("GRANT USAGE ON SCHEMA pgskip TO {}, {}").format(
                sql.Identifier(worker.name), sql.Identifier(publisher.name)
            ),
            *[g.format(r=worker.name) for g in OLD_WORKER_GRANTS],
            *[g.format(r=publisher.name) for g in OLD_PUBLISHER_GRANTS],
        )
        publisher_url = broker(publisher.url(db_url))
        nextval = next(ddl for what, ddl, _probe in SHADOWS if what == "nextval(text)")

        def attack() -> tuple[set[str], int]:
            """The publisher's two attacks: a shadow that the routing epoch's trigger calls as
            the owner, and that trigger function attached to a table of its own."""
            _superuser(db_url, "TRUNCATE public.pwned")
            with psycopg.connect(publisher.url(db_url), autocommit=True) as conn:
                conn.execute("DROP FUNCTION IF EXISTS public.nextval(text)")
                conn.execute(nextval.replace("{attacker}", publisher.name))
                conn.execute("CREATE TEMP TABLE t (x int)")
                emptied = 0
                try:
                    conn.execute(
                        "CREATE TRIGGER x AFTER TRUNCATE ON t FOR EACH STATEMENT"
                        " EXECUTE FUNCTION pgskip.sync_consumer_queues()"
                    )
                    conn.execute("TRUNCATE t")
                    emptied = 1
                except (pg_errors.InsufficientPrivilege, pg_errors.UndefinedFunction):
                    pass  # not executable by the publisher, or (migration 0014) gone
            # (check=False: this code refuses to run on a schema older than it needs)
            store = Store(publisher_url, check=False)
            try:
                store.declare_queue(f"q{uuid.uuid4().hex[:6]}")
            finally:
                store.close()
            return _who_ran_a_shadow_at(db_url), emptied

        # Before: the shadow ran as the superuser who migrated (the schema's owner here), and
        # the trigger function emptied consumer_queues for the publisher.
        who, emptied = attack()
        assert who == {"postgres"} and emptied == 1
        assert migrate(db_url) == [m.label for m in load_migrations() if m.version > 11]
        who, emptied = attack()
        assert who == set() and emptied == 0
        # The worker role keeps what it needs without a second `pgskip grant` (0015: sweep()).
        may = "SELECT has_function_privilege(%s, 'pgskip.sweep(integer)', 'EXECUTE')"
        assert rows(db_url, may % f"'{worker.name}'") == [(True,)]
        checks = run_doctor(db_url, "pgskip")
        failed = [c.line() for c in checks if not c.ok]
        # The publisher may still create in public, which is on the worker's default path.
        assert [c for c in failed if "default search_path" not in c] == [], failed


def _who_ran_a_shadow_at(db_url: str) -> set[str]:
    return {r[0] for r in rows(db_url, "SELECT DISTINCT role FROM public.pwned")}


# -- 5. pgskip doctor ------------------------------------------------------------------------------


def _doctor_cli(url: str) -> subprocess.CompletedProcess[str]:
    return _cli(url, "doctor", "--no-cron")


def test_doctor_passes_an_install_set_up_as_documented(tidy: Deployment) -> None:
    done = _doctor_cli(tidy.url("owner"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines and all(line.startswith("ok") for line in lines), done.stdout
    assert any(f"role {tidy.worker.name}: privileges of a worker" in x for x in lines)
    assert any(f"role {tidy.publisher.name}: privileges of a publisher" in x for x in lines)
    assert tidy.owner.password not in done.stdout + done.stderr


def _breakages(d: Deployment) -> list[tuple[set[str], list[str], list[str]]]:
    """(the checks that must fail, what breaks them, what mends them), as a superuser."""
    pub, wrk = d.publisher.name, d.worker.name
    roles = {f"role {pub}: privileges of a publisher", f"role {wrk}: privileges of a worker"}
    return [
        ({"routines not executable by PUBLIC", *roles},
         ["GRANT EXECUTE ON FUNCTION pgskip.fire_due(timestamptz, interval) TO PUBLIC"],
         ["REVOKE EXECUTE ON FUNCTION pgskip.fire_due(timestamptz, interval) FROM PUBLIC"]),
        ({"functions pin a safe search_path"},
         ["ALTER FUNCTION pgskip.sweep(integer) SET search_path = pgskip, public"],
         ["ALTER FUNCTION pgskip.sweep(integer) SET search_path = pgskip, pg_catalog, pg_temp"]),
        ({"functions pin a safe search_path"},
         ["ALTER FUNCTION pgskip.expire_queues() RESET search_path"],
         ["ALTER FUNCTION pgskip.expire_queues()"
          " SET search_path = pgskip, pg_catalog, pg_temp"]),
        ({"no SECURITY DEFINER function but claim_unique_key()"},
         ["ALTER FUNCTION pgskip.sweep(integer) SECURITY DEFINER"],
         ["ALTER FUNCTION pgskip.sweep(integer) SECURITY INVOKER"]),
        ({"types not usable by PUBLIC"},
         ["GRANT USAGE ON TYPE pgskip.job_status TO PUBLIC"],
         ["REVOKE USAGE ON TYPE pgskip.job_status FROM PUBLIC"]),
        ({"no other role creates in the schema"},
         [f'GRANT CREATE ON SCHEMA pgskip TO "{pub}"'],
         [f'REVOKE CREATE ON SCHEMA pgskip FROM "{pub}"']),
        ({"functions pin a safe search_path",
          "no other role creates in a schema on a function's search_path",
          f"role {wrk}: default search_path"},
         ["ALTER FUNCTION pgskip.sweep(integer) SET search_path = pgskip, public",
          f'GRANT CREATE ON SCHEMA public TO "{pub}"'],
         ["ALTER FUNCTION pgskip.sweep(integer) SET search_path = pgskip, pg_catalog, pg_temp",
          f'REVOKE CREATE ON SCHEMA public FROM "{pub}"']),
        ({f"role {wrk}: default search_path"},
         [f'GRANT CREATE ON SCHEMA public TO "{pub}"'],
         [f'REVOKE CREATE ON SCHEMA public FROM "{pub}"']),
        ({f"role {pub}: privileges of a publisher"},
         [f'GRANT UPDATE ON pgskip.jobs TO "{pub}"'],
         [f'REVOKE UPDATE ON pgskip.jobs FROM "{pub}"']),
        ({f"role {pub}: privileges of a publisher"},
         [f'GRANT SELECT (payload) ON pgskip.jobs TO "{pub}"'],
         [f'REVOKE SELECT (payload) ON pgskip.jobs FROM "{pub}"']),
        ({f"role {wrk}: privileges of a worker"},
         [f'GRANT UPDATE (expires) ON pgskip.queues TO "{wrk}"'],
         [f'REVOKE UPDATE (expires) ON pgskip.queues FROM "{wrk}"']),
        ({f"role {wrk}: privileges of a worker"},
         [f'GRANT TRIGGER ON pgskip.jobs TO "{wrk}"'],
         [f'REVOKE TRIGGER ON pgskip.jobs FROM "{wrk}"']),
        ({f"role {pub}: privileges of a publisher"},
         [f'GRANT SELECT ON pgskip.unique_keys TO "{pub}"'],
         [f'REVOKE SELECT ON pgskip.unique_keys FROM "{pub}"']),
        ({f"role {wrk}: privileges of a worker"},
         [f'GRANT EXECUTE ON FUNCTION pgskip.claim_unique_key() TO "{wrk}"'],
         [f'REVOKE EXECUTE ON FUNCTION pgskip.claim_unique_key() FROM "{wrk}"']),
        ({"no SECURITY DEFINER function but claim_unique_key()"},
         ["ALTER FUNCTION pgskip.prune_unique_keys(integer) SECURITY DEFINER"],
         ["ALTER FUNCTION pgskip.prune_unique_keys(integer) SECURITY INVOKER"]),
        ({"PUBLIC has no privilege on the schema", f"role {pub}: privileges of a publisher"},
         ["GRANT SELECT ON pgskip.jobs TO PUBLIC"],
         ["REVOKE SELECT ON pgskip.jobs FROM PUBLIC"]),
        ({"every object owned by the schema's owner", f"role {pub}: privileges of a publisher",
          "types not usable by PUBLIC"},  # a new table's row type is, by default
         ["CREATE TABLE pgskip.extra (x int)", f'ALTER TABLE pgskip.extra OWNER TO "{pub}"'],
         ["DROP TABLE pgskip.extra"]),
    ]  # fmt: skip


def test_doctor_names_each_way_a_role_could_get_more(tidy: Deployment) -> None:
    owner_url = tidy.url("owner")
    for expected, breaks, mends in _breakages(tidy):
        _superuser(tidy.db_url, *breaks)
        checks = run_doctor(owner_url, "pgskip")
        _superuser(tidy.db_url, *mends)
        failed = {c.name for c in checks if not c.ok}
        assert failed == expected, (breaks, [c.line() for c in checks if not c.ok])
    done = _doctor_cli(owner_url)
    assert done.returncode == 0, done.stdout
    _superuser(tidy.db_url, "GRANT EXECUTE ON FUNCTION pgskip.sweep(integer) TO PUBLIC")
    failed = _doctor_cli(owner_url)
    assert failed.returncode == 1
    assert "FAIL  routines not executable by PUBLIC: sweep(integer)" in failed.stdout
    assert re.search(r"\d+ of \d+ checks failed", failed.stderr), failed.stderr


def test_doctor_says_what_to_run_when_the_schema_is_missing(versioned_empty_db_url: str) -> None:
    done = _doctor_cli(versioned_empty_db_url)
    assert done.returncode == 1
    assert "not installed: run `celery -A proj pgskip migrate`" in done.stdout


# -- 6. queue-args --------------------------------------------------------------------------------


def test_only_the_owner_changes_a_queue_argument_deliberately(tidy: Deployment) -> None:
    owner_url = tidy.url("owner")
    for role in ("publisher", "worker"):
        with pytest.raises(exceptions.PermissionDenied, match="only the owner"):
            set_queue_arguments(tidy.url(role), "pgskip", "celery", set={"x-expires": 1})
    before, after = set_queue_arguments(owner_url, "pgskip", "celery", set={"x-expires": 60_000})
    assert (before, after) == ({}, {"x-expires": 60_000})
    assert scalar(tidy.db_url, "SELECT expires FROM pgskip.queues WHERE name = 'celery'") == 60_000
    # The declaration of every process now has to agree with it.
    with Connection(broker(tidy.url("publisher"))) as conn:
        with pytest.raises(exceptions.PreconditionFailed, match="x-expires=60000"):
            Queue("celery")(conn.channel()).declare()
        Queue("celery", expires=60)(conn.channel()).declare()
    for bad, message in (
        ({"x-expires": 0}, "x-expires must be at least 1"),
        ({"x-max-priority": 300}, "between 0 and 255"),
        ({"x-message-ttl": "soon"}, "whole number of milliseconds"),
    ):
        with pytest.raises(exceptions.ConfigurationError, match=message):
            set_queue_arguments(owner_url, "pgskip", "celery", set=bad)
    with pytest.raises(exceptions.ConfigurationError, match="no queue 'nope'"):
        set_queue_arguments(owner_url, "pgskip", "nope", set={"x-expires": 1})
    done = _cli(
        owner_url, "queue-args", "celery", "--unset", "x-expires", "--set", "x-max-priority=10"
    )
    assert done.returncode == 0, done.stderr
    assert "queue 'celery': x-expires 60000 -> none" in done.stdout
    assert "queue 'celery': x-max-priority none -> 10" in done.stdout
    stored = rows(
        tidy.db_url,
        "SELECT arguments::text, max_priority, expires FROM pgskip.queues WHERE name = 'celery'",
    )
    assert [(json.loads(stored[0][0]), stored[0][1], stored[0][2])] == [
        ({"x-max-priority": 10}, 10, None)
    ]


def test_only_the_owner_pauses_or_resumes_a_queue(tidy: Deployment) -> None:
    """Pausing stops a queue for the whole fleet: neither a publisher nor a worker may pause
    one (a denial of service) or resume one the owner paused, by the CLI or by SQL."""
    with psycopg.connect(tidy.url("owner"), autocommit=True) as conn:
        conn.execute("INSERT INTO pgskip.paused_queues (name, reason) VALUES ('held', 'audit')")
    for role in ATTACKERS:
        for command in (["pause", "celery"], ["resume", "held"]):
            done = _cli(tidy.url(role), *command)
            assert done.returncode == 1, done.stdout
            assert "only the schema's owner" in done.stderr, done.stderr
        with psycopg.connect(tidy.url(role), autocommit=True) as conn:
            for statement in (
                "INSERT INTO pgskip.paused_queues (name) VALUES ('celery')",
                "DELETE FROM pgskip.paused_queues",
                "UPDATE pgskip.paused_queues SET name = 'celery'",
                "TRUNCATE pgskip.paused_queues",
            ):
                _denied(conn, statement)
    assert rows(tidy.db_url, "SELECT name, reason FROM pgskip.paused_queues") == [("held", "audit")]
    # A worker reads it (every fetch does) and still takes the messages of `celery`.
    store = Store(broker(tidy.url("worker")))
    try:
        assert len(store.fetch(["celery", "held"], 3, tidy.consumer)) == 3
    finally:
        store.close()
    done = _cli(tidy.url("owner"), "resume", "held")
    assert done.returncode == 0, done.stderr
    assert "queue 'held': resumed" in done.stdout


def test_only_the_owner_sets_or_removes_a_queues_limits(tidy: Deployment) -> None:
    """A limit slows a queue for the whole fleet: neither a publisher nor a worker may set one
    (a denial of service) or lift one the owner set, by the CLI or by SQL; a worker only
    spends the bucket's tokens, which every limited fetch does."""
    with psycopg.connect(tidy.url("owner"), autocommit=True) as conn:
        conn.execute("INSERT INTO pgskip.queue_limits (name, max_running) VALUES ('held', 1)")
    for role in ATTACKERS:
        for command in (["limit", "celery", "--max-running", "1"], ["unlimit", "held"]):
            done = _cli(tidy.url(role), *command)
            assert done.returncode == 1, done.stdout
            assert "only the schema's owner" in done.stderr, done.stderr
        with psycopg.connect(tidy.url(role), autocommit=True) as conn:
            for statement in (
                "INSERT INTO pgskip.queue_limits (name, max_running) VALUES ('celery', 1)",
                "DELETE FROM pgskip.queue_limits",
                "UPDATE pgskip.queue_limits SET max_running = 1000",
                "UPDATE pgskip.queue_limits SET name = 'celery'",
                "TRUNCATE pgskip.queue_limits",
            ):
                _denied(conn, statement)
    assert rows(tidy.db_url, "SELECT name, max_running FROM pgskip.queue_limits") == [("held", 1)]
    # A worker takes the messages of `celery` and runs the limited fetch of `held`.
    store = Store(broker(tidy.url("worker")))
    try:
        assert len(store.fetch(["celery", "held"], 3, tidy.consumer)) == 3
        assert store.fetch_limited("held", 3, tidy.consumer).limited
    finally:
        store.close()


@contextmanager
def _granted_before(
    server: PgServer, db_url: str, tmp_path: Any, version: int
) -> Iterator[tuple[Any, Any]]:
    """A worker and a publisher role granted what `pgskip grant` gave on a schema at
    ``version - 1`` (today's grants without what later migrations added), the schema then
    migrated to the newest: (worker, publisher)."""
    require_passwords(server)
    dbname = db_url.rsplit("/", 1)[1]
    for m in (REPO_ROOT / "migrations").glob("00*.sql"):
        if int(m.name[:4]) < version:
            (tmp_path / m.name).write_bytes(m.read_bytes())
    with (
        login_role(server.dsn, databases=(dbname,)) as worker,
        login_role(server.dsn, databases=(dbname,)) as publisher,
    ):
        migrate(db_url, directory=tmp_path)
        old = []
        for g in grant_statements(
            dbname, "pgskip", workers=[worker.name], publishers=[publisher.name]
        ):
            text = g.text()
            if version <= 27 and any(
                what in text
                for what in (
                    "jobs_rotation",
                    "TRUNCATE",
                    "rotate()",
                    "rotation_keeps",
                    "current_slot",
                )
            ):
                continue
            if version <= 28 and "rotation_keeps_more" in text:
                continue
            if version <= 30 and ("sweep_scans" in text or "sweep(integer, interval)" in text):
                continue
            if version <= 28 and ', "blocked_since")' in text:
                text = text.replace(', "blocked_since")', ")")
                g = Grant(g.role, g.what, sql.Composed([sql.SQL(text)]))
            if version <= 27 and ', "slot")' in text:
                text = text.replace(', "slot")', ")")
                g = Grant(g.role, g.what, sql.Composed([sql.SQL(text)]))
            if version <= 21 and "paused_queues" in text:
                continue
            if version <= 25 and "queue_limits" in text:
                continue
            if version <= 23 and '"unique_key"' in text:
                text = text.replace(', "unique_key", "concurrency_key"', "")
                g = Grant(g.role, g.what, sql.Composed([sql.SQL(text)]))
            old.append(g)
        apply_grants(db_url, old)
        assert migrate(db_url) == [m.label for m in load_migrations() if m.version >= version]
        yield worker, publisher


def test_migration_0023_lets_publishers_granted_before_it_publish_keyed_tasks(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """Every publish writes the key columns: a publisher role granted by an older `pgskip
    grant` keeps publishing after the upgrade, with keys too, and still reads nothing new."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 23) as (_worker, publisher):
        store = Store(broker(publisher.url(db_url)))
        try:
            keyed = NewMessage("q", 0, "pending", None, "{}", "t", "1", None, "k", "c")
            assert store.publish(keyed) is not None
            assert store.publish(NewMessage("q", 0, "pending", None, "{}", "t", "2", None))
            assert store.publish(keyed) is None, "the key is held"
        finally:
            store.close()
        with psycopg.connect(publisher.url(db_url)) as conn:
            _denied(conn, "SELECT unique_key FROM pgskip.jobs")
            _denied(conn, "UPDATE pgskip.jobs SET unique_key = NULL")


def test_migration_0021_lets_workers_granted_before_it_read_the_paused_queues(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """Every fetch reads paused_queues: a worker role granted by an older `pgskip grant` keeps
    fetching after the upgrade, and a publisher role gets nothing new."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 21) as (worker, publisher):
        store = Store(broker(worker.url(db_url)))
        try:
            store.publish(NewMessage("q", 0, "pending", None, '{"n": 1}', "t", "1", None))
            consumer = uuid.uuid4()
            store.register_consumer(consumer, hostname="w", queues=["q"], lease=30)
            assert len(store.fetch(["q"], 10, consumer)) == 1
        finally:
            store.close()
        privilege = "SELECT has_table_privilege(%s, 'pgskip.paused_queues', 'SELECT')"
        with psycopg.connect(db_url) as conn:
            assert conn.execute(privilege, (worker.name,)).fetchone() == (True,)
            assert conn.execute(privilege, (publisher.name,)).fetchone() == (False,)


def test_migration_0025_lets_workers_granted_before_it_run_the_limited_fetch(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """The limited fetch reads queue_limits and spends its tokens: a worker role granted by an
    older `pgskip grant` gets that and nothing more after the upgrade (it cannot set a limit),
    and a publisher role gets nothing."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 25) as (worker, publisher):
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("INSERT INTO pgskip.queue_limits (name, rate) VALUES ('q', 100)")
        store = Store(broker(worker.url(db_url)))
        try:
            store.publish(NewMessage("q", 0, "pending", None, '{"n": 1}', "t", "1", None))
            consumer = uuid.uuid4()
            store.register_consumer(consumer, hostname="w", queues=["q"], lease=30)
            got = store.fetch_limited("q", 10, consumer)
            assert len(got.rows) == 1 and got.tokens is not None
        finally:
            store.close()
        with psycopg.connect(db_url) as conn:
            limits = (
                "SELECT has_table_privilege(%(r)s, 'pgskip.queue_limits', 'SELECT'),"
                " has_column_privilege(%(r)s, 'pgskip.queue_limits', 'tokens', 'UPDATE'),"
                " has_column_privilege(%(r)s, 'pgskip.queue_limits', 'refilled_at', 'UPDATE'),"
                " has_column_privilege(%(r)s, 'pgskip.queue_limits', 'max_running', 'UPDATE'),"
                " has_table_privilege(%(r)s, 'pgskip.queue_limits', 'INSERT, DELETE')"
            )
            assert conn.execute(limits, {"r": worker.name}).fetchone() == (
                True, True, True, False, False,
            )  # fmt: skip
            assert conn.execute(limits, {"r": publisher.name}).fetchone() == (False,) * 5


def test_migration_0026_claims_keys_for_roles_granted_before_it_and_grants_them_nothing(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """The claims of unique keys need no privilege of the roles that publish and retry keyed
    messages: roles granted by `pgskip grant` before the upgrade publish keyed tasks, are told
    of a held key, and retry a failed one, and may read or execute nothing new."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 26) as (worker, publisher):
        keyed = NewMessage("q", 0, "pending", None, "{}", "t", "1", None, "k")
        store = Store(broker(publisher.url(db_url)))
        try:
            held = store.publish(keyed)
            assert held is not None
            assert store.publish(keyed) is None, "the key is held"
        finally:
            store.close()
        with psycopg.connect(worker.url(db_url), autocommit=True) as conn:
            conn.execute("UPDATE pgskip.jobs SET status = 'failed' WHERE id = %s", (held,))
        store = Store(broker(publisher.url(db_url)))
        try:
            taken = store.publish(keyed)
            assert taken is not None, "a failed message holds no key"
        finally:
            store.close()
        done = _cli(worker.url(db_url), "retry-failed")
        assert done.returncode == 0, done.stderr
        assert rows(db_url, "SELECT id, status::text, unique_key FROM pgskip.jobs ORDER BY id") == [
            (held, "pending", None),
            (taken, "pending", "k"),
        ]
        for role in (worker, publisher):
            with psycopg.connect(role.url(db_url)) as conn:
                _denied(conn, "SELECT * FROM pgskip.unique_keys")
                _denied(conn, "SELECT pgskip.claim_unique_key()")


def test_the_ring_of_slots_is_moved_on_by_workers_never_by_publishers(tidy: Deployment) -> None:
    """rotate() empties slots with TRUNCATE: a worker may run it (it may delete messages
    anyway), and change nothing of the ring but where it stands and whether its locks were
    refused (a false claim costs the next rotation one lock try); a publisher may only read
    which slot is current, and write it with each message."""
    with psycopg.connect(tidy.url("owner"), autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 1, completed_retention = '0 s'")
    with psycopg.connect(tidy.url("publisher"), autocommit=True) as conn:
        for statement in (
            "SELECT * FROM pgskip.rotate()",
            "TRUNCATE pgskip.jobs_1",
            "TRUNCATE pgskip.jobs_kept",
            "UPDATE pgskip.jobs_rotation SET slot = 2",
            "UPDATE pgskip.jobs_rotation SET blocked_since = now()",
            "SELECT count(*) FROM pgskip.jobs_1",
            "DELETE FROM pgskip.jobs_kept",
        ):
            _denied(conn, statement)
    with psycopg.connect(tidy.url("worker"), autocommit=True) as conn:
        for statement in (
            "UPDATE pgskip.jobs_rotation SET slot_rows = 100000000",
            "UPDATE pgskip.jobs_rotation SET completed_retention = '100 years'",
            "UPDATE pgskip.jobs_rotation SET slots = 2",
            "TRUNCATE pgskip.jobs_kept",
            "TRUNCATE pgskip.jobs",
            "ALTER TABLE pgskip.jobs DETACH PARTITION pgskip.jobs_1",
        ):
            _denied(conn, statement)
    publisher = Store(broker(tidy.url("publisher")))
    worker = Store(broker(tidy.url("worker")))
    try:
        publisher.publish(NewMessage("q", 0, "pending", None, "{}", "t", "1", None))
        before = worker.rotate()[2]
        assert worker.rotate()[2] == before  # the slot's one message is not finished
        publisher.publish(NewMessage("q", 0, "pending", None, "{}", "t", "2", None))
        with psycopg.connect(tidy.url("worker"), autocommit=True) as conn:
            conn.execute("UPDATE pgskip.jobs_rotation SET blocked_since = now()")
        assert worker.rotate()[2] != before  # its one lock try granted, it went on
        with psycopg.connect(tidy.url("worker"), autocommit=True) as conn:
            row = conn.execute("SELECT blocked_since FROM pgskip.jobs_rotation").fetchone()
        assert row == (None,)
    finally:
        publisher.close()
        worker.close()


def test_migration_0027_lets_roles_granted_before_it_publish_and_rotate(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """The publish writes the current slot and workers rotate: roles granted by an older
    `pgskip grant` keep publishing and fetching after the upgrade, and the workers rotate."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 27) as (worker, publisher):
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 1")
        sender = Store(broker(publisher.url(db_url)))
        store = Store(broker(worker.url(db_url)))
        try:
            assert sender.publish(NewMessage("q", 0, "pending", None, "{}", "t", "1", None))
            consumer = uuid.uuid4()
            store.register_consumer(consumer, hostname="w", queues=["q"], lease=30)
            (row,) = store.fetch(["q"], 10, consumer)
            assert store.ack([row.tag], consumer) == 1
            assert store.rotate()[2] == 2
        finally:
            sender.close()
            store.close()
        with psycopg.connect(publisher.url(db_url)) as conn:
            _denied(conn, "SELECT * FROM pgskip.rotate()")


def test_migration_0028_lets_workers_granted_before_it_move_the_ring_onto_a_used_slot(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """rotate() counts what a slot keeps through a function of migration 0028, and writes when
    a session held the slot it had to lock: a worker role granted by an older `pgskip grant`
    may do both, and moves the ring onto a slot that still holds a message; a publisher may
    not."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 28) as (worker, publisher):
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 1, slots = 2")
        sender = Store(broker(publisher.url(db_url)))
        store = Store(broker(worker.url(db_url)))
        try:
            kept = sender.publish(NewMessage("q", 0, "pending", None, "{}", "t", "1", None))
            assert store.rotate() == (0, 0, 2)
            assert sender.publish(NewMessage("q", 0, "pending", None, "{}", "t", "2", None))
            assert store.rotate() == (1, 1, 1)  # slot 1's waiting message moved to jobs_kept
            consumer = uuid.uuid4()
            store.register_consumer(consumer, hostname="w", queues=["q"], lease=30)
            assert [r.id for r in store.fetch(["q"], 1, consumer)] == [kept]
            # While a session holds every slot, the worker writes that its lock was refused.
            assert sender.publish(NewMessage("q", 0, "pending", None, "{}", "t", "3", None))
            with psycopg.connect(db_url) as reader:
                reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                reader.execute("SELECT count(*) FROM pgskip.jobs")
                assert store.rotate() == (0, 0, 1)
                assert store.rotate() == (0, 0, 1)
                reader.rollback()
            assert store.rotate() == (1, 1, 2)  # slot 2's waiting message moved, slot 2 taken
        finally:
            sender.close()
            store.close()
        with psycopg.connect(publisher.url(db_url)) as conn:
            _denied(conn, "SELECT pgskip.rotation_keeps_more(1::smallint, '1 s', 0)")


def test_a_publisher_cannot_revoke_a_waiting_message(tidy: Deployment) -> None:
    """Revoking marks messages failed: a worker may (it settles messages), a publisher may not."""
    with psycopg.connect(tidy.url("owner"), autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs SET task_id = 'victim' WHERE id = (SELECT min(id) FROM"
            " pgskip.jobs WHERE queue = 'celery' AND status = 'pending')"
        )
    before = tidy.snapshot()
    done = _cli(tidy.url("publisher"), "revoke", "victim")
    assert done.returncode == 1, done.stdout
    assert "lacks a privilege" in done.stderr, done.stderr
    assert tidy.snapshot() == before


def test_no_role_stops_the_sweeps_from_reading_running_messages(tidy: Deployment) -> None:
    """``sweep_scans`` says when a sweep last read every running message (migration 0030). A
    publisher may neither read nor write it nor sweep; a worker may write when (it sweeps
    anyway: a false claim holds the next read back by a minute at most), and a time it writes
    ahead of the server's clock holds back no read; it may not add, delete or empty the row."""
    with psycopg.connect(tidy.url("publisher"), autocommit=True) as conn:
        for statement in (
            "SELECT * FROM pgskip.sweep_scans",
            "UPDATE pgskip.sweep_scans SET scanned_at = 'infinity'",
            "DELETE FROM pgskip.sweep_scans",
            "SELECT * FROM pgskip.sweep(20, '1 hour')",
        ):
            _denied(conn, statement)
    with psycopg.connect(tidy.url("worker"), autocommit=True) as conn:
        for statement in (
            "DELETE FROM pgskip.sweep_scans",
            "TRUNCATE pgskip.sweep_scans",
            "INSERT INTO pgskip.sweep_scans (scanned_at) VALUES (now())",
            "UPDATE pgskip.sweep_scans SET only_row = false",
        ):
            _denied(conn, statement)
        conn.execute("UPDATE pgskip.sweep_scans SET scanned_at = 'infinity', complete = true")
    (orphan,) = running_orphans(tidy.db_url, queue="orphaned")
    before = tidy.snapshot()
    worker = Store(broker(tidy.url("worker")))
    try:
        assert worker.sweep(max_attempts=20, scan_every=3600) == (1, 0, 0)
    finally:
        worker.close()
    assert rows(tidy.db_url, f"SELECT status::text FROM pgskip.jobs WHERE id = {orphan}") == [
        ("pending",)
    ]
    assert tidy.snapshot() == before


def test_migration_0030_lets_workers_granted_before_it_sweep(
    any_pg_server: PgServer, versioned_empty_db_url: str, tmp_path: Any
) -> None:
    """A worker's sweep reads the running messages once a minute through a function and a table
    of migration 0030: a worker role granted by an older `pgskip grant` sweeps with both after
    the upgrade, and with the function older code calls; a publisher does neither."""
    db_url = versioned_empty_db_url
    with _granted_before(any_pg_server, db_url, tmp_path, 30) as (worker, publisher):
        store = Store(broker(worker.url(db_url)))
        try:
            running_orphans(db_url)
            assert store.sweep(max_attempts=20, scan_every=60) == (1, 0, 0)
            running_orphans(db_url)
            assert store.sweep(max_attempts=20, scan_every=60) == (0, 0, 0)
            assert store.sweep(max_attempts=20) == (1, 0, 0)
        finally:
            store.close()
        with psycopg.connect(publisher.url(db_url), autocommit=True) as conn:
            _denied(conn, "SELECT * FROM pgskip.sweep(20, '1 minute')")
            _denied(conn, "SELECT * FROM pgskip.sweep_scans")
