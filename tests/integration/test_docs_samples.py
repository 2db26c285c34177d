"""The documentation's samples that need a database run against the test database and do what
the page says they do (tests/docs_support.py: the convention), and the schema reference
describes the schema the migrations build."""

from __future__ import annotations

import psycopg

from tests.docs_support import blocks, documented_tables, run_samples, sample_address


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
            " ORDER BY c.table_name, c.ordinal_position"
        ).fetchall()
    tables: dict[str, list[str]] = {}
    for table, column in rows:
        tables.setdefault(str(table), []).append(str(column))
    assert documented_tables("reference/schema.md") == tables


def test_schema_reference_queries_run_and_count_a_message(db_url: str) -> None:
    queries = [b.text for b in blocks("reference/schema.md", "sql")]
    assert queries
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO pgskip.jobs (queue, payload) VALUES ('emails', '{}')")
        results = [conn.execute(query).fetchall() for query in queries]
    by_status = results[0]
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
