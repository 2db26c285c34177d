"""Celery's own Django example (``tests/apps/django_example``, whose README.md lists what was
changed) on kombu-pgskip: ``manage.py migrate`` installs the schema and upgrades one left at an
older version, ``manage.py test`` passes with the schema in its test database, and a real
``celery -A proj worker`` runs the example's tasks published from ``manage.py shell``.

The module shares one database, empty at the start, that ``manage.py migrate`` sets up once;
each command runs in a copy of the project, where the result backend's SQLite file goes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
from psycopg import sql

from kombu_pgskip.migrate import check_schema, latest_version, load_migrations, migrate
from tests.helpers import REPO_ROOT, CeleryWorker, make_url

PROJECT = REPO_ROOT / "tests" / "apps" / "django_example"
LABELS = [m.label for m in load_migrations()]
#: The version an older kombu-pgskip left the schema at: 0017 builds an index concurrently.
OLDER = 16

#: The docs' schema option (docs/django.md), in a settings module of its own.
SETTINGS_WITH_SCHEMA = """\
from proj.settings import *  # noqa: F403

CELERY_BROKER_TRANSPORT_OPTIONS = {"schema": "queue"}
"""

#: What docs/django.md shows: tasks published with .delay(), and a job enqueued in the
#: transaction that creates the widget it renames.
SHELL = """\
from demoapp.tasks import add, mul, xsum

results = [add.delay(2, 3), mul.delay(4, 5), xsum.delay([1, 2, 3])]

from django.db import connection, transaction

from demoapp.models import Widget
from demoapp.tasks import rename_widget
from kombu_pgskip import apply_async_in

with transaction.atomic():
    widget = Widget.objects.create(name="old")
    result = apply_async_in(connection, rename_widget, args=(widget.id, "new"))

print([r.get(timeout=30) for r in results])
result.get(timeout=30)
widget.refresh_from_db()

from demoapp.tasks import count_widgets

print(widget.name, count_widgets.delay().get(timeout=30))

from demoapp.tasks import rename_widget_once

rename_widget_once.delay(widget.id, "once").get(timeout=30)
widget.refresh_from_db()
print(widget.name)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("django") / "django_example"
    shutil.copytree(PROJECT, target, ignore=shutil.ignore_patterns("__pycache__", "*.sqlite"))
    (target / "settings_with_schema.py").write_text(SETTINGS_WITH_SCHEMA)
    return target


@pytest.fixture(scope="module")
def database_url(pg_server_dsn: str) -> Iterator[str]:
    """An empty database; Django's test runner makes ``test_<name>`` beside it."""
    name = f"pgskip_django_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(pg_server_dsn, name)
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            for db in (name, f"test_{name}"):
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
                )


