"""The test server fixtures work: the server answers, pg_cron runs, crash restarts recover."""

from __future__ import annotations

import os

import psycopg
import pytest

from kombu_pgskip.testing.embedded import EmbeddedPostgres, find_bindir
from tests.helpers import make_url


def test_session_server_answers_queries(pg_server_dsn: str) -> None:
    with psycopg.connect(pg_server_dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_embedded_server_preloads_pg_cron(embedded_pg: EmbeddedPostgres | None) -> None:
    if embedded_pg is None:
        pytest.skip("the session server is not the embedded one; its preload list is not ours")
    with psycopg.connect(embedded_pg.dsn()) as conn:
        row = conn.execute("SHOW shared_preload_libraries").fetchone()
    assert row is not None
    assert "pg_cron" in row[0].split(",")


def test_pg_cron_can_schedule_and_unschedule_a_job(
    pg_server_dsn: str, pg_cron_database: str
) -> None:
    with psycopg.connect(make_url(pg_server_dsn, pg_cron_database), autocommit=True) as conn:
        row = conn.execute(
            "SELECT cron.schedule('pgskip-fixture-probe', '* * * * *', 'SELECT 1')"
        ).fetchone()
        assert row is not None and row[0] > 0
        assert conn.execute("SELECT cron.unschedule('pgskip-fixture-probe')").fetchone() == (True,)


def test_db_url_is_a_private_migrated_database(db_url: str, empty_db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM pgskip.migrations").fetchone() != (0,)
    with psycopg.connect(empty_db_url) as conn:
        row = conn.execute("SELECT to_regnamespace('pgskip')").fetchone()
    assert row == (None,)


def test_immediate_restart_recovers_committed_data() -> None:
    try:
        find_bindir()
    except RuntimeError as exc:
        if os.environ.get("PGSKIP_TEST_DSN"):
            pytest.skip(f"no local PostgreSQL binaries and PGSKIP_TEST_DSN is set: {exc}")
        raise
    with EmbeddedPostgres(fsync=False) as pg:
        with psycopg.connect(pg.dsn()) as conn:
            conn.execute("CREATE TABLE survivor (x int)")
            conn.execute("INSERT INTO survivor VALUES (42)")

        pg.restart(mode="immediate")

        with psycopg.connect(pg.dsn()) as conn:
            assert conn.execute("SELECT x FROM survivor").fetchall() == [(42,)]
