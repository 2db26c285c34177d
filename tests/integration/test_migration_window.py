"""Rolling deploys: which code runs against which schema (the window), and a runner that applies
each migration in a transaction of its own with a lock_timeout, retries a lock not granted,
replaces an INVALID index, and plans without changing anything.

The runner tests use migrations of their own (``migrate(..., directory=...)``) in a schema of
their own; the window's headers are also checked on the migrations this package ships.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from kombu_pgskip import exceptions
from kombu_pgskip.cli import pgskip
from kombu_pgskip.migrate import (
    Applied,
    Migration,
    MigrationLockTimeout,
    check_schema,
    compatible_range,
    latest_version,
    load_migrations,
    migrate,
    plan,
    require_version,
    window_floor,
)
from tests.helpers import REPO_ROOT

SCHEMA = "win"

#: compatible-with of each migration this package shipped before the window existed: the
#: previous version where the file keeps that code working, its own version where it breaks it
#: (0004 drops the insert trigger older publishers relied on to wake workers; 0012 revokes the
#: UPDATE on queues, exchanges and bindings that older declarations need; 0014 drops the polling
#: flag, consumer_queues and the routing epoch that older code reads). An additive file reaches
#: back to the newest breaking one before it.
SHIPPED_CLAIMS = {
    1: 1, 2: 1, 3: 1, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4, 9: 4, 10: 4, 11: 4, 12: 12, 13: 12,
    14: 14, 15: 14,
}  # fmt: skip


def write(directory: Path, version: int, name: str, body: str, compat: int | None) -> None:
    header = "" if compat is None else f"-- pgskip: compatible-with {compat:04d}\n"
    (directory / f"{version:04d}_{name}.sql").write_text(f"{header}-- {name}\n{body}\n")


@pytest.fixture
def code(tmp_path: Path) -> Iterator[Path]:
    """A migrations directory: 0001 makes the schema's jobs table."""
    directory = tmp_path / "migrations"
    directory.mkdir()
    write(
        directory,
        1,
        "initial",
        "CREATE TABLE jobs (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text);",
        1,
    )
    yield directory


