"""kombu-pgskip's pytest plugin: throwaway migrated databases and a broker URL for the test
suites of applications that use kombu-pgskip (docs/testing.md).

pytest loads it through the ``pytest11`` entry point ``pgskip`` in every run where kombu-pgskip
is installed (``-p no:pgskip`` leaves it out; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set,
``-p pgskip`` loads it). It is a top-level module, not part of the ``kombu_pgskip`` package,
because importing that package imports kombu, Celery and psycopg: this module imports nothing
but pytest, and nothing starts until a test asks for one of its fixtures.

Fixtures (names start with ``pgskip_``, so they never collide with an application's own):

``pgskip_server`` (session)
    The :class:`~kombu_pgskip.testing.databases.ThrowawayServer`: an embedded PostgreSQL
    cluster started for the session, or the server ``PGSKIP_TEST_DSN`` names, on which
    databases of the plugin's own are created and dropped.
``pgskip_db_url``
    A fresh database with the schema migrated, for this test alone (``postgresql://...``):
    a copy of a template migrated once per session. Dropped after the test.
``pgskip_session_db_url`` (session)
    One migrated database for the whole session: the one ``pgskip_broker_url`` points at.
``pgskip_broker_url`` (session)
    ``pgskip://...`` for ``pgskip_session_db_url``, for Celery's ``broker_url``.
``pgskip_celery_config`` (session)
    ``{"broker_url": pgskip_broker_url, "result_backend": "cache+memory://"}``, for
    ``celery.contrib.pytest``'s ``celery_config`` fixture.

Settings (an environment variable wins over the ini option):

``PGSKIP_TEST_DSN`` / ini ``pgskip_test_dsn``
    ``postgresql://user:password@host:5432/postgres`` of an existing server and a role that may
    create databases; without it an embedded cluster is started (``initdb``, ``pg_ctl``:
    PostgreSQL's server binaries, found as :mod:`kombu_pgskip.testing.embedded` says).
``PGSKIP_TEST_PG_CRON`` / ini ``pgskip_pg_cron``
    ``1``/``true``: the embedded cluster preloads pg_cron (``cron.database_name = 'postgres'``);
    off by default.
``PGSKIP_TEST_KEEP`` / ini ``pgskip_keep`` / ``--pgskip-keep``
    Keep the databases, and the embedded cluster running, after the session; the summary at
    the end of the run says where they are and how to remove them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kombu_pgskip.testing.databases import ThrowawayServer

#: The lines the summary prints about what was kept (``--pgskip-keep``).
_KEPT = pytest.StashKey[list[str]]()

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pgskip", "kombu-pgskip test databases (docs/testing.md)")
    group.addoption(
        "--pgskip-keep",
        action="store_true",
        default=None,
        help="Keep the test databases, and the embedded PostgreSQL running, after the session "
        "(env PGSKIP_TEST_KEEP, ini pgskip_keep).",
    )
    parser.addini(
        "pgskip_test_dsn",
        "URL of an existing PostgreSQL server whose role may create databases; the "
        "environment variable PGSKIP_TEST_DSN wins (default: an embedded cluster).",
        default="",
    )
    parser.addini(
        "pgskip_pg_cron",
        "Preload pg_cron in the embedded cluster (env PGSKIP_TEST_PG_CRON wins).",
        type="bool",
        default=False,
    )
    parser.addini(
        "pgskip_keep",
        "Keep the test databases and the embedded cluster after the session "
        "(env PGSKIP_TEST_KEEP and --pgskip-keep win).",
        type="bool",
        default=False,
    )


def _flag(config: pytest.Config, env: str, ini: str) -> bool:
    value = os.environ.get(env)
    if value is None:
        return bool(config.getini(ini))
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise pytest.UsageError(f"{env}={value!r}: expected 1 or 0 (true, false, yes, no, on, off)")


@pytest.fixture(scope="session")
def pgskip_server(request: pytest.FixtureRequest) -> Iterator[ThrowawayServer]:
    """Where the throwaway databases live: an embedded cluster, or ``PGSKIP_TEST_DSN``'s
    server. Started when a test first asks for it; stopped (or kept) after the session."""
    from kombu_pgskip.testing.databases import ThrowawayServer

    config = request.config
    keep = config.getoption("pgskip_keep")
    if keep is None:
        keep = _flag(config, "PGSKIP_TEST_KEEP", "pgskip_keep")
    url = os.environ.get("PGSKIP_TEST_DSN") or str(config.getini("pgskip_test_dsn")) or None
    try:
        server = ThrowawayServer.start(
            url, pg_cron=_flag(config, "PGSKIP_TEST_PG_CRON", "pgskip_pg_cron"), keep=keep
        )
    except (RuntimeError, ValueError) as exc:
        pytest.fail(f"kombu-pgskip's test server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        kept = server.close()
        if kept:
            config.stash.setdefault(_KEPT, []).extend(kept)


@pytest.fixture
def pgskip_db_url(pgskip_server: ThrowawayServer) -> Iterator[str]:
    """A fresh database with the schema migrated, this test's alone: ``postgresql://...``."""
    url = pgskip_server.create_database()
    try:
        yield url
    finally:
        pgskip_server.drop_database(url)


@pytest.fixture(scope="session")
def pgskip_session_db_url(pgskip_server: ThrowawayServer) -> Iterator[str]:
    """One migrated database for the session (``postgresql://...``); its messages stay from
    one test to the next."""
    url = pgskip_server.create_database()
    try:
        yield url
    finally:
        pgskip_server.drop_database(url)


@pytest.fixture(scope="session")
def pgskip_broker_url(pgskip_session_db_url: str) -> str:
    """``pgskip://...`` of ``pgskip_session_db_url``, for Celery's ``broker_url``."""
    from kombu_pgskip.testing.databases import broker_url

    return broker_url(pgskip_session_db_url)


@pytest.fixture(scope="session")
def pgskip_celery_config(pgskip_broker_url: str) -> dict[str, Any]:
    """Celery settings for ``celery.contrib.pytest``'s ``celery_config``: the broker URL, and
    the in-memory result backend an in-process worker (``celery_worker``, ``start_worker``)
    shares with the test."""
    return {"broker_url": pgskip_broker_url, "result_backend": "cache+memory://"}


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in config.stash.get(_KEPT, []):
        terminalreporter.write_line(line)
