"""The per-message publish statements run through libpq (kombu_pgskip.libpq), and every insert
statement wakes consumers itself (migration 0004 dropped the NOTIFY trigger)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from kombu_pgskip import exceptions
from kombu_pgskip.envelope import to_routed_row, to_row
from kombu_pgskip.store import NewMessage, Store, notify_channel, scheduled_channel


def _message(**headers: Any) -> dict[str, Any]:
    return {
        "body": json.dumps({"x": 1}),
        "headers": {"task": "t", "id": "id-1", **headers},
        "properties": {"priority": 3, "delivery_info": {}},
    }


def _row(queue: str, **headers: Any) -> NewMessage:
    return to_row(queue, _message(**headers), eta_threshold=60, max_message_size=10**6)


def _listener(db_url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(db_url, autocommit=True)
    conn.execute(f'LISTEN "{notify_channel("pgskip")}"')
    conn.execute(f'LISTEN "{scheduled_channel("pgskip")}"')
    return conn


def _notes(conn: psycopg.Connection[Any], n: int) -> list[tuple[str, str]]:
    return [(x.channel, x.payload) for x in conn.notifies(timeout=2.0, stop_after=n)]


def _named(store: Store, row_id: int) -> str:
    """The payload of the notification that names message ``row_id``."""
    row = store.conn.execute("SELECT queue, slot FROM pgskip.jobs WHERE id = %s", (row_id,))
    queue, slot = row.fetchone() or ("?", "?")
    return f"{queue}\x1f{row_id}\x1f{slot}"


def test_the_insert_trigger_is_gone(db_url: str) -> None:
    """No trigger of jobs notifies: the only ones claim unique keys (migration 0026)."""
    with psycopg.connect(db_url) as conn:
        triggers = conn.execute(
            "SELECT tgname::text, tgfoid::regprocedure::text FROM pg_trigger"
            " WHERE tgrelid = 'pgskip.jobs'::regclass AND NOT tgisinternal ORDER BY 1"
        ).fetchall()
    assert triggers == [
        ("jobs_claim_unique_key", "pgskip.claim_unique_key()"),
        ("jobs_reclaim_unique_key", "pgskip.claim_unique_key()"),
    ]


def test_each_insert_statement_notifies_with_the_trigger_s_payloads(db_url: str) -> None:
    store = Store(db_url)
    listener = _listener(db_url)
    try:
        # publish: the message named (queue, id and slot), then the queue name alone, for a
        # pending message: in a transaction of its own behind the insert's, or inside a
        # transaction (the insert's own statement sends them)
        channel = notify_channel("pgskip")
        row_id = store.publish(_row("direct-q"))
        assert _notes(listener, 2) == [(channel, _named(store, row_id)), (channel, "direct-q")]
        with store.executor.transaction():
            row_id = store.publish(_row("direct-q"))
        assert _notes(listener, 2) == [(channel, _named(store, row_id)), (channel, "direct-q")]
        # a publish that writes nothing (its unique key is held) names nothing
        keyed = dataclasses.replace(_row("direct-q"), unique_key="k")
        assert store.publish(keyed) is not None
        _notes(listener, 2)
        assert store.publish(keyed) is None
        assert _notes(listener, 2) == [(channel, "direct-q")]
        # publish of a far-future message: its due time on the scheduled channel
        eta = datetime.now(timezone.utc) + timedelta(hours=1)
        store.publish(_row("direct-q", eta=eta.isoformat()))
        ((channel, payload),) = _notes(listener, 1)
        assert channel == scheduled_channel("pgskip")
        assert abs(float(payload) - eta.timestamp()) < 0.001
        # publish_many: one notification per queue, one for the scheduled rows
        rows = [_row("many-a"), _row("many-a"), _row("many-b"), _row("many-b", eta=eta.isoformat())]
        ids = store.publish_many(rows)
        assert ids == sorted(ids) and len(ids) == 4
        notes = _notes(listener, 3)
        assert sorted(notes) == sorted(
            [
                (notify_channel("pgskip"), "many-a"),
                (notify_channel("pgskip"), "many-b"),
                (scheduled_channel("pgskip"), notes[-1][1]),
            ]
        )
        # publish_routed: two per target queue
        store.declare_exchange("ex-direct", "fanout")
        for queue in ("fan-1", "fan-2"):
            store.declare_queue(queue)
            store.bind(queue, "ex-direct", "", type="fanout")
        routed = to_routed_row("ex-direct", _message(), eta_threshold=60, max_message_size=10**6)
        written = store.publish_routed(routed, exchange="ex-direct", routing_key="", queues=[])
        assert sorted(written) == ["fan-1", "fan-2"]
        # each target's message named, then the queue alone
        ids = store.conn.execute(
            "SELECT id FROM pgskip.jobs WHERE queue IN ('fan-1', 'fan-2') ORDER BY queue"
        ).fetchall()
        jobs = notify_channel("pgskip")
        assert _notes(listener, 4) == [
            (jobs, _named(store, ids[0][0])),
            (jobs, "fan-1"),
            (jobs, _named(store, ids[1][0])),
            (jobs, "fan-2"),
        ]
    finally:
        listener.close()
        store.close()


def test_direct_publish_keeps_priority_clamp_and_queue_ttl(db_url: str) -> None:
    store = Store(db_url)
    try:
        store.declare_queue("capped", arguments={"x-max-priority": 2, "x-message-ttl": 5000})
        row_id = store.publish(_row("capped"))
        with psycopg.connect(db_url) as conn:
            priority, ttl = conn.execute(
                "SELECT priority, expires_at - created_at FROM pgskip.jobs WHERE id = %s",
                (row_id,),
            ).fetchone() or (None, None)
        assert priority == 2
        assert ttl is not None and timedelta(seconds=4) < ttl <= timedelta(seconds=5)
    finally:
        store.close()


def test_direct_publish_prepares_again_after_a_reconnect(db_url: str) -> None:
    store = Store(db_url)
    try:
        first = store.publish(_row("q"))
        store.conn.close()  # the next statement opens a new connection
        second = store.publish(_row("q"))
        assert second > first
        prepared = store.conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pgskip_%' ORDER BY name"
        ).fetchall()
        assert prepared == [("pgskip_announce",), ("pgskip_insert_noting",)]
    finally:
        store.close()


def test_without_prepared_statements_nothing_is_prepared(db_url: str) -> None:
    """PgBouncer in transaction pooling mode: the text is sent every time."""
    store = Store(db_url, prepare_threshold=None)
    try:
        for _ in range(3):
            store.publish(_row("q"))
        prepared = store.conn.execute("SELECT name FROM pg_prepared_statements").fetchall()
        assert prepared == []
    finally:
        store.close()


def test_direct_publish_errors_are_translated(empty_db_url: str) -> None:
    """No schema: the libpq path raises the same clear error as the psycopg one."""
    store = Store(empty_db_url, check=False)
    try:
        with pytest.raises(exceptions.SchemaError, match="pgskip migrate"):
            store.publish(_row("q"))
        # The connection is still usable afterwards.
        assert store.conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        store.close()


def test_direct_publish_is_interrupted_by_a_lost_connection(db_url: str) -> None:
    store = Store(db_url)
    try:
        store.publish(_row("q"))
        pid = store.conn.info.backend_pid
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            store.publish(_row("q"))
        assert store.publish(_row("q")) > 0  # a new connection
    finally:
        store.close()


def test_a_publisher_role_can_run_every_insert_statement(db_url: str) -> None:
    """The notifications read nothing a publisher role may not read (grants.py: of ``jobs``
    only id, queue and status): scheduled messages announce the due time they were given."""
    from psycopg import sql

    from kombu_pgskip.grants import apply_grants, database_of, grant_statements

    role = f"pub_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
    try:
        apply_grants(
            db_url, grant_statements(database_of(db_url), "pgskip", workers=[], publishers=[role])
        )
        store = Store(db_url)
        store.conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        eta = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
        try:
            assert store.publish(_row("q")) > 0
            assert store.publish(_row("q", eta=eta)) > 0
            assert len(store.publish_many([_row("q"), _row("q", eta=eta)])) == 2
            store.declare_exchange("ex-pub", "direct")
            store.declare_queue("q")
            store.bind("q", "ex-pub", "k", type="direct")
            routed = to_routed_row("ex-pub", _message(eta=eta), eta_threshold=60,
                                   max_message_size=10**6)  # fmt: skip
            assert store.publish_routed(routed, exchange="ex-pub", routing_key="k", queues=[]) == [
                "q"
            ]
            with pytest.raises(exceptions.PermissionDenied):
                store.fetch(["q"], 1, uuid.uuid4(), max_bytes=1)
        finally:
            store.close()
    finally:
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_direct_publish_survives_a_deallocated_statement(db_url: str) -> None:
    """DISCARD ALL (a pooler's reset query) drops prepared statements: prepared again."""
    store = Store(db_url)
    try:
        store.publish(_row("q"))
        store.conn.execute("DISCARD ALL")
        assert store.publish(_row("q")) > 0
    finally:
        store.close()
