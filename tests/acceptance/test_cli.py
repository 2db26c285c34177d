"""The command line, as a user runs it: `celery -A proj pgskip ...`, `python -m kombu_pgskip`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest
from celery import Celery

import kombu_pgskip
from tests.acceptance.conftest import APPS_DIR
from tests.helpers import REPO_ROOT, CeleryWorker, build_wheel

pytestmark = pytest.mark.acceptance


URL_ENV = ("PGSKIP_URL", "PGSKIP_OWNER_URL")


def run(
    args: list[str],
    broker: str,
    timeout: float = 60,
    url_env: dict[str, str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``args`` in tests/apps, ``taskapp``'s broker set to ``broker``; of the environment
    variables ``--url`` reads (PGSKIP_URL, PGSKIP_OWNER_URL) only those in ``url_env``;
    ``extra_env`` on top (``PGSKIP_OPT_<NAME>``: ``taskapp``'s transport option ``name``)."""
    inherited = {k: v for k, v in os.environ.items() if k not in URL_ENV}
    env = dict(
        inherited,
        PGSKIP_BROKER_URL=broker,
        PYTHONPATH=str(REPO_ROOT),
        **(url_env or {}),
        **(extra_env or {}),
    )
    return subprocess.run(
        args, cwd=APPS_DIR, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def celery(
    *args: str, broker: str, url_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "celery", "-A", "taskapp", *args], broker, url_env=url_env)


def python_m(*args: str, url_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "kombu_pgskip", *args], broker="", url_env=url_env)


def _commands(help_text: str) -> dict[str, str]:
    """The ``Commands:`` section of a click group's ``--help``: name -> one-line description."""
    section = help_text.split("\nCommands:\n", 1)[1]
    return dict(line.split(None, 1) for line in section.splitlines() if line.strip())


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


# The commands users run; beat-sync reads app.conf.beat_schedule, so it runs under Celery only.
COMMANDS = {
    "beat-list", "beat-sync", "cron-remove", "doctor", "failed", "grant", "limit",
    "maintenance", "metrics", "migrate", "pause", "purge-failed", "queue-args", "resume",
    "retry-failed", "revoke", "status", "tick", "unique-keys", "unlimit",
}  # fmt: skip
#: The arguments a command needs before it looks for a URL.
ARGUMENTS = {"queue-args": ["default"], "pause": ["default"], "resume": ["default"],
             "revoke": ["an-id"], "limit": ["default", "--max-running", "1"],
             "unlimit": ["default"]}  # fmt: skip
APP_ONLY = {"beat-sync"}
NOWHERE = "pgskip://postgres@127.0.0.1:1/nowhere"


def test_python_m_offers_the_commands_of_celery_pgskip_but_the_app_only_ones() -> None:
    under_celery = celery("pgskip", "--help", broker=NOWHERE)
    without_app = python_m("--help")
    assert under_celery.returncode == 0, under_celery.stderr
    assert without_app.returncode == 0, without_app.stderr
    celery_commands = _commands(under_celery.stdout)
    python_m_commands = _commands(without_app.stdout)
    assert set(celery_commands) == COMMANDS
    assert set(python_m_commands) == COMMANDS - APP_ONLY
    for name, description in celery_commands.items():
        assert description.endswith(".") and not description.endswith("..."), (name, description)
        if name in python_m_commands:
            assert python_m_commands[name] == description


def test_python_m_without_url_is_a_usage_error_naming_url_for_every_command() -> None:
    for name in sorted(COMMANDS - APP_ONLY):
        result = python_m(name, *ARGUMENTS.get(name, []))
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert "pass --url (or set $PGSKIP_URL)" in result.stderr, (name, result.stderr)
        assert f"`celery -A proj pgskip {name}`" in result.stderr, (name, result.stderr)
    for name in sorted(APP_ONLY):
        result = python_m(name, "--url", NOWHERE)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert f"run it as `celery -A proj pgskip {name}`" in result.stderr, (name, result.stderr)


