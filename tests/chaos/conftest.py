"""Chaos fixtures: a broker database, the per-run task log and the figures report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.pgbouncer import PgBouncer
from tests.chaos.support import report_path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def chaos_broker(db_url: str) -> str:
    return db_url.replace("postgresql://", "pgskip://", 1)


@pytest.fixture
def chaos_log(tmp_path: Path) -> Path:
    """The file the tasks append their start/finish lines to."""
    return tmp_path / "tasks.log"


@pytest.fixture(scope="session")
def chaos_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each scenario appends its figures: ``$PGSKIP_CHAOS_REPORT`` or a tmp file."""
    path = report_path(tmp_path_factory.getbasetemp() / "chaos-report.jsonl")
    print(f"chaos figures go to {path}")
    return path


#: Transport options for workers behind PgBouncer in transaction pooling (docs/reliability.md).
PGBOUNCER_OPTIONS = {
    "PGSKIP_OPT_LISTEN": "false",
    "PGSKIP_OPT_SYNCHRONOUS_ACKS": "true",
    "PGSKIP_OPT_PREPARED_STATEMENTS": "false",
    "PGSKIP_OPT_POLLING_INTERVAL": "0.5",
}


@pytest.fixture
def pgbouncer(pg_server_dsn: str) -> Iterator[PgBouncer]:
    """A running pgbouncer in transaction pooling mode in front of the session's server."""
    with PgBouncer(pg_server_dsn) as bouncer:
        yield bouncer
