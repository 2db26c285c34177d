"""Nothing of the broker's is compiled by PostgreSQL's JIT (migration 0029): compiling a
statement's expressions costs far more than running any of ours, and a generic plan over the
partitions of ``jobs`` can be estimated past ``jit_above_cost``, so that it compiled again at
every execution (about 1.9 s of server CPU for each ``sweep()`` on 80,000 messages)."""

from __future__ import annotations

import uuid

import psycopg

from kombu_pgskip.fetcher import AsyncFetcher
from kombu_pgskip.store import Store
from kombu_pgskip.urls import connect

#: What workers and pg_cron's jobs call (``pgskip tick``, the maintenance and beat jobs).
MAINTENANCE = (
    "sweep(integer)",
    "sweep(integer, interval)",
    "prune(interval, interval)",
    "prune_completed_batch(timestamptz, integer)",
    "prune_unique_keys(integer)",
    "expire_queues()",
    "fire_due(timestamptz, interval)",
    "rotate()",
)


def _jit(conn: psycopg.Connection) -> str:  # type: ignore[type-arg]
    row = conn.execute("SHOW jit").fetchone()
    assert row is not None
    return str(row[0])


def test_the_transports_sessions_run_without_jit(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as admin:
        # As on most packaged servers (whatever the server the tests run on says).
        (alter,) = admin.execute(
            "SELECT format('ALTER DATABASE %I SET jit = on', current_database())"
        ).fetchone()  # type: ignore[misc]
        admin.execute(alter)
    with psycopg.connect(db_url) as plain:
        assert _jit(plain) == "on"
    store = Store(db_url)
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=True, connect_timeout=10)
    try:
        me = uuid.uuid4()
        store.register_consumer(me, hostname="h", queues=["q"], lease=60)
        assert _jit(store.conn) == "off"
        fetcher.fileno()  # connects
        assert fetcher._conn is not None
        assert _jit(fetcher._conn) == "off"
    finally:
        fetcher.close()
        store.close()
    # Behind PgBouncer in transaction pooling a session is not ours alone: it keeps the
    # server's setting (and the functions below turn it off for themselves).
    with connect(db_url, pin_search_path=False) as shared:
        assert _jit(shared) == "on"


def test_the_functions_workers_and_pg_cron_call_run_without_jit(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        for name in MAINTENANCE:
            row = conn.execute(
                "SELECT coalesce(proconfig, '{}') FROM pg_proc WHERE oid = %s::regprocedure",
                (f"pgskip.{name}",),
            ).fetchone()
            assert row is not None and "jit=off" in row[0], (name, row)
        # A session that would compile everything (every threshold at 0) runs them all the
        # same, and sweeps, prunes and rotates as it would without.
        conn.execute("SET jit_above_cost = 0")
        conn.execute("SET jit_inline_above_cost = 0")
        conn.execute("SET jit_optimize_above_cost = 0")
        assert conn.execute("SELECT * FROM pgskip.sweep(20)").fetchone() == (0, 0, 0, 0)
        assert conn.execute("SELECT * FROM pgskip.rotate()").fetchone() == (0, 0, 1)
        conn.execute("SELECT * FROM pgskip.prune(interval '1 day', NULL)").fetchall()
