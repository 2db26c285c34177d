"""The documentation's samples that need a database run against the test database and do what
the page says they do (tests/docs_support.py: the convention), the SQL queries of every page
run, the testing guide's suite passes, and the schema reference describes the schema the
migrations build."""

from __future__ import annotations

import psycopg
import pytest

from tests.docs_support import (
    PAGES,
    PYTEST_SUITE_PAGES,
    blocks,
    documented_tables,
    run_samples,
    sample_address,
    sql_queries,
    suite_files,
)

pytest_plugins = ["pytester"]


def _jobs(db_url: str) -> list[tuple[str, str, str]]:
    """(queue, task name, argsrepr) of every message, oldest first."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT queue, task_name, payload->'headers'->>'argsrepr' FROM pgskip.jobs ORDER BY id"
        ).fetchall()
    return [(str(q), str(t), str(a)) for q, t, a in rows]


def _orders(db_url: str, table: str) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT customer, id FROM {table} ORDER BY id").fetchall()
    return {str(customer): int(order_id) for customer, order_id in rows}


def test_getting_started_writes_the_delay_job_and_the_committed_orders_job_only(
    db_url: str,
) -> None:
    with run_samples("getting-started.md", sample_address(db_url)) as run:
        assert "proj" in run.modules

    orders = _orders(db_url, "orders")
    assert list(orders) == ["alice"]  # bob's order was rolled back
    task = "proj.send_invoice_email"
    assert _jobs(db_url) == [
        ("celery", task, "(42,)"),
        ("celery", task, f"({orders['alice']},)"),
    ]


def test_sqlalchemy_guide_writes_one_job_per_kept_order(db_url: str) -> None:
    with run_samples("sqlalchemy.md", sample_address(db_url)):
        pass

    orders = _orders(db_url, "orders")
    assert list(orders) == ["alice", "bob", "carol"]  # dave's savepoint was rolled back
    assert _jobs(db_url) == [
        ("celery", "tasks.send_invoice_email", f"({orders[name]},)") for name in orders
    ]


def test_schema_reference_describes_every_table_and_column_the_migrations_create(
    db_url: str,
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.table_name, c.column_name FROM information_schema.columns AS c"
            " JOIN information_schema.tables AS t USING (table_schema, table_name)"
            " WHERE c.table_schema = 'pgskip' AND t.table_type = 'BASE TABLE'"
            # The partitions of jobs have its columns.
            " AND NOT (SELECT relispartition FROM pg_class"
            "          WHERE oid = ('pgskip.' || quote_ident(c.table_name))::regclass)"
            " ORDER BY c.table_name, c.ordinal_position"
        ).fetchall()
    tables: dict[str, list[str]] = {}
    for table, column in rows:
        tables.setdefault(str(table), []).append(str(column))
    assert documented_tables("reference/schema.md") == tables


def test_sql_queries_of_every_page_run_and_the_schema_references_count_a_message(
    db_url: str,
) -> None:
    queries = {(b.page, b.line): b.text for page in PAGES for b in sql_queries(page)}
    assert queries
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO pgskip.jobs (queue, payload) VALUES ('emails', '{}')")
        results = {where: conn.execute(query).fetchall() for where, query in queries.items()}
    by_status = results[("reference/schema.md", blocks("reference/schema.md", "sql")[0].line)]
    assert [(queue, status, count) for queue, status, count, _oldest in by_status] == [
        ("emails", "pending", 1)
    ]


def test_bulk_guide_writes_every_message_of_each_call(db_url: str) -> None:
    with run_samples("bulk.md", sample_address(db_url)):
        pass

    jobs = _jobs(db_url)
    assert jobs[:5] == [
        ("celery", "proj.resize", "(1,)"),
        ("celery", "proj.resize", "(2,)"),
        ("celery", "proj.resize", "(3,)"),
        ("celery", "proj.ship", "(10,)"),
        ("celery", "proj.ship", "(11,)"),
    ]
    assert [q for q, _t, _a in jobs[5:]] == ["work"] * 102


def test_transactional_enqueue_guide_writes_a_job_per_committed_order_and_call(
    db_url: str,
) -> None:
    with run_samples("transactional-enqueue.md", sample_address(db_url)) as run:
        assert "proj" in run.modules

    orders = _orders(db_url, "orders")
    assert list(orders) == ["alice", "bob", "carol", "dave"]
    task = "proj.send_invoice_email"
    assert _jobs(db_url) == [
        ("celery", task, f"({orders['alice']},)"),  # psycopg 3
        ("celery", task, f"({orders['bob']},)"),  # psycopg2
        ("celery", task, f"({orders['carol']},)"),  # SQLAlchemy Session
        ("billing", task, f"({orders['dave']},)"),  # a signature, with options
        ("celery", "billing.send_invoice", f"({orders['dave']},)"),  # send_task_in
    ]


def test_periodic_tasks_guides_schedule_is_stored_by_beat_sync(db_url: str) -> None:
    from celery import Celery

    from kombu_pgskip.periodic import beat_sync, list_entries

    with run_samples("periodic-tasks.md", sample_address(db_url)) as run:
        app = Celery("proj", set_as_current=False)
        app.config_from_object(run.modules["celeryconfig"])
        try:
            assert app.conf.broker_url == db_url.replace("postgresql://", "pgskip://", 1)
            result = beat_sync(app, db_url, "pgskip", use_cron=False)
        finally:
            app.close()

    # What the page shows beat-sync printing, but the next run's time.
    shown = [
        line.split("; next run")[0]
        for line in blocks("periodic-tasks.md", "console")[0].text.splitlines()
        if line.startswith("+ ")
    ]
    assert [str(change).split("; next run")[0] for change in result.changes] == shown

    entries = {e.name: e for e in list_entries(db_url, "pgskip")}
    assert sorted(entries) == ["celery.backend_cleanup", "nightly-billing", "refresh-cache"]
    assert (entries["nightly-billing"].task, entries["nightly-billing"].queues) == (
        "billing.run",
        ["celery"],
    )
    assert (entries["refresh-cache"].task, entries["refresh-cache"].queues) == (
        "cache.refresh",
        ["fast"],
    )
    assert {e.timezone for e in entries.values()} == {"Europe/Berlin"}


def test_metrics_guides_collector_reports_the_pending_message(db_url: str) -> None:
    from prometheus_client import REGISTRY

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO pgskip.jobs (queue, payload) VALUES ('emails', '{}')")
    with run_samples("metrics.md", sample_address(db_url)) as run:
        collector = run.namespace["collector"]
        try:
            assert REGISTRY.get_sample_value("pgskip_up") == 1
            assert REGISTRY.get_sample_value("pgskip_pending_messages", {"queue": "emails"}) == 1
        finally:
            REGISTRY.unregister(collector)
            collector.close()


@pytest.mark.parametrize("page", PYTEST_SUITE_PAGES)
def test_testing_guides_suite_passes_on_the_session_server(
    page: str, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_server_dsn: str
) -> None:
    """The guide's files, as a suite of their own, with the plugin on this session's server
    (``PGSKIP_TEST_DSN``): every test passes."""
    files = suite_files(page)
    monkeypatch.setenv("PGSKIP_TEST_DSN", pg_server_dsn)
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(**files)
    tests = sum(text.count("\ndef test_") for text in files.values())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=240)
    assert tests > 0
    result.assert_outcomes(passed=tests)
