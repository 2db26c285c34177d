"""Remembered routes (migration 0005): a publish through an exchange that routed to one queue
goes straight into that queue next time, guarded by the routing epoch, and any change of
routing made anywhere (another process, another transaction) is seen by the next publish.

Each kombu ``Connection`` has its own transport and in-memory state, as a separate process
would, so what one connection binds the other knows only through the database.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql

import kombu_pgskip  # noqa: F401  (registers pgskip://)
import kombu_pgskip.store as store_module
from kombu_pgskip.grants import PUBLISHER_PRIVILEGES
from kombu_pgskip.migrate import load_migrations, migrate
from kombu_pgskip.queue_args import set_queue_arguments
from kombu_pgskip.store import Store


def _counts(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT queue, count(*) FROM pgskip.jobs GROUP BY queue")
        return {r[0]: int(r[1]) for r in rows}


def _executions(store: Store) -> dict[str, int]:
    """How many times each of the store's prepared publish statements ran (by its connection):
    ``insert_remembered`` is the remembered route's insert, whose NOTIFY follows on its own."""
    rows = store.conn.execute(
        "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
        " WHERE name IN ('pgskip_insert_remembered', 'pgskip_publish_routed')"
    )
    return {str(r[0]).removeprefix("pgskip_"): int(r[1]) for r in rows}


def _epoch(db_url: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT n FROM pgskip.routing_epoch").fetchone()
        assert row is not None
        return int(row[0])


def _setup(conn: Connection, exchange: Exchange, queue: str, key: str) -> None:
    Queue(queue, exchange, routing_key=key).bind(conn.default_channel).declare()


def _remembering(worker: Connection, caller: Connection) -> Producer:
    """A producer of ``caller`` whose route ("tasks", "k") -> q1 (bound by ``worker``) is
    remembered: two messages published, the second as remembered."""
    ex = Exchange("tasks", "direct")
    _setup(worker, ex, "q1", "k")
    producer = Producer(caller.default_channel, exchange=ex, routing_key="k")
    producer.publish({"i": 1}, declare=[ex])
    producer.publish({"i": 2})
    return producer


def test_a_second_publish_to_the_same_route_skips_routing(connections: Any, db_url: str) -> None:
    worker, caller = connections(), connections()
    ex = Exchange("tasks", "direct")
    _setup(worker, ex, "q1", "k")
    producer = Producer(caller.default_channel, exchange=ex, routing_key="k")
    for i in range(3):
        producer.publish({"i": i}, declare=[ex])
    assert _counts(db_url) == {"q1": 3}
    store = caller.default_channel.store
    assert _executions(store) == {"publish_routed": 1, "insert_remembered": 2}


def test_a_binding_made_by_another_process_is_seen_by_the_next_publish(
    connections: Any, db_url: str
) -> None:
    worker, other, caller = connections(), connections(), connections()
    producer = _remembering(worker, caller)
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
    producer = _remembering(worker, caller)
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
    producer = _remembering(worker, caller)
    with psycopg.connect(db_url, autocommit=True) as owner:
        owner.execute("UPDATE pgskip.exchanges SET type = 'topic' WHERE name = 'tasks'")
    producer.publish({"i": 3})
    assert _counts(db_url) == {"q1": 2}


def test_a_queue_with_x_expires_is_routed_afresh_every_time(connections: Any, db_url: str) -> None:
    worker, caller = connections(), connections()
    ex = Exchange("tasks", "direct")
    Queue("q1", ex, routing_key="k", expires=60).bind(worker.default_channel).declare()
    producer = Producer(caller.default_channel, exchange=ex, routing_key="k")
    for i in range(3):
        producer.publish({"i": i}, declare=[ex])
    assert _counts(db_url) == {"q1": 3}
    assert _executions(caller.default_channel.store) == {"publish_routed": 3}


def test_an_uncommitted_binding_counts_from_its_commit(connections: Any, db_url: str) -> None:
    """The epoch moves in the binding's transaction: publishes made meanwhile neither wait for
    it nor see it; the first one after its commit does, and a rolled-back change is never
    seen."""
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


def test_every_routing_change_moves_the_epoch(db_url: str) -> None:
    store = Store(db_url)
    try:
        seen = [_epoch(db_url)]

        def moved() -> bool:
            seen.append(_epoch(db_url))
            return seen[-1] != seen[-2]

        store.declare_exchange("ex", "direct")
        assert not moved()  # a new exchange routes nothing yet
        store.declare_queue("q")
        assert moved()
        store.declare_queue("q")
        assert not moved()  # declaring again changes nothing
        store.bind("q", "ex", "k", type="direct")
        assert moved()
        store.bind("q", "ex", "k", type="direct")
        assert not moved()
        with psycopg.connect(db_url, autocommit=True) as owner:  # a retype is the owner's
            owner.execute("UPDATE pgskip.exchanges SET type = 'fanout' WHERE name = 'ex'")
        assert moved()
        set_queue_arguments(db_url, "pgskip", "q", set={"x-expires": 60_000})
        assert moved()
        store.unbind("q", "ex", "k")
        assert moved()
        store.bind("q", "ex", "k", type="fanout")
        store.delete_exchange("ex")
        assert moved()
        store.delete_queue("q")
        assert moved()
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("TRUNCATE pgskip.bindings")
        assert moved()
    finally:
        store.close()


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


def test_an_upgraded_publisher_role_may_read_the_epoch(empty_db_url: str) -> None:
    """Migration 0005 grants the epoch, and 0010 consumer_queues, to every role that could
    publish before them, so an upgrade needs no second `pgskip grant`; 0012 narrows what
    such a role may write to what `pgskip grant` gives a publisher."""
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
                assert conn.execute("SELECT n FROM pgskip.routing_epoch").fetchone() is not None
                assert conn.execute("SELECT count(*) FROM pgskip.consumer_queues").fetchone()
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


def test_the_per_message_statements_are_planned_once(
    connections: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL re-plans a prepared statement on every execution when a custom plan looks
    cheaper than the generic one (a NULL-able guard did that to publish: 80 us of server CPU per
    message). After a few executions each per-message statement must run its generic plan.
    (Every announcement reads the polling flags here, so that it runs often enough.)"""
    monkeypatch.setattr(store_module, "QUIET_CHECK_EVERY", 1)
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
    assert set(plans) == {
        "pgskip_insert_message",
        "pgskip_insert_remembered",
        "pgskip_announce",
        "pgskip_publish_routed",
    }
    for name, (generic, custom) in plans.items():
        assert generic >= 6 and custom <= 5, (name, generic, custom)
