"""Acceptance fixtures: a broker database with the tasks' ``test_runs`` log table."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest

APPS_DIR = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "apps")


@pytest.fixture
def broker_url(db_url: str) -> str:
    import sys

    sys.path.insert(0, APPS_DIR)
    try:
        import taskapp
    finally:
        sys.path.remove(APPS_DIR)
    taskapp.ensure_table(db_url)
    return db_url.replace("postgresql://", "pgskip://", 1)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def runs(db_url: str, event: str | None = None) -> list[tuple[str, str, int, bool | None]]:
    """(key, event, pid, redelivered) rows logged by the tasks, in order."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT key, event, pid, redelivered FROM test_runs"
            " WHERE %(e)s::text IS NULL OR event = %(e)s ORDER BY id",
            {"e": event},
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]
