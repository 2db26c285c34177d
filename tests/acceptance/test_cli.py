"""The command line, as a user runs it: `celery -A proj pgskip ...`, `python -m kombu_pgskip`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.acceptance


def run(args: list[str], broker: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PGSKIP_BROKER_URL=broker, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        args, cwd=APPS_DIR, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def celery(*args: str, broker: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "celery", "-A", "taskapp", *args], broker)


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def test_celery_pgskip_migrate_installs_then_reports_up_to_date(empty_db_url: str) -> None:
    broker = _broker(empty_db_url)
    dry = celery("pgskip", "migrate", "--dry-run", broker=broker)
    assert dry.returncode == 0, dry.stderr
    assert "CREATE TABLE jobs" in dry.stdout
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT to_regnamespace('pgskip')").fetchone() == (None,)
    first = celery("pgskip", "migrate", broker=broker)
    assert first.returncode == 0, first.stderr
    assert "applied 0001_initial" in first.stdout
    second = celery("pgskip", "migrate", broker=broker)
    assert "up to date" in second.stdout


def test_python_m_migrate_works_without_an_app(empty_db_url: str) -> None:
    result = run(
        [sys.executable, "-m", "kombu_pgskip", "migrate", "--url", empty_db_url, "--schema", "q"],
        broker="",
    )
    assert result.returncode == 0, result.stderr
    assert "applied 0001_initial" in result.stdout
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT count(*) FROM q.jobs").fetchone() == (0,)


def test_status_and_purge_report_exact_counts(db_url: str) -> None:
    broker = _broker(db_url)
    app = Celery("publisher", broker=broker, set_as_current=False)
    for _ in range(3):
        app.send_task("taskapp.record", args=("x",), queue="default")
    app.send_task("taskapp.record", args=("y",), queue="emails")
    app.close()
    status = celery("pgskip", "status", broker=broker)
    assert status.returncode == 0, status.stderr
    lines = {line.split()[0]: line.split() for line in status.stdout.splitlines()[1:]}
    assert lines["default"][1] == "3" and lines["emails"][1] == "1"
    purge = celery("purge", "-f", "-Q", "default", broker=broker)
    assert purge.returncode == 0, purge.stderr
    assert "Purged 3 messages" in purge.stdout
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT queue FROM pgskip.jobs").fetchall() == [("emails",)]


def test_celery_pgskip_doctor_and_queue_args_act_as_the_owner(db_url: str) -> None:
    """(As the superuser that owns the test schema: the owner's commands through Celery's CLI;
    tests/chaos/test_hostile_roles.py runs them against real roles.)"""
    broker = _broker(db_url)
    doctor = celery("pgskip", "doctor", broker=broker)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok    routines not executable by PUBLIC" in doctor.stdout
    app = Celery("publisher", broker=broker, set_as_current=False)
    app.send_task("taskapp.record", args=("x",), queue="default")
    app.close()
    changed = celery(
        "pgskip", "queue-args", "default", "--set", "x-expires=60000", "--url", db_url,
        broker=broker,
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    assert "queue 'default': x-expires none -> 60000" in changed.stdout
    shown = celery("pgskip", "queue-args", "default", broker=broker)
    assert shown.stdout.strip() == """queue 'default': {"x-expires": 60000}"""
    missing = celery("pgskip", "queue-args", "nope", "--set", "x-expires=1", broker=broker)
    assert missing.returncode == 1 and "no queue 'nope'" in missing.stderr


def test_worker_against_a_database_without_schema_says_run_migrate(empty_db_url: str) -> None:
    result = run(
        [sys.executable, "-m", "celery", "-A", "taskapp", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        _broker(empty_db_url),
        timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "celery -A proj pgskip migrate" in result.stdout + result.stderr


def test_wheel_ships_the_migrations_and_sql(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("kombu_pgskip-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kombu_pgskip/migrations/0001_initial.sql" in names
    assert "kombu_pgskip/sql/queries.sql" in names
    assert "kombu_pgskip/py.typed" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pgskip = kombu_pgskip.cli:pgskip" in zipfile.ZipFile(wheel).read(entry_points).decode()
