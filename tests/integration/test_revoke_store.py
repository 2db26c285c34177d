"""A revoke that lasts, at the store: the waiting messages of revoked tasks are marked failed and
never fetched, found through the partial indexes of waiting rows, listed and retried as any
failed message. Real workers: tests/acceptance/test_revoke.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from kombu_pgskip.__main__ import main
from kombu_pgskip.control import REVOKED_ERROR, revoke_waiting
from kombu_pgskip.sql import queries_in
from kombu_pgskip.store import Store
from tests.helpers import seq_scanned_rows


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _job(conn: psycopg.Connection[Any], status: str, task_id: str, run_in: str = "0 s") -> int:
    row = conn.execute(
        "INSERT INTO pgskip.jobs (queue, status, run_at, payload, task_name, task_id)"
        " VALUES ('q', %s::pgskip.job_status, now() + %s::interval, '{}', 'proj.charge', %s)"
        " RETURNING id",
        (status, run_in, task_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_only_waiting_messages_are_marked_and_no_fetch_takes_them(
    store: Store, db_url: str
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        ids = {
            "a": _job(conn, "pending", "a"),
            "b": _job(conn, "scheduled", "b", "1 hour"),
            "c": _job(conn, "running", "c"),
            "d": _job(conn, "completed", "d"),
            "e": _job(conn, "pending", "e"),
        }
    assert revoke_waiting(store, ["a", "b", "c", "d", "unknown"]) == ["a", "b"]
    assert revoke_waiting(store, ["a", "b"]) == []
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT task_id, status::text, last_error FROM pgskip.jobs").fetchall()
    assert sorted(rows) == [
        ("a", "failed", REVOKED_ERROR),
        ("b", "failed", REVOKED_ERROR),
        ("c", "running", None),
        ("d", "completed", None),
        ("e", "pending", None),
    ]
    consumer = uuid.uuid4()
    store.register_consumer(consumer, hostname="t", queues=["q"], lease=30)
    assert [r.id for r in store.fetch(["q"], 10, consumer)] == [ids["e"]]
    # Listed and retried as any failed message.
    listed = CliRunner().invoke(main, ["failed", "--json", "--url", db_url])
    messages = json.loads(listed.stdout)["messages"]
    assert {(m["task_id"], m["error"]) for m in messages} == {
        ("a", REVOKED_ERROR),
        ("b", REVOKED_ERROR),
    }
    retried = CliRunner().invoke(main, ["retry-failed", "--url", db_url])
    assert retried.exit_code == 0, retried.output
    assert [r.id for r in store.fetch(["q"], 10, consumer)] == [ids["a"], ids["b"]]


def test_the_revoke_reads_the_waiting_rows_not_the_history(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, status, payload, task_name, task_id, finished_at)"
            " SELECT 'q', 'completed', '{}', 'proj.charge', g::text, now()"
            " FROM generate_series(1, 50000) AS g"
        )
        _job(conn, "pending", "p")
        conn.execute("ANALYZE pgskip.jobs")
        query = queries_in("queues.sql", "pgskip")["revoke_waiting"]
        rows = conn.execute(
            sql.SQL("EXPLAIN ") + query, {"task_ids": ["p", "1"], "reason": "x"}
        ).fetchall()
        plan = "\n".join(str(r[0]) for r in rows)
        assert not seq_scanned_rows(conn, plan), plan
    assert "jobs_dequeue" in plan and "jobs_scheduled" in plan, plan


def test_the_command_says_which_tasks_it_revoked(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        _job(conn, "scheduled", "later", "1 hour")
    done = CliRunner().invoke(main, ["revoke", "later", "gone", "--url", db_url])
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines() == [
        "task later: revoked; its waiting message will never be delivered",
        "task gone: no waiting message (running, held by a worker, finished or unknown); "
        "no worker was told",
    ]