def test_python_m_reads_pgskip_url_and_owner_commands_pgskip_owner_url_first(
    db_url: str, empty_db_url: str
) -> None:
    status = python_m("status", url_env={"PGSKIP_URL": db_url})
    assert status.returncode == 0, status.stderr
    assert "(no messages)" in status.stdout
    # The owner's commands: PGSKIP_OWNER_URL (migrated) before PGSKIP_URL (no schema).
    doctor = python_m("doctor", url_env={"PGSKIP_OWNER_URL": db_url, "PGSKIP_URL": empty_db_url})
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok    routines not executable by PUBLIC" in doctor.stdout
    # The others do not read PGSKIP_OWNER_URL.
    missing = python_m("status", url_env={"PGSKIP_OWNER_URL": db_url})
    assert missing.returncode == 2 and "pass --url" in missing.stderr


def test_url_wins_over_the_app_broker_under_celery(db_url: str, empty_db_url: str) -> None:
    app = Celery("publisher", broker=_broker(db_url), set_as_current=False)
    for _ in range(2):
        app.send_task("taskapp.record", args=("x",), queue="default")
    app.close()
    # taskapp's broker is a database without the schema; --url (or $PGSKIP_URL) names db_url.
    broker = _broker(empty_db_url)
    from_app = celery("pgskip", "status", broker=broker)
    assert from_app.returncode == 1 and "not installed" in from_app.stderr, from_app.stderr
    for result in (
        celery("pgskip", "status", "--url", _broker(db_url), broker=broker),
        celery("pgskip", "status", broker=broker, url_env={"PGSKIP_URL": db_url}),
    ):
        assert result.returncode == 0, result.stderr
        lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
        assert lines["default"][1] == "2", result.stdout


def test_worker_against_a_database_without_schema_says_run_migrate(empty_db_url: str) -> None:
    result = run(
        [sys.executable, "-m", "celery", "-A", "taskapp", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        _broker(empty_db_url),
        timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "celery -A proj pgskip migrate" in result.stdout + result.stderr


def test_version_under_celery_and_python_m() -> None:
    expected = f"kombu-pgskip {kombu_pgskip.__version__}\n"
    for result in (celery("pgskip", "--version", broker=NOWHERE), python_m("--version")):
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected


def test_status_right_after_migrate_and_with_a_worker_running(empty_db_url: str) -> None:
    broker = _broker(empty_db_url)
    migrated = celery("pgskip", "migrate", broker=broker)
    assert migrated.returncode == 0, migrated.stderr
    for status in (
        celery("pgskip", "status", broker=broker),
        python_m("status", url_env={"PGSKIP_URL": empty_db_url}),
    ):
        assert status.returncode == 0, status.stderr
        assert status.stdout.splitlines()[1] == "(no messages)", status.stdout
    with CeleryWorker("taskapp", broker, cwd=APPS_DIR, queues=["default"]):
        for status in (
            celery("pgskip", "status", broker=broker),
            python_m("status", url_env={"PGSKIP_URL": empty_db_url}),
            celery("pgskip", "status", "--json", broker=broker),
        ):
            assert status.returncode == 0, status.stderr
            assert "Traceback" not in status.stderr
        assert json.loads(status.stdout)["queues"] == []


def test_worker_refuses_a_misspelled_transport_option(db_url: str) -> None:
    result = run(
        [sys.executable, "-m", "celery", "-A", "taskapp", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        _broker(db_url),
        extra_env={"PGSKIP_OPT_POLLING_INTERVALL": "0.5"},
    )  # fmt: skip
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "unknown transport option 'polling_intervall'" in output, output
    assert "did you mean 'polling_interval'?" in output, output


def test_wheel_ships_every_module_the_migrations_and_sql(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    # Every module of the source tree and nothing else: a subpackage missing from
    # [tool.setuptools] packages would be left out.
    src = tmp_path / "src"  # what build_wheel built from
    modules = {p.relative_to(src).as_posix() for p in (src / "kombu_pgskip").rglob("*.py")}
    top = {"_kombu_pgskip_alias.py", "_kombu_pgskip_pytest.py"}
    assert {n for n in names if n.endswith(".py")} == modules | top
    assert "kombu_pgskip.pth" in names  # registers pgskip:// at start-up
    # The demo starts its throwaway cluster from the installed package.
    assert "kombu_pgskip/testing/embedded.py" in names
    assert "kombu_pgskip/migrations/0001_initial.sql" in names
    for runtime in ("publish", "consume", "queues", "maintenance"):
        assert f"kombu_pgskip/sql/{runtime}.sql" in names
    assert "kombu_pgskip/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    declared = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "pgskip = kombu_pgskip.cli:pgskip" in declared
    assert "[pytest11]\npgskip = _kombu_pgskip_pytest" in declared
