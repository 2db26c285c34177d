"""kombu-pgskip's pytest plugin (``_kombu_pgskip_pytest``), run as an application's test suite
runs it: a small suite in a pytest subprocess (``pytester``), once on the embedded cluster the
plugin starts itself and once on the session's server through ``PGSKIP_TEST_DSN``."""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from tests.helpers import REPO_ROOT

pytest_plugins = ["pytester"]

#: What loading the plugin must not import.
HEAVY = ("kombu_pgskip", "kombu", "celery", "psycopg")

CONFTEST = """
import json
import sys

import pytest

pytest_plugins = ["celery.contrib.pytest"]


def pytest_sessionstart(session):
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("kombu_pgskip", "psycopg"))
    (session.config.rootpath / "loaded_at_start.json").write_text(json.dumps(heavy))


@pytest.fixture(scope="session")
def celery_config(pgskip_celery_config):
    return pgskip_celery_config
"""

# An application's models and tasks; its tests enqueue in the transaction that writes an order.
ENQUEUE = """
import psycopg
from celery import Celery

from kombu_pgskip import apply_async_in

app = Celery("shop", set_as_current=False)


@app.task
def send_receipt(order_id):
    return order_id


def _jobs(conn):
    return conn.execute("SELECT task_name, payload::text FROM pgskip.jobs").fetchall()


def test_an_order_and_its_receipt_commit_together(pgskip_db_url):
    app.conf.broker_url = pgskip_db_url.replace("postgresql://", "pgskip://", 1)
    with psycopg.connect(pgskip_db_url) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY)")
        conn.commit()
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            apply_async_in(conn, send_receipt, args=(1,))
        with conn.transaction(force_rollback=True):
            conn.execute("INSERT INTO orders VALUES (2)")
            apply_async_in(conn, send_receipt, args=(2,))
        jobs = _jobs(conn)
    assert [name for name, _payload in jobs] == ["test_enqueue.send_receipt"]


def test_each_test_gets_a_database_of_its_own(pgskip_db_url):
    with psycopg.connect(pgskip_db_url) as conn:
        assert _jobs(conn) == []
        assert conn.execute("SELECT to_regclass('public.orders')").fetchone() == (None,)
        dbname = conn.execute("SELECT current_database()").fetchone()[0]
    assert dbname.startswith("pgskip_test_")
"""

# A real worker (celery.contrib.pytest's, in a thread) on the session database; and
# start_worker with an application's own app.
WORKER = """
import psycopg
from celery import Celery
from celery.contrib.testing.worker import start_worker

from kombu_pgskip import apply_async_in

own = Celery("own", set_as_current=False)


@own.task
def double(x):
    return 2 * x


def test_a_worker_runs_tasks_sent_through_pgskip(celery_app, celery_worker, pgskip_broker_url):
    @celery_app.task
    def mul(x, y):
        return x * y

    celery_worker.reload()
    assert celery_app.conf.broker_url == pgskip_broker_url
    assert mul.delay(4, 4).get(timeout=20) == 16


def test_a_task_enqueued_in_a_transaction_runs_once_committed(
    celery_app, celery_worker, pgskip_session_db_url
):
    @celery_app.task
    def add(x, y):
        return x + y

    celery_worker.reload()
    with psycopg.connect(pgskip_session_db_url) as conn:
        with conn.transaction():
            result = apply_async_in(conn, add, args=(2, 3))
    assert result.get(timeout=20) == 5


def test_start_worker_runs_an_app_of_its_own(pgskip_broker_url):
    own.conf.update(broker_url=pgskip_broker_url, result_backend="cache+memory://")
    with start_worker(own, perform_ping_check=False):
        assert double.delay(21).get(timeout=20) == 42
"""

PG_CRON = """
import psycopg


def test_the_embedded_cluster_preloads_pg_cron(pgskip_server):
    assert pgskip_server.kind == "embedded"
    with psycopg.connect(pgskip_server.url) as conn:
        preload = conn.execute("SHOW shared_preload_libraries").fetchone()[0]
        cron = conn.execute("SELECT count(*) FROM pg_extension WHERE extname = 'pg_cron'")
        assert "pg_cron" in preload and cron.fetchone() == (1,)
"""

ON_THE_GIVEN_SERVER = """
import os
from urllib.parse import urlsplit

import psycopg


def test_databases_are_made_on_the_server_named(pgskip_server, pgskip_db_url):
    given = urlsplit(os.environ["PGSKIP_TEST_DSN"])
    assert pgskip_server.kind == "external"
    assert urlsplit(pgskip_db_url).port == given.port
    with psycopg.connect(pgskip_db_url) as conn:
        version = conn.execute("SELECT max(version) FROM pgskip.migrations").fetchone()[0]
        dbname = conn.execute("SELECT current_database()").fetchone()[0]
    assert version > 0
    with open(os.environ["KEPT_LOG"], "w") as log:
        log.write(dbname)
"""


def _suite(pytester: pytest.Pytester, **files: str) -> None:
    pytester.makeini(
        """
        [pytest]
        filterwarnings =
            error
            ignore::DeprecationWarning:celery.*
            ignore::DeprecationWarning:kombu.*
        pgskip_pg_cron = true
        """
    )
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(**files)


def test_importing_the_plugin_imports_nothing_but_pytest() -> None:
    probe = (
        "import sys, json; import _kombu_pgskip_pytest; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_an_application_suite_enqueues_and_runs_a_worker_on_the_embedded_cluster(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGSKIP_TEST_DSN", raising=False)
    _suite(pytester, test_enqueue=ENQUEUE, test_worker=WORKER, test_pg_cron=PG_CRON)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    # Loading the plugin imported neither kombu-pgskip nor psycopg: nothing started before a
    # test asked for a fixture.
    assert json.loads((pytester.path / "loaded_at_start.json").read_text()) == []


def test_pgskip_test_dsn_makes_the_databases_on_that_server_and_keep_leaves_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_server_dsn: str
) -> None:
    kept_log = pytester.path / "kept.txt"
    monkeypatch.setenv("PGSKIP_TEST_DSN", pg_server_dsn)
    monkeypatch.setenv("KEPT_LOG", str(kept_log))
    _suite(pytester, test_given=ON_THE_GIVEN_SERVER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pgskip-keep")
    result.assert_outcomes(passed=1)
    dbname = kept_log.read_text()
    result.stdout.fnmatch_lines(
        [f"kombu-pgskip kept the test server: *:{urlsplit(pg_server_dsn).port}/postgres",
         f"  databases: {dbname}, pgskip_template_*"]
    )  # fmt: skip
    kept = [line for line in result.stdout.lines if line.startswith("  databases: ")]
    names = kept[0].removeprefix("  databases: ").split(", ")
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        try:
            found = conn.execute(
                "SELECT datname FROM pg_database WHERE datname = ANY(%s) ORDER BY 1", (names,)
            ).fetchall()
        finally:
            for name in names:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    assert sorted(r[0] for r in found) == sorted(names)
