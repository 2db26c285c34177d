"""``migrate()`` on a connection of the caller's: psycopg 3, psycopg2 and Django's.

The run takes the connection as it finds it (no transaction open) and leaves it so: open, in
its own autocommit mode, with its own ``search_path`` and ``lock_timeout``, and without the
runner's advisory lock. The index of 0017 is built concurrently through each driver.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import pytest

from kombu_pgskip import exceptions
from kombu_pgskip.migrate import (
    MigrationLockTimeout,
    check_schema,
    latest_version,
    load_migrations,
    migrate,
)
from tests.helpers import REPO_ROOT
from tests.publish_support import _django_setup, django_database

ALL = [m.label for m in load_migrations()]


def session_state(conn: Any) -> tuple[Any, ...]:
    """(search_path, lock_timeout, advisory locks held) of a psycopg 3 or psycopg2 session."""
    cur = conn.cursor()
    cur.execute(
        "SELECT current_setting('search_path'), current_setting('lock_timeout'),"
        " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        "   AND pid = pg_backend_pid())"
    )
    row = cur.fetchone()
    cur.close()
    return tuple(row)


def installed_version(url: str, schema: str = "pgskip") -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return check_schema(conn, schema)


def test_a_psycopg_connection_gets_the_schema_and_is_left_as_it_was(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url) as conn:
        conn.execute("SET search_path TO public")
        conn.execute("SET lock_timeout TO '7s'")
        conn.commit()
        before = session_state(conn)
        conn.rollback()

        assert [b.split("\n")[0] for b in migrate(conn, dry_run=True)] == [f"-- {x}" for x in ALL]
        assert migrate(conn) == ALL
        assert migrate(conn) == []

        assert not conn.closed and conn.autocommit is False
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert session_state(conn) == before == ("public", "7s", 0)
    assert installed_version(empty_db_url) == latest_version()


def test_a_psycopg2_connection_gets_the_schema_and_is_left_as_it_was(empty_db_url: str) -> None:
    conn = psycopg2.connect(empty_db_url)
    try:
        conn.autocommit = True
        conn.cursor().execute("SET search_path TO public")
        before = session_state(conn)

        assert migrate(conn, schema="Queue Schema") == ALL
        assert migrate(conn, schema="Queue Schema") == []

        assert conn.closed == 0 and conn.autocommit is True
        assert session_state(conn) == before
        assert before[0] == "public" and before[2] == 0
    finally:
        conn.close()
    assert installed_version(empty_db_url, "Queue Schema") == latest_version()


def test_djangos_connection_gets_the_schema_and_stays_usable(empty_db_url: str) -> None:
    from django.db import connections

    with django_database(empty_db_url) as alias:
        connection = connections[alias]
        assert migrate(connection) == ALL
        assert migrate(connection) == []
        assert not connection.in_atomic_block and connection.get_autocommit()
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM pgskip.migrations")
            assert cur.fetchone() == (len(ALL),)
    assert installed_version(empty_db_url) == latest_version()


def test_a_schema_left_at_an_older_version_is_brought_to_the_newest(
    empty_db_url: str, tmp_path: Path
) -> None:
    for m in load_migrations()[:16]:
        shutil.copy(REPO_ROOT / "migrations" / f"{m.label}.sql", tmp_path)
    assert migrate(empty_db_url, directory=tmp_path) == ALL[:16]
    conn = psycopg2.connect(empty_db_url)
    try:
        assert migrate(conn) == ALL[16:]  # 0017 builds its index concurrently
    finally:
        conn.close()
    assert installed_version(empty_db_url) == latest_version()


def test_inside_djangos_atomic_block_it_refuses_and_changes_nothing(empty_db_url: str) -> None:
    from django.db import connections, transaction

    with (
        django_database(empty_db_url) as alias,
        transaction.atomic(using=alias),
        pytest.raises(exceptions.MigrationError, match=r"atomic = False"),
    ):
        migrate(connections[alias])
    with pytest.raises(exceptions.SchemaNotInstalled):
        installed_version(empty_db_url)


def test_inside_a_transaction_it_refuses_and_leaves_the_transaction_open(
    empty_db_url: str,
) -> None:
    with psycopg.connect(empty_db_url) as conn:
        conn.execute("CREATE TABLE mine (id int)")
        with pytest.raises(exceptions.MigrationError, match="commit or roll it back first"):
            migrate(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.commit()  # the caller's work is intact
        assert conn.execute("SELECT to_regclass('mine') IS NOT NULL").fetchone() == (True,)


def test_a_lock_not_granted_through_psycopg2_is_retried_then_reported(
    empty_db_url: str, tmp_path: Path
) -> None:
    (tmp_path / "0001_table.sql").write_text("CREATE TABLE t (id int);\n")
    (tmp_path / "0002_column.sql").write_text("ALTER TABLE t ADD COLUMN note text;\n")
    conn = psycopg2.connect(empty_db_url)
    try:
        conn.autocommit = True
        with contextlib.closing(_holder(empty_db_url)) as holder:
            migrate(conn, schema="locked", directory=_only(tmp_path, "0001_table.sql"))
            holder.execute("BEGIN")
            holder.execute('SELECT * FROM "locked".t')  # ACCESS SHARE until the holder ends
            with pytest.raises(MigrationLockTimeout, match="0002_column") as caught:
                migrate(conn, schema="locked", directory=tmp_path, lock_timeout=0.05, retries=1,
                        backoff=0.01)  # fmt: skip
            assert caught.value.context["attempts"] == 2
            assert isinstance(caught.value.__cause__, psycopg.errors.LockNotAvailable)
        assert session_state(conn)[2] == 0  # the runner's advisory lock is released
    finally:
        conn.close()


def _holder(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def _only(directory: Path, name: str) -> Path:
    subset = directory / "subset"
    subset.mkdir()
    shutil.copy(directory / name, subset)
    return subset


def test_a_django_database_that_is_not_postgresql_is_refused_by_name() -> None:
    _django_setup()  # settings without DATABASES: "default" is Django's dummy backend
    from django.db import connections

    with pytest.raises(exceptions.ConfigurationError) as caught:
        migrate(connections["default"])
    assert str(caught.value) == (
        "Django database 'default' uses the unknown backend: the pgskip schema lives in PostgreSQL"
    )


def test_an_object_that_is_not_a_connection_is_refused() -> None:
    with pytest.raises(TypeError, match=r"takes a URL, a psycopg 3 connection.*got builtins\.int"):
        migrate(42)
