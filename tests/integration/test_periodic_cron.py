"""pg_cron problems come with the fix: missing or not loaded (what to install, the preload line,
the fallback), and a role without privileges (the GRANTs, which then work)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone

import psycopg
import pytest
from psycopg import sql

from kombu_pgskip import cron
from kombu_pgskip.migrate import migrate
from kombu_pgskip.periodic import beat_sync
from kombu_pgskip.testing.embedded import EmbeddedPostgres, find_bindir
from tests.helpers import make_url
from tests.periodic_support import make_app


@pytest.fixture
def limited_role(db_url: str, pg_cron_database: str) -> Iterator[tuple[str, str]]:
    """(role name, broker URL as that role): may use the app's schema, nothing of pg_cron."""
    role = f"app_{uuid.uuid4().hex[:8]}"
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT ALL ON SCHEMA pgskip TO {}").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT ALL ON ALL TABLES IN SCHEMA pgskip TO {}").format(sql.Identifier(role))
        )
        # beat-sync is the owner's: it computes the first slots with the schema's functions.
        conn.execute(
            sql.SQL("GRANT EXECUTE ON ALL ROUTINES IN SCHEMA pgskip TO {}").format(
                sql.Identifier(role)
            )
        )
    url = db_url.replace("postgres@", f"{role}@", 1)
    try:
        yield role, url
    finally:
        cron_url = make_url(db_url, pg_cron_database)
        with psycopg.connect(cron_url, autocommit=True) as conn:
            conn.execute("SELECT cron.unschedule(jobid) FROM cron.job WHERE username = %s", (role,))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
        del dbname


def test_role_without_privileges_gets_the_grants_that_fix_it(
    db_url: str, pg_cron_database: str, limited_role: tuple[str, str]
) -> None:
    role, url = limited_role
    with pytest.raises(cron.PgCronPermissionDenied) as info:
        cron.locate(url)
    message = str(info.value)
    assert f"GRANT USAGE ON SCHEMA cron TO {role};" in message
    grant_fn = (
        "GRANT EXECUTE ON FUNCTION cron.schedule_in_database(text,text,text,text,text,boolean) "
        f"TO {role};"
    )
    assert grant_fn in message
    # Nothing was stored: pg_cron is checked before the transaction.
    with pytest.raises(cron.PgCronPermissionDenied):
        beat_sync(make_app({"e": {"task": "x.y", "schedule": 60}}), url, "pgskip")
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM pgskip.beat_entries").fetchone() == (0,)

    # Run exactly the statements the message gives, as a superuser of pg_cron's database.
    with psycopg.connect(make_url(db_url, pg_cron_database), autocommit=True) as conn:
        for line in message.splitlines():
            if line.strip().startswith("GRANT"):
                conn.execute(line.strip().encode())
    result = beat_sync(make_app({"e": {"task": "x.y", "schedule": 60}}), url, "pgskip")
    assert [c.sign for c in result.changes] == ["+"] and result.cron_changes
    with psycopg.connect(make_url(db_url, pg_cron_database)) as conn:
        owner = conn.execute(
            "SELECT username FROM cron.job WHERE jobname = %s",
            (f"pgskip:{db_url.rsplit('/', 1)[1]}:pgskip:fire",),
        ).fetchone()
    assert owner == (role,)


@pytest.fixture(scope="module")
def server_without_pg_cron() -> Iterator[str]:
    try:
        find_bindir()
    except RuntimeError as exc:
        if os.environ.get("PGSKIP_TEST_DSN"):
            pytest.skip(f"no local PostgreSQL binaries and PGSKIP_TEST_DSN is set: {exc}")
        raise
    with EmbeddedPostgres(fsync=False, pg_cron=False) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
        url = pg.dsn("app")
        migrate(url)
        yield url


def test_missing_pg_cron_names_the_preload_line_and_the_fallback(
    server_without_pg_cron: str,
) -> None:
    with pytest.raises(cron.PgCronMissing) as info:
        beat_sync(
            make_app({"e": {"task": "x.y", "schedule": 60}}), server_without_pg_cron, "pgskip"
        )
    message = str(info.value)
    assert "shared_preload_libraries = 'pg_cron'" in message
    assert "cron.database_name = 'postgres'" in message
    assert "CREATE EXTENSION pg_cron" in message
    assert "pgskip tick" in message  # the fallback
    with psycopg.connect(server_without_pg_cron) as conn:
        assert conn.execute("SELECT count(*) FROM pgskip.beat_entries").fetchone() == (0,)
    # The fallback works: store without pg_cron, fire from outside.
    result = beat_sync(
        make_app({"e": {"task": "x.y", "schedule": 60}}), server_without_pg_cron, "pgskip",
        use_cron=False,
    )  # fmt: skip
    assert [c.sign for c in result.changes] == ["+"]
    with psycopg.connect(server_without_pg_cron, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pgskip.fire_due(%s)", (datetime.now(timezone.utc).replace(year=2100),)
        ).fetchone()
    # 'latest': the missed slots (all of them until 2100) collapse; those within the grace
    # period and the coming minute fire.
    assert row is not None and 1 <= row[0] <= 4