def manage(
    project: Path, database_url: str, *args: str, settings: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python manage.py <args>`` in the project, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(DATABASE_URL=database_url, PYTHONPATH=str(REPO_ROOT))
    if settings is not None:
        env["DJANGO_SETTINGS_MODULE"] = settings
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def migrated(project: Path, database_url: str) -> subprocess.CompletedProcess[str]:
    """``manage.py migrate`` on the empty database, once for the module."""
    return manage(project, database_url, "migrate", "--noinput")


def installed_version(url: str, schema: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return check_schema(conn, schema)


@pytest.mark.acceptance
def test_manage_py_migrate_installs_the_schema(
    migrated: subprocess.CompletedProcess[str], database_url: str
) -> None:
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert "Applying kombu_pgskip.0001_initial... OK" in migrated.stdout
    assert "Applying demoapp.0001_initial... OK" in migrated.stdout
    assert installed_version(database_url, "pgskip") == latest_version()


@pytest.mark.acceptance
def test_manage_py_migrate_upgrades_a_schema_left_at_an_older_version(
    migrated: subprocess.CompletedProcess[str], project: Path, database_url: str, tmp_path: Path
) -> None:
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    # The schema the settings name (the schema option) was left at OLDER by an older release.
    for label in LABELS[:OLDER]:
        shutil.copy(REPO_ROOT / "migrations" / f"{label}.sql", tmp_path)
    assert migrate(database_url, schema="queue", directory=tmp_path) == LABELS[:OLDER]

    result = manage(project, database_url, "migrate", "--noinput", settings="settings_with_schema")

    assert result.returncode == 0, result.stdout + result.stderr
    # Django has no migration left to apply; the schema is upgraded all the same.
    assert "No migrations to apply." in result.stdout
    assert (
        f"Upgraded the pgskip schema 'queue' from {OLDER:04d} to {latest_version():04d}: "
        f"applied {', '.join(LABELS[OLDER:])}"
    ) in result.stdout
    assert installed_version(database_url, "queue") == latest_version()


@pytest.mark.acceptance
def test_manage_py_test_passes_with_the_schema_in_its_test_database(
    project: Path, database_url: str
) -> None:
    result = manage(project, database_url, "test", "--noinput")

    assert result.returncode == 0, result.stdout + result.stderr
    assert "Ran 2 tests" in result.stderr
    assert "\nOK\n" in result.stderr


@pytest.mark.acceptance
def test_a_worker_runs_the_example_tasks_published_from_manage_py_shell(
    migrated: subprocess.CompletedProcess[str], project: Path, database_url: str
) -> None:
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    worker = CeleryWorker(
        "proj",
        database_url.replace("postgresql://", "pgskip://", 1),
        pool="prefork",
        concurrency=1,
        cwd=str(project),
        extra_env={"DATABASE_URL": database_url},
    )
    # The shell publishes while the worker starts: its tasks wait in their queue.
    worker.start(wait_ready=False)
    try:
        result = manage(project, database_url, "shell", "-c", SHELL)
        assert result.returncode == 0, f"{result.stderr}\nworker log:\n{worker.log_text()[-4000:]}"
    finally:
        worker.kill9()  # its shutdown is not what this test is about
    worker.remove_log()
    # (Django 5.2 first says how many models it imported for the shell.)
    assert result.stdout.splitlines()[-3:] == ["[5, 20, 6]", "new 1", "once"]


# -- the app's refusals, in this process ----------------------------------------------------------


def test_reversing_the_apps_migration_is_refused_with_how_to_drop_the_schema() -> None:
    from tests.publish_support import _django_setup

    _django_setup()
    from django.db.migrations.exceptions import IrreversibleError

    from kombu_pgskip.contrib.django.operations import MigrateSchema

    editor = SimpleNamespace(connection=SimpleNamespace(alias="default"))
    with pytest.raises(IrreversibleError) as caught:
        MigrateSchema().database_backwards("kombu_pgskip", editor, None, None)
    assert str(caught.value) == (
        "kombu_pgskip migrations are not reversed: the schema 'pgskip' holds the queued "
        "messages, and kombu-pgskip never drops it. To remove it, stop the workers, run DROP "
        'SCHEMA "pgskip" CASCADE in the database, then `manage.py migrate kombu_pgskip zero '
        "--fake`"
    )
    # On a database that is not the schema's, there is nothing to reverse.
    other = SimpleNamespace(connection=SimpleNamespace(alias="other"))
    MigrateSchema().database_backwards("kombu_pgskip", other, None, None)


def test_a_migrate_that_unapplies_or_targets_another_database_leaves_the_schema_alone() -> None:
    from tests.publish_support import _django_setup

    _django_setup()  # "default" is Django's dummy backend here: touching it would raise
    from kombu_pgskip.contrib.django.schema import upgrade_before_migrate

    upgrade_before_migrate(None, using="default", plan=[(object(), True)])
    upgrade_before_migrate(None, using="other", plan=[])


def test_the_system_check_names_what_is_wrong_in_the_settings() -> None:
    from tests.publish_support import _django_setup

    _django_setup()
    from django.db import connections
    from django.test import override_settings

    from kombu_pgskip.contrib.django.checks import check_settings

    connections.settings["lite"] = connections.configure_settings(
        {"default": {"ENGINE": "django.db.backends.dummy"},
         "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    )["lite"]  # fmt: skip
    try:
        with override_settings(
            PGSKIP_DATABASE="lite", CELERY_BROKER_TRANSPORT_OPTIONS={"polling_intervall": 1}
        ):
            errors = [(e.id, e.msg) for e in check_settings()]
        with override_settings(PGSKIP_DATABASE="queue"):
            missing = [(e.id, e.msg) for e in check_settings()]
    finally:
        connections["lite"].close()
        del connections["lite"]
        del connections.settings["lite"]
    assert errors[0][0] == "kombu_pgskip.E001"
    assert errors[0][1].startswith(
        "the pgskip schema lives in PostgreSQL, and the database 'lite' (PGSKIP_DATABASE) uses "
        "Django's sqlite backend: point PGSKIP_DATABASE at a database whose ENGINE is "
        "'django.db.backends.postgresql'."
    )
    assert errors[1][0] == "kombu_pgskip.E002"
    assert (
        "unknown transport option 'polling_intervall'; did you mean 'polling_interval'?"
        in (errors[1][1])
    )
    assert missing == [
        (
            "kombu_pgskip.E001",
            "PGSKIP_DATABASE is 'queue', which names no database in DATABASES: set it to the "
            "alias of the PostgreSQL database that apply_async_in writes to",
        )
    ]


def test_every_line_of_the_guides_python_samples_is_in_what_this_module_runs() -> None:
    """docs/django.md shows the example project's code and this module's: nothing else."""
    ran = "\n".join(
        [
            *(
                (PROJECT / name).read_text()
                for name in (
                    "proj/celery.py",
                    "proj/settings.py",
                    "demoapp/tests.py",
                    "demoapp/tasks.py",
                )
            ),
            SHELL,
            SETTINGS_WITH_SCHEMA,
        ]
    )
    known = {line.split("  #")[0].strip().replace("'", '"') for line in ran.splitlines()}
    guide = (REPO_ROOT / "docs" / "django.md").read_text()
    samples = re.findall(r"^```python\n(.*?)^```", guide, re.MULTILINE | re.DOTALL)
    assert len(samples) >= 6
    unknown = [
        line
        for sample in samples
        for line in (raw.strip().replace("'", '"') for raw in sample.splitlines())
        if line and line != "# ..." and line not in known
    ]
    assert unknown == []
