"""Routing through the database: what one process binds, deletes or changes, any other sees at
its next publish, and a change made in a transaction counts from its commit.

Each kombu ``Connection`` has its own transport and in-memory state, as a separate process
would, so what one connection binds the other knows only through the database.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql

import kombu_pgskip  # noqa: F401  (registers pgskip://)
from kombu_pgskip.grants import PUBLISHER_PRIVILEGES
from kombu_pgskip.migrate import load_migrations, migrate


def _counts(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT queue, count(*) FROM pgskip.jobs GROUP BY queue")
        return {r[0]: int(r[1]) for r in rows}


def _setup(conn: Connection, exchange: Exchange, queue: str, key: str) -> None:
    Queue(queue, exchange, routing_key=key).bind(conn.default_channel).declare()


def _publishing(worker: Connection, caller: Connection) -> Producer:
    """A producer of ``caller`` to the route ("tasks", "k") -> q1 that ``worker`` bound, after
    two messages published through it."""
    ex = Exchange("tasks", "direct")
    _setup(worker, ex, "q1", "k")
    producer = Producer(caller.default_channel, exchange=ex, routing_key="k")
    producer.publish({"i": 1}, declare=[ex])
    producer.publish({"i": 2})
    return producer


def test_a_binding_made_by_another_process_is_seen_by_the_next_publish(
    connections: Any, db_url: str
) -> None:
    worker, other, caller = connections(), connections(), connections()
    producer = _publishing(worker, caller)
    ex = Exchange("tasks", "direct")
    _setup(other, ex, "q2", "k")
    producer.publish({"i": 3})
    assert _counts(db_url) == {"q1": 3, "q2": 1}
    Queue("q1", ex, routing_key="k").unbind_from(
        ex, routing_key="k", channel=worker.default_channel
    )
    producer.publish({"i": 4})
    producer.publish({"i": 5})
    assert _counts(db_url) == {"q1": 3, "q2": 3}


def test_a_queue_deleted_by_another_process_gets_nothing_more(
    connections: Any, db_url: str
) -> None:
    worker, caller = connections(), connections()
    producer = _publishing(worker, caller)
    worker.default_channel.queue_delete("q1")
    producer.publish({"i": 3})  # unroutable now: dropped, as AMQP drops it
    assert _counts(db_url) == {}


def test_an_exchange_retyped_elsewhere_routes_by_its_new_type(
    connections: Any, db_url: str
) -> None:
    """A direct binding has no topic pattern: once the exchange is a topic exchange, the key
    that matched the direct binding matches nothing. (A declaration of another type is
    refused; the schema's owner can still change it.)"""
    worker, caller = connections(), connections()
    producer = _publishing(worker, caller)
    with psycopg.connect(db_url, autocommit=True) as owner:
        owner.execute("UPDATE pgskip.exchanges SET type = 'topic' WHERE name = 'tasks'")
    producer.publish({"i": 3})
    assert _counts(db_url) == {"q1": 2}


def test_an_uncommitted_binding_counts_from_its_commit(connections: Any, db_url: str) -> None:
    """Publishes made while a binding's transaction is open neither wait for it nor see it;
    the first one after its commit does, and a rolled-back binding is never seen."""
    worker, caller = connections(), connections()
    ex = Exchange("tasks", "direct")
    _setup(worker, ex, "q1", "k")
    worker.default_channel.queue_declare("q2")
    producer = Producer(caller.default_channel, exchange=ex, routing_key="k")
    producer.publish({"i": 1}, declare=[ex])
    bind = "INSERT INTO pgskip.bindings (exchange, queue, routing_key) VALUES ('tasks', 'q2', 'k')"
    with psycopg.connect(db_url) as other:
        other.execute(bind)
        producer.publish({"i": 2})
        other.rollback()
        producer.publish({"i": 3})
        assert _counts(db_url) == {"q1": 3}
        other.execute(bind)
        producer.publish({"i": 4})
        other.commit()
    producer.publish({"i": 5})
    assert _counts(db_url) == {"q1": 5, "q2": 1}


#: What ``pgskip grant --publisher`` gave up to migration 0004.
PUBLISHER_GRANTS_OF_0004 = (
    ("jobs", "INSERT", ()),
    ("jobs", "SELECT", ("id", "queue", "status")),
    ("queues", "SELECT, INSERT, UPDATE", ()),
    ("exchanges", "SELECT, INSERT, UPDATE", ()),
    ("bindings", "SELECT, INSERT, UPDATE", ()),
    ("consumers", "SELECT", ()),
    ("migrations", "SELECT", ()),
)


def test_an_upgraded_publisher_role_ends_with_what_grant_gives_a_publisher(
    empty_db_url: str,
) -> None:
    """A role granted as `pgskip grant --publisher` did up to migration 0004 can publish
    through every later migration without a second `grant`, and migration 0012 narrows what
    it may write to what `pgskip grant` gives a publisher."""
    migrations = load_migrations()
    role = f"pub_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(ident))
        try:
            with conn.transaction():  # the schema as 0004 left it, granted as then
                conn.execute("CREATE SCHEMA pgskip")
                conn.execute(
                    "CREATE TABLE pgskip.migrations (version integer PRIMARY KEY,"
                    " name text NOT NULL, checksum text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
                conn.execute("SET LOCAL search_path TO pgskip, public")
                for m in migrations:
                    if m.version > 4:
                        continue
                    conn.execute(m.sql.encode())
                    conn.execute(
                        "INSERT INTO pgskip.migrations VALUES (%s, %s, %s)",
                        (m.version, m.name, m.checksum),
                    )
                for table, privileges, columns in PUBLISHER_GRANTS_OF_0004:
                    cols = (
                        sql.SQL("({})").format(sql.SQL(", ").join(map(sql.Identifier, columns)))
                        if columns
                        else sql.SQL("")
                    )
                    conn.execute(
                        sql.SQL("GRANT {} {} ON pgskip.{} TO {}").format(
                            sql.SQL(privileges), cols, sql.Identifier(table), ident
                        )
                    )
                conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pgskip TO {}").format(ident))
            assert migrate(empty_db_url) == [m.label for m in migrations if m.version > 4]
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL ROLE {}").format(ident))
                assert conn.execute("SELECT count(*) FROM pgskip.consumers").fetchone() == (0,)
            granted = {
                (table, privilege, column)
                for table, privilege, column in conn.execute(
                    "SELECT c.relname, a.privilege_type, NULL FROM pg_class AS c,"
                    " aclexplode(c.relacl) AS a WHERE c.relnamespace = 'pgskip'::regnamespace"
                    " AND a.grantee = %(role)s::regrole"
                    " UNION SELECT c.relname, a.privilege_type, att.attname::text"
                    " FROM pg_attribute AS att JOIN pg_class AS c ON c.oid = att.attrelid,"
                    " aclexplode(att.attacl) AS a WHERE c.relnamespace = 'pgskip'::regnamespace"
                    " AND a.grantee = %(role)s::regrole",
                    {"role": role},
                ).fetchall()
            }
            expected = {
                (table, privilege.strip(), column)
                for table, privileges, columns in PUBLISHER_PRIVILEGES
                for privilege in privileges.split(",")
                for column in (columns or (None,))
            }
            assert granted == expected
        finally:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_the_per_message_statements_are_planned_once(connections: Any) -> None:
    """PostgreSQL re-plans a prepared statement on every execution when a custom plan looks
    cheaper than the generic one (a NULL-able guard did that to publish: 80 us of server CPU per
    message). After a few executions each per-message statement must run its generic plan."""
    worker, caller = connections(), connections()
    ex = Exchange("tasks", "direct")
    _setup(worker, ex, "q1", "k")
    Queue("q2", ex, routing_key="k2", expires=60).bind(worker.default_channel).declare()
    channel = caller.default_channel
    for i in range(12):
        Producer(channel, exchange=ex, routing_key="k").publish({"i": i}, declare=[ex])
        Producer(channel, exchange=ex, routing_key="k2").publish({"i": i})
        Producer(channel, routing_key="q1").publish({"i": i})
    rows = channel.store.conn.execute(
        "SELECT name, generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE name LIKE 'pgskip_%'"
    ).fetchall()
    plans = {str(r[0]): (int(r[1]), int(r[2])) for r in rows}
    assert set(plans) == {"pgskip_insert_noting", "pgskip_announce", "pgskip_publish_routed"}
    for name, (generic, custom) in plans.items():
        assert generic >= 6 and custom <= 5, (name, generic, custom)
