"""The migration runner against a real server: applied once, recorded, locked, and checked."""

from __future__ import annotations

import threading

import psycopg
import pytest
from psycopg import sql

from kombu_pgskip import exceptions
from kombu_pgskip.migrate import check_schema, latest_version, load_migrations, migrate


def test_migrate_applies_every_file_once_and_records_versions(empty_db_url: str) -> None:
    applied = migrate(empty_db_url)
    assert applied == [m.label for m in load_migrations()]
    assert migrate(empty_db_url) == []
    with psycopg.connect(empty_db_url) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM pgskip.migrations ORDER BY 1")]
        assert versions == [m.version for m in load_migrations()]
        assert check_schema(conn, "pgskip") == latest_version()  # type: ignore[arg-type]


def test_migrated_schema_has_the_queue_table_tuned_for_churn(empty_db_url: str) -> None:
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url) as conn:
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'pgskip'")
        }
        assert {"jobs", "queues", "exchanges", "bindings", "consumers", "migrations"} <= tables
        # Every partition: the ring's slots and jobs_kept.
        parts = conn.execute(
            "SELECT c.relname, c.reloptions FROM pg_partition_tree('pgskip.jobs') AS t"
            " JOIN pg_class AS c ON c.oid = t.relid WHERE t.isleaf"
        ).fetchall()
        assert sorted(r[0] for r in parts) == ["jobs_" + str(k) for k in range(1, 9)] + [
            "jobs_kept"
        ]
        for _name, options in parts:
            assert "fillfactor=70" in options
            assert any(o.startswith("autovacuum_vacuum_scale_factor") for o in options)
        (indexdef,) = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'jobs_dequeue'"
        ).fetchone()  # type: ignore[misc]
        assert "(queue, priority DESC, run_at, id)" in indexdef
        assert "WHERE (status = 'pending'" in indexdef
        # The often-changing lease columns stay out of every index (HOT updates).
        indexed = " ".join(
            r[0] for r in conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'jobs'")
        )
        assert "locked_at" not in indexed and "attempts" not in indexed
        (indexdef,) = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'jobs_completed'"
        ).fetchone()  # type: ignore[misc]
        assert "(finished_at) WHERE (status = 'completed'" in indexdef


def test_dry_run_prints_sql_and_changes_nothing(empty_db_url: str) -> None:
    blocks = migrate(empty_db_url, dry_run=True)
    assert blocks and "CREATE TABLE jobs" in blocks[0]
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT to_regnamespace('pgskip')").fetchone() == (None,)


def test_concurrent_runners_apply_each_migration_once(empty_db_url: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(migrate(empty_db_url))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(len(r) for r in results) == [0, 0, len(load_migrations())]


def test_custom_schema_name(empty_db_url: str) -> None:
    migrate(empty_db_url, schema="Queue Schema")
    with psycopg.connect(empty_db_url) as conn:
        assert check_schema(conn, "Queue Schema") == latest_version()  # type: ignore[arg-type]
        with pytest.raises(exceptions.SchemaNotInstalled):
            check_schema(conn, "pgskip")  # type: ignore[arg-type]
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        # prune_in_batches() has the schema's name written into its body (migration 0007).
        conn.execute(
            'INSERT INTO "Queue Schema".jobs (queue, status, payload, finished_at)'
            " VALUES ('q', 'completed', '{}', now() - interval '2 days')"
        )
        row = conn.execute('CALL "Queue Schema".prune_in_batches()').fetchone()
        assert row == (1, 0, 0)


def test_the_longest_schema_name_works_and_a_longer_one_is_refused_before_anything(
    empty_db_url: str,
) -> None:
    """Its notification channel ``pgskip:<schema>:scheduled`` is a PostgreSQL identifier, at most
    63 bytes: a 46-byte schema name is the longest that still publishes and wakes workers."""
    from kombu import Connection, Queue

    from kombu_pgskip.store import MAX_SCHEMA_BYTES, Store

    longest, longer = "é" * (MAX_SCHEMA_BYTES // 2), "s" * (MAX_SCHEMA_BYTES + 1)
    assert len(longest.encode()) == MAX_SCHEMA_BYTES == 46
    migrate(empty_db_url, schema=longest)
    broker = empty_db_url.replace("postgresql://", "pgskip://", 1)
    with Connection(broker, transport_options={"schema": longest}) as conn:
        queue = Queue("q")(conn.channel())
        queue.declare()
        conn.default_channel.basic_publish(conn.default_channel.prepare_message("x"), "", "q")
        conn.default_channel.basic_publish(
            conn.default_channel.prepare_message("later", headers={"eta": "2100-01-01"}), "", "q"
        )  # a scheduled message: its due time goes out on the longer channel
        assert queue.get(no_ack=True).body == b"x"
    for refused in (
        lambda: migrate(empty_db_url, schema=longer),
        lambda: Store(empty_db_url, schema=longer),
        lambda: Connection(broker, transport_options={"schema": longer}).connect(),
    ):
        with pytest.raises(exceptions.ConfigurationError, match="1 to 46 bytes of UTF-8"):
            refused()
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT to_regnamespace(%s)", (longer,)).fetchone() == (None,)
        scheduled = sql.SQL("SELECT count(*) FROM {}.jobs WHERE status = 'scheduled'")
        assert conn.execute(scheduled.format(sql.Identifier(longest))).fetchone() == (1,)


def test_missing_schema_names_the_migrate_command(empty_db_url: str) -> None:
    with (
        psycopg.connect(empty_db_url) as conn,
        pytest.raises(exceptions.SchemaNotInstalled) as info,
    ):
        check_schema(conn, "pgskip")  # type: ignore[arg-type]
    assert "celery -A proj pgskip migrate" in str(info.value)


def test_outdated_schema_names_the_migrate_command(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgskip.migrations WHERE version = %s", (latest_version(),))
        if latest_version() == 1:
            with pytest.raises(exceptions.SchemaNotInstalled):
                check_schema(conn, "pgskip")  # type: ignore[arg-type]
        else:
            with pytest.raises(exceptions.SchemaOutdated, match="pgskip migrate"):
                check_schema(conn, "pgskip")  # type: ignore[arg-type]


def test_schema_newer_than_the_package_says_upgrade(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.migrations (version, name, checksum) VALUES (9999, 'future', 'x')"
        )
        with pytest.raises(exceptions.SchemaTooNew, match="upgrade"):
            check_schema(conn, "pgskip")  # type: ignore[arg-type]


def test_failed_migration_applies_nothing(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        # A conflicting object makes 0001 fail half-way.
        conn.execute("CREATE SCHEMA pgskip")
        conn.execute("CREATE TABLE pgskip.consumers (x int)")
    with pytest.raises(exceptions.MigrationError, match="nothing was applied"):
        migrate(empty_db_url)
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT to_regclass('pgskip.jobs')").fetchone() == (None,)
        assert conn.execute("SELECT to_regclass('pgskip.migrations')").fetchone() == (None,)


def test_a_schema_migrated_before_the_window_gets_its_claims_recorded(db_url: str) -> None:
    """A runner that predates ``compatible_with`` left no such column: the next run adds it and
    fills it from the files' headers, with nothing else to apply."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE pgskip.migrations DROP COLUMN compatible_with")
        assert check_schema(conn, "pgskip") == latest_version()  # type: ignore[arg-type]
    assert migrate(db_url) == []
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT version, compatible_with FROM pgskip.migrations").fetchall()
    assert dict(rows) == {m.version: m.compatible_with for m in load_migrations()}
