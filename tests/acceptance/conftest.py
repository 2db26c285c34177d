"""Acceptance fixtures: a broker database with the tasks' ``test_runs`` log table."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from celery import Celery

APPS_DIR = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "apps")


_DEMO_TEST = "test_demo_processes_exactly_the_committed_orders_and_fires_a_cron_tick"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At the first acceptance test, when the demo's test is to run too, start the demo in the
    background: it waits for pg_cron's minute tick, and so does ``test_cron_tick.py`` a few
    tests later; started early, the two waits overlap, and the demo's own start-up is done by
    the time they do."""
    from tests.demo_support import DEMO_RUN, DemoRun

    if DEMO_RUN in item.config.stash or not any(i.name == _DEMO_TEST for i in item.session.items):
        return
    item.config.stash[DEMO_RUN] = DemoRun()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A background demo whose test did not run (a failure with ``-x``): stop it."""
    from tests.demo_support import DEMO_RUN

    run = session.config.stash.get(DEMO_RUN, None)
    if run is not None:
        run.stop()


@pytest.fixture
def publisher(broker_url: str) -> Iterator[Celery]:
    """A Celery app that only publishes, to the queue ``default``."""
    app = Celery("publisher", broker=broker_url, set_as_current=False)
    app.conf.task_default_queue = "default"
    yield app
    app.close()


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


@pytest.fixture(scope="module")
def module_db_url(pg_server_dsn: str, template_db: str) -> Iterator[str]:
    """A migrated database shared by one test module (for modules that share a worker)."""
    from psycopg import sql

    from tests.helpers import make_url

    name = f"pgskip_mod_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_db)
            )
        )
    try:
        yield make_url(pg_server_dsn, name)
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="module")
def module_broker_url(module_db_url: str) -> str:
    import sys

    sys.path.insert(0, APPS_DIR)
    try:
        import taskapp
    finally:
        sys.path.remove(APPS_DIR)
    taskapp.ensure_table(module_db_url)
    return module_db_url.replace("postgresql://", "pgskip://", 1)


def pgskip_ok(db_url: str, *args: str) -> str:
    """``python -m kombu_pgskip <args> --url db_url``, which must succeed; its output."""
    from tests.helpers import REPO_ROOT

    done = subprocess.run(
        [sys.executable, "-m", "kombu_pgskip", *args, "--url", db_url],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def celery_cli(
    *args: str, broker: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``celery -A taskapp <args>`` as a user types it, against ``broker``."""
    from tests.helpers import REPO_ROOT

    full_env = dict(os.environ, PGSKIP_BROKER_URL=broker, PYTHONPATH=str(REPO_ROOT))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "taskapp", *args],
        cwd=APPS_DIR,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