def versions(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [
            int(r[0]) for r in conn.execute(f"SELECT version FROM {SCHEMA}.migrations ORDER BY 1")
        ]


def holder(url: str, mode: str = "ACCESS SHARE") -> psycopg.Connection[tuple[object, ...]]:
    """A session in a transaction that holds ``mode`` on jobs, as a long transaction that read
    the table does."""
    conn = psycopg.connect(url)
    conn.execute(f"LOCK TABLE {SCHEMA}.jobs IN {mode} MODE")
    return conn


# -- the headers ----------------------------------------------------------------------------------


def test_every_shipped_migration_says_which_code_it_keeps_working() -> None:
    migrations = load_migrations()
    undeclared = [m.label for m in migrations if not m.declared]
    assert not undeclared, (
        f"{undeclared}: every migration needs a `-- pgskip: compatible-with NNNN` line (the "
        "oldest schema version whose code keeps working against it; its own version if it "
        "breaks older code): docs/operations.md, Migrations and rolling deploys"
    )
    assert {m.version: m.compatible_with for m in migrations if m.version in SHIPPED_CLAIMS} == (
        SHIPPED_CLAIMS
    )
    assert compatible_range(15) == (14, 15)
    assert compatible_range(14) == (14, 14)
    assert compatible_range(13) == (12, 13)
    assert compatible_range(11) == (4, 11)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def test_the_headers_leave_the_checksums_of_applied_migrations_as_they_were() -> None:
    """The directive lines are not part of a checksum: an install that applied a file before
    its header was added does not see it as changed."""
    introduced = _git(
        "log", "--format=%H", "-S-- pgskip: compatible-with", "--", "migrations/0001_initial.sql"
    ).split()
    before_headers = f"{introduced[-1]}^" if introduced else "HEAD"
    before = {}
    for path in _git("ls-tree", "--name-only", before_headers, "migrations/").split():
        if re.fullmatch(r"migrations/\d{4}_\w+\.sql", path):
            text = _git("show", f"{before_headers}:{path}")
            assert "-- pgskip:" not in text
            before[int(Path(path).name[:4])] = text
    assert 1 in before
    for m in load_migrations():
        if m.version in before:
            assert m.sql != before[m.version]
            assert m.checksum == Migration(m.version, m.name, before[m.version]).checksum


def test_malformed_directives_are_refused(tmp_path: Path) -> None:
    cases = {
        "unknown directive": "-- pgskip: compatible 0001\nSELECT 1;",
        "more than one": "-- pgskip: compatible-with 0001\n-- pgskip: compatible-with 0001\n",
        "must name a version": "-- pgskip: compatible-with 0003\nSELECT 1;",
        "holds only": "-- pgskip: concurrently\nCREATE INDEX i ON jobs (note);\nSELECT 1;",
    }
    for i, (message, text) in enumerate(cases.items()):
        directory = tmp_path / str(i)
        directory.mkdir()
        (directory / "0002_bad.sql").write_text(text)
        with pytest.raises(exceptions.MigrationError, match=message):
            load_migrations(directory)


def test_a_file_without_the_header_is_taken_as_breaking_every_older_release(
    tmp_path: Path,
) -> None:
    write(tmp_path, 1, "a", "SELECT 1;", 1)
    write(tmp_path, 2, "b", "SELECT 1;", None)
    (second,) = load_migrations(tmp_path)[1:]
    assert not second.declared and second.compatible_with == 2
    assert compatible_range(directory=tmp_path) == (2, 2)


def test_window_floor() -> None:
    # Each claim: the oldest schema version whose code keeps working against that migration.
    additive = {1: 1, 2: 1, 3: 1, 4: 1}
    assert window_floor(4, additive) == 1
    assert window_floor(4, {**additive, 3: 3}) == 3  # 3 breaks code built for 1 and 2
    assert window_floor(4, {**additive, 4: 4}) == 4
    assert window_floor(4, {**additive, 4: 3}) == 3
    assert window_floor(4, {**additive, 3: None}) == 3  # recorded without a claim
    assert window_floor(15, {10: 4, 15: 11}) == 11  # versions missing in between
    assert window_floor(0, {}) == 0


# -- the window as the code applies it ------------------------------------------------------------


def test_code_runs_against_its_own_schema_and_newer_ones_inside_the_window(code: Path) -> None:
    write(code, 2, "two", "SELECT 1;", 1)  # code built for 0002
    rows = [Applied(1, "initial", "", 1), Applied(2, "two", "", 1)]

    def newer(*claims: tuple[int, int | None]) -> list[Applied]:
        return rows + [Applied(v, f"m{v}", "", c) for v, c in claims]

    assert require_version(SCHEMA, 2, applied=rows, directory=code) == 2
    assert require_version(SCHEMA, 4, applied=newer((3, 2), (4, 1)), directory=code) == 4

    with pytest.raises(exceptions.SchemaTooNew) as info:
        require_version(SCHEMA, 4, applied=newer((3, 2), (4, 3)), directory=code)
    assert "0004_m4 needs code built for schema 0003 or later" in str(info.value)
    assert "release built for schema 0003 or later" in str(info.value)
    assert info.value.context == {"migration": "0004_m4", "needs": 3}

    with pytest.raises(exceptions.SchemaTooNew, match="0003_m3 was recorded without"):
        require_version(SCHEMA, 3, applied=newer((3, None)), directory=code)
    # Without the recorded claims (the caller's connection of apply_async_in), newer is refused.
    with pytest.raises(exceptions.SchemaTooNew, match="upgrade the kombu-pgskip package"):
        require_version(SCHEMA, 3, directory=code)

    with pytest.raises(exceptions.SchemaOutdated) as outdated:
        require_version(SCHEMA, 1, applied=rows[:1], directory=code)
    assert "pgskip migrate" in str(outdated.value)
    assert "code built for schema 0001 keeps working" in str(outdated.value)
    write(code, 3, "three", "SELECT 1;", 3)
    with pytest.raises(
        exceptions.SchemaOutdated, match="0003_three stops code built for schema 0002"
    ):
        require_version(SCHEMA, 2, applied=rows, directory=code)
    with pytest.raises(exceptions.SchemaNotInstalled):
        require_version(SCHEMA, 0, applied=[], directory=code)


def test_check_schema_reads_newer_migrations_claims_from_the_database(
    code: Path, tmp_path: Path, empty_db_url: str
) -> None:
    """Code built for 0001 does not ship 0002 or 0003: it learns what they keep working from
    the rows the newer release's runner wrote."""
    newer = tmp_path / "newer"
    newer.mkdir()
    for m in load_migrations(code):
        (newer / f"{m.label}.sql").write_text(m.sql)
    write(newer, 2, "note_index", "CREATE INDEX jobs_note ON jobs (note);", 1)
    migrate(empty_db_url, schema=SCHEMA, directory=newer)
    with psycopg.connect(empty_db_url) as conn:
        assert check_schema(conn, SCHEMA, directory=code) == 2  # type: ignore[arg-type]
        assert check_schema(conn, SCHEMA, directory=newer) == 2  # type: ignore[arg-type]
    write(newer, 3, "drop_note", "ALTER TABLE jobs DROP COLUMN note;", 3)
    migrate(empty_db_url, schema=SCHEMA, directory=newer)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        with pytest.raises(exceptions.SchemaTooNew, match="0003_drop_note needs code built"):
            check_schema(conn, SCHEMA, directory=code)  # type: ignore[arg-type]
        # A table as a runner before the window made it: no claims, so nothing newer is trusted.
        conn.execute(f"ALTER TABLE {SCHEMA}.migrations DROP COLUMN compatible_with")
        conn.execute(f"DELETE FROM {SCHEMA}.migrations WHERE version = 3")
        with pytest.raises(exceptions.SchemaTooNew, match="0002_note_index was recorded without"):
            check_schema(conn, SCHEMA, directory=code)  # type: ignore[arg-type]


def test_the_runner_records_claims_and_a_newer_release_corrects_them(
    code: Path, tmp_path: Path, empty_db_url: str
) -> None:
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:  # as a runner before the window
        conn.execute(f"ALTER TABLE {SCHEMA}.migrations DROP COLUMN compatible_with")
    write(code, 2, "two", "SELECT 1;", 1)
    assert migrate(empty_db_url, schema=SCHEMA, directory=code) == ["0002_two"]
    query = f"SELECT version, compatible_with FROM {SCHEMA}.migrations ORDER BY 1"
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute(query).fetchall() == [(1, 1), (2, 1)]
    # A newer release says 0002 breaks code built for 0001 after all: its header changed, not
    # its checksum.
    newer = tmp_path / "newer"
    newer.mkdir()
    write(newer, 1, "initial", (code / "0001_initial.sql").read_text().split("\n", 2)[2], 1)
    write(newer, 2, "two", "SELECT 1;", 2)
    write(newer, 3, "three", "SELECT 1;", 2)
    assert migrate(empty_db_url, schema=SCHEMA, directory=newer) == ["0003_three"]
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute(query).fetchall() == [(1, 1), (2, 2), (3, 2)]
    # The older release's runner (a rollback's deploy job) leaves the correction alone.
    assert migrate(empty_db_url, schema=SCHEMA, directory=code) == []
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute(query).fetchall() == [(1, 1), (2, 2), (3, 2)]


def test_the_package_runs_against_the_schema_it_migrated(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        assert check_schema(conn, "pgskip") == latest_version()  # type: ignore[arg-type]
        rows = conn.execute("SELECT version, compatible_with FROM pgskip.migrations").fetchall()
    assert dict(rows) == {m.version: m.compatible_with for m in load_migrations()}


# -- one transaction per file ---------------------------------------------------------------------


def test_each_file_runs_in_a_transaction_of_its_own(code: Path, empty_db_url: str) -> None:
    write(code, 2, "lock_jobs", "ALTER TABLE jobs ADD COLUMN two text;", 1)
    # Fails if 0002's ACCESS EXCLUSIVE lock on jobs were still held by this session.
    write(
        code,
        3,
        "check_the_lock_is_gone",
        "DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()"
        " AND relation = 'jobs'::regclass AND mode = 'AccessExclusiveLock') THEN"
        " RAISE EXCEPTION 'still held'; END IF; END $$;",
        1,
    )
    write(code, 4, "fails", "CREATE TABLE four (x int);\nSELECT 1 / 0;", 1)
    write(code, 5, "never", "CREATE TABLE five (x int);", 1)
    with pytest.raises(exceptions.MigrationError) as info:
        migrate(empty_db_url, schema=SCHEMA, directory=code)
    message = str(info.value)
    assert "migration 0004_fails failed and was not applied" in message
    assert "0001_initial, 0002_lock_jobs, 0003_check_the_lock_is_gone were applied" in message
    assert "0005_never did not run" in message and "division by zero" in message
    assert versions(empty_db_url) == [1, 2, 3]
    with psycopg.connect(empty_db_url) as conn:
        xids = conn.execute(f"SELECT DISTINCT xmin::text FROM {SCHEMA}.migrations").fetchall()
        assert len(xids) == 3  # three transactions
        for table in ("four", "five"):
            found = conn.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.{table}",)).fetchone()
            assert found == (None,)


# -- lock_timeout and retries ---------------------------------------------------------------------


def test_a_lock_not_granted_is_retried_and_writers_do_not_queue_behind_it(
    code: Path, empty_db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    write(code, 2, "add_column", "ALTER TABLE jobs ADD COLUMN delivery bigint;", 1)
    long_transaction = holder(empty_db_url)
    result: list[object] = []
    caplog.set_level(logging.WARNING, logger="kombu_pgskip.migrate")

    def run() -> None:
        try:
            result.append(
                migrate(
                    empty_db_url,
                    schema=SCHEMA,
                    directory=code,
                    lock_timeout=0.3,
                    retries=30,
                    backoff=0.1,
                )
            )
        except BaseException as exc:  # pragma: no cover - reported below
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # While the migration waits for the long transaction, a worker's insert waits at most
        # one lock_timeout behind it (without one, it would wait for the long transaction too).
        with psycopg.connect(empty_db_url, autocommit=True) as worker:
            for _ in range(5):
                started = time.monotonic()
                worker.execute(f"INSERT INTO {SCHEMA}.jobs (note) VALUES ('x')")
                assert time.monotonic() - started < 1.5
                time.sleep(0.1)
        assert thread.is_alive() and versions(empty_db_url) == [1]
    finally:
        long_transaction.close()  # the long transaction ends
    thread.join(timeout=30)
    assert result == [["0002_add_column"]]
    assert versions(empty_db_url) == [1, 2]
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retries and all("0002_add_column: a lock was not granted" in r for r in retries)
    assert "retry 1 of 30" in retries[0]


def test_a_lock_never_granted_fails_clearly_after_the_retries(
    code: Path, empty_db_url: str
) -> None:
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    write(code, 2, "other_table", "CREATE TABLE two (x int);", 1)
    write(code, 3, "add_column", "ALTER TABLE jobs ADD COLUMN delivery bigint;", 1)
    write(code, 4, "after", "CREATE TABLE four (x int);", 1)
    long_transaction = holder(empty_db_url)
    try:
        pid = long_transaction.info.backend_pid
        started = time.monotonic()
        with pytest.raises(MigrationLockTimeout) as info:
            migrate(
                empty_db_url,
                schema=SCHEMA,
                directory=code,
                lock_timeout=0.1,
                retries=2,
                backoff=0.05,
            )
        assert time.monotonic() - started < 5
    finally:
        long_transaction.close()
    message = str(info.value)
    assert "migration 0003_add_column failed and was not applied" in message
    assert "0002_other_table were applied" in message and "0004_after did not run" in message
    assert "not granted within lock_timeout 100ms in 3 attempts" in message
    assert f"sessions holding locks on jobs: pid {pid} (idle in transaction" in message
    assert "--lock-timeout" in message
    assert isinstance(info.value, exceptions.MigrationError)
    assert versions(empty_db_url) == [1, 2]
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute(f"SELECT to_regclass('{SCHEMA}.four')").fetchone() == (None,)
    assert migrate(empty_db_url, schema=SCHEMA, directory=code) == ["0003_add_column", "0004_after"]


# -- INVALID indexes and concurrent builds --------------------------------------------------------


BY_NOTE_CONCURRENTLY = "-- pgskip: concurrently\nCREATE INDEX jobs_by_note ON jobs (note);"


def leave_invalid_index(url: str, name: str) -> None:
    """An interrupted CREATE INDEX CONCURRENTLY: a unique build over duplicates fails and leaves
    an INVALID index of that name."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {SCHEMA}.jobs (note) VALUES ('dup'), ('dup')")
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON {SCHEMA}.jobs (note)")


def index_state(url: str, name: str) -> tuple[bool, bool] | None:
    """(valid, unique) of the index, None when there is none."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT i.indisvalid, i.indisunique FROM pg_index AS i"
            " WHERE i.indexrelid = to_regclass(%s)",
            (f"{SCHEMA}.{name}",),
        ).fetchone()
    return None if row is None else (bool(row[0]), bool(row[1]))


def test_an_index_marked_concurrently_replaces_an_invalid_leftover(
    code: Path, empty_db_url: str
) -> None:
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    leave_invalid_index(empty_db_url, "jobs_by_note")
    assert index_state(empty_db_url, "jobs_by_note") == (False, True)
    write(
        code,
        2,
        "jobs_by_note",
        "-- pgskip: concurrently\nCREATE INDEX jobs_by_note ON jobs (note);\n"
        "-- pgskip: concurrently\nCREATE INDEX jobs_by_id ON jobs (id, note);",
        1,
    )
    lines = "\n".join(plan(empty_db_url, schema=SCHEMA, directory=code).lines())
    assert "0002_jobs_by_note  (outside a transaction, CREATE INDEX CONCURRENTLY" in lines
    assert "first DROP INDEX CONCURRENTLY jobs_by_note: an INVALID index" in lines
    assert "CREATE INDEX CONCURRENTLY jobs_by_note ON jobs (note)" in lines
    assert "SHARE UPDATE EXCLUSIVE on jobs (reads and writes go on)" in lines
    # A transaction writing to jobs for longer than lock_timeout: the build waits for it, and
    # new writes go on meanwhile.
    with psycopg.connect(empty_db_url) as writer:
        writer.execute(f"INSERT INTO {SCHEMA}.jobs (note) VALUES ('during')")
        done: list[object] = []
        thread = threading.Thread(
            target=lambda: done.append(
                migrate(empty_db_url, schema=SCHEMA, directory=code, lock_timeout=0.2, retries=0)
            )
        )
        thread.start()
        with psycopg.connect(empty_db_url, autocommit=True) as other:
            for _ in range(5):
                started = time.monotonic()
                other.execute(f"INSERT INTO {SCHEMA}.jobs (note) VALUES ('x')")
                assert time.monotonic() - started < 0.5
                time.sleep(0.1)
        assert thread.is_alive()
        writer.commit()
        thread.join(timeout=30)
    assert done == [["0002_jobs_by_note"]]
    assert index_state(empty_db_url, "jobs_by_note") == (True, False)
    assert index_state(empty_db_url, "jobs_by_id") == (True, False)


def test_a_concurrent_build_queued_for_its_lock_does_not_hold_up_writers(
    code: Path, empty_db_url: str
) -> None:
    """Its request (SHARE UPDATE EXCLUSIVE) waits behind a conflicting lock (a manual VACUUM or
    ANALYZE holds the same) without a lock_timeout, and writes are not queued behind it."""
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    write(code, 2, "jobs_by_note", BY_NOTE_CONCURRENTLY, 1)
    long_transaction = holder(empty_db_url, "SHARE UPDATE EXCLUSIVE")
    result: list[object] = []
    thread = threading.Thread(
        target=lambda: result.append(
            migrate(empty_db_url, schema=SCHEMA, directory=code, lock_timeout=0.2, retries=0)
        )
    )
    thread.start()
    try:
        with psycopg.connect(empty_db_url, autocommit=True) as worker:
            for _ in range(5):
                started = time.monotonic()
                worker.execute(f"INSERT INTO {SCHEMA}.jobs (note) VALUES ('x')")
                assert time.monotonic() - started < 0.5
                time.sleep(0.1)
        assert thread.is_alive() and index_state(empty_db_url, "jobs_by_note") is None
    finally:
        long_transaction.close()
    thread.join(timeout=30)
    assert result == [["0002_jobs_by_note"]]
    assert index_state(empty_db_url, "jobs_by_note") == (True, False)


def test_create_index_if_not_exists_in_a_transaction_replaces_an_invalid_leftover(
    code: Path, empty_db_url: str
) -> None:
    """Without the runner, IF NOT EXISTS would keep the INVALID index (migration 0006 asks
    operators to build its index concurrently beforehand)."""
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    leave_invalid_index(empty_db_url, "jobs_by_note")
    write(code, 2, "jobs_by_note", "CREATE INDEX IF NOT EXISTS jobs_by_note ON jobs (note);", 1)
    assert migrate(empty_db_url, schema=SCHEMA, directory=code) == ["0002_jobs_by_note"]
    assert index_state(empty_db_url, "jobs_by_note") == (True, False)


def test_create_index_concurrently_without_the_marker_is_refused_before_it_runs(
    code: Path, empty_db_url: str
) -> None:
    write(code, 2, "by_note", "CREATE INDEX CONCURRENTLY jobs_by_note ON jobs (note);", 1)
    with pytest.raises(exceptions.MigrationError, match="mark it with `-- pgskip: concurrently`"):
        migrate(empty_db_url, schema=SCHEMA, directory=code)
    assert versions(empty_db_url) == [1]


def test_a_valid_index_of_that_name_is_kept(code: Path, empty_db_url: str) -> None:
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(f"CREATE UNIQUE INDEX jobs_by_note ON {SCHEMA}.jobs (note)")
    write(code, 2, "jobs_by_note", BY_NOTE_CONCURRENTLY, 1)
    assert migrate(empty_db_url, schema=SCHEMA, directory=code) == ["0002_jobs_by_note"]
    assert index_state(empty_db_url, "jobs_by_note") == (True, True)


# -- the plan -------------------------------------------------------------------------------------


def test_plan_lists_locks_and_compatibility_and_changes_nothing(
    code: Path, empty_db_url: str
) -> None:
    write(
        code, 2, "functions", "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;", 1
    )
    migrate(empty_db_url, schema=SCHEMA, directory=code)
    write(code, 3, "add_column", "ALTER TABLE jobs ADD COLUMN delivery bigint;", 2)
    write(
        code,
        4,
        "by_delivery",
        "-- pgskip: concurrently\nCREATE INDEX jobs_by_delivery ON jobs (delivery);",
        3,
    )
    write(
        code,
        5,
        "drop_note",
        "CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 2 $$;\n"
        "ALTER TABLE jobs DROP COLUMN note;\n"
        "DO $$ BEGIN EXECUTE format('GRANT SELECT ON jobs TO %I', current_user); END $$;",
        5,
    )
    lines = plan(empty_db_url, schema=SCHEMA, directory=code, lock_timeout=2, retries=4).lines()

    def row(statement: str, locks: str) -> str:
        return f"    {statement:<58}  {locks}"

    assert lines == [
        f"schema {SCHEMA!r} at 0002 (code built for schema 0001 to 0002 runs against it); "
        "this kombu-pgskip is built for 0005",
        "3 migration(s) to run, each file on its own (lock_timeout 2s, up to 4 retries when a "
        "lock is not granted):",
        "0003_add_column  (one transaction)",
        row(
            "ALTER TABLE jobs ADD COLUMN delivery bigint",
            "ACCESS EXCLUSIVE on jobs (blocks reads and writes)",
        ),
        "    compatible with code built for schema 0002 and later: BREAKS running code built "
        "for schema 0001: stop or upgrade it before this step",
        "0004_by_delivery  (outside a transaction, CREATE INDEX CONCURRENTLY without "
        "lock_timeout: it waits for the transactions open on the table)",
        row(
            "CREATE INDEX CONCURRENTLY jobs_by_delivery ON jobs (del...",
            "SHARE UPDATE EXCLUSIVE on jobs (reads and writes go on); built concurrently",
        ),
        "    compatible with code built for schema 0003 and later: BREAKS the running code "
        "(built for schema 0002): stop it before this step",
        "0005_drop_note  (one transaction)",
        row("CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql...", "no table lock"),
        row(
            "ALTER TABLE jobs DROP COLUMN note",
            "ACCESS EXCLUSIVE on jobs (blocks reads and writes)",
        ),
        row(
            "DO $$ BEGIN EXECUTE format('GRANT SELECT ON jobs TO %I'...",
            "no table lock (DO block: GRANT SELECT)",
        ),
        "    compatible with code built for schema 0005 and later: (the running code was "
        "stopped for an earlier step)",
        "afterwards: schema at 0005; code built for schema 0005 runs against it",
    ]
    assert versions(empty_db_url) == [1, 2]
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute(f"SELECT to_regclass('{SCHEMA}.jobs_by_delivery')").fetchone() == (
            None,
        )


def test_migrate_plan_on_both_entry_points(db_url: str) -> None:
    """``python -m kombu_pgskip migrate --plan`` and the click group ``celery -A proj pgskip``
    runs: the newest migration, as if it were pending, with its locks and its verdict."""
    newest = load_migrations()[-1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("DELETE FROM pgskip.migrations WHERE version = %s", (newest.version,))
    done = subprocess.run(
        [sys.executable, "-m", "kombu_pgskip", "migrate", "--plan", "--url", db_url],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "the plan (nothing is changed)" in out
    assert f"schema 'pgskip' at {newest.version - 1:04d}" in out
    how = "one transaction"
    if newest.concurrent:
        how = "outside a transaction, CREATE INDEX CONCURRENTLY"
    assert f"\n{newest.label}  ({how}" in out
    assert f"compatible with code built for schema {newest.compatible_with:04d}" in out
    assert f"afterwards: schema at {newest.version:04d}" in out
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT max(version) FROM pgskip.migrations").fetchone() == (
            newest.version - 1,
        )
    runner = CliRunner()
    result = runner.invoke(pgskip, ["migrate", "--plan", "--lock-timeout", "1.5", "--url", db_url])
    assert result.exit_code == 0, result.output
    assert "lock_timeout 1.5s, up to 5 retries" in result.output
    refused = runner.invoke(pgskip, ["migrate", "--plan", "--dry-run", "--url", db_url])
    assert refused.exit_code == 2 and "choose one" in refused.output


def test_status_says_which_code_runs_against_the_schema(db_url: str) -> None:
    result = CliRunner().invoke(pgskip, ["status", "--url", db_url])
    assert result.exit_code == 0, result.output
    low, high = compatible_range()
    span = f"{low:04d} to {high:04d}" if low < high else f"{high:04d}"
    assert result.output.splitlines()[-1] == (
        f"schema 'pgskip' at version {high:04d}: code built for schema {span} runs against it; "
        f"this kombu-pgskip is built for {latest_version():04d}"
    )


@pytest.mark.parametrize("compat_back", [True, False], ids=["compatible", "breaking"])
def test_apply_async_in_runs_against_a_newer_schema_inside_the_window(
    db_url: str, compat_back: bool
) -> None:
    """A web process enqueuing in its own transaction (``apply_async_in``) accepts a newer
    schema when every migration since its own says it keeps working, as workers do."""
    from celery import Celery

    from kombu_pgskip import apply_async_in
    from kombu_pgskip.migrate import latest_version

    built_for = latest_version()
    newer = built_for + 1
    app = Celery("window", broker=db_url.replace("postgresql://", "pgskip://", 1))
    with psycopg.connect(db_url, autocommit=True) as owner:
        owner.execute(
            "INSERT INTO pgskip.migrations (version, name, checksum, compatible_with)"
            " VALUES (%s, 'newer', 'x', %s)",
            (newer, built_for if compat_back else newer),
        )
        try:
            with psycopg.connect(db_url) as conn:
                if compat_back:
                    result = apply_async_in(conn, app.signature("window.noop"))
                    conn.commit()
                    count = conn.execute(
                        "SELECT count(*) FROM pgskip.jobs WHERE task_id = %s", (result.id,)
                    ).fetchone()
                    assert count == (1,)
                else:
                    with pytest.raises(exceptions.SchemaTooNew, match=f"{newer:04d}_newer"):
                        apply_async_in(conn, app.signature("window.noop"))
        finally:
            owner.execute("DELETE FROM pgskip.migrations WHERE version = %s", (newer,))
