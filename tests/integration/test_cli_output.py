"""What the ``pgskip`` commands print: an empty schema, ``--version``, ``--json``,
``retry-failed --dry-run`` and counts in the singular."""

from __future__ import annotations

import contextlib
import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
from click.testing import CliRunner, Result
from kombu import Connection, Consumer, Queue

import kombu_pgskip
from kombu_pgskip.__main__ import main
from kombu_pgskip.migrate import latest_version, migrate, schema_window


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _json(*args: str) -> Any:
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _failed(conn: psycopg.Connection[Any], queue: str, task: str, ago: timedelta) -> int:
    row = conn.execute(
        "INSERT INTO pgskip.jobs (queue, status, payload, task_name, task_id, attempts,"
        " finished_at, last_error)"
        " VALUES (%s, 'failed', '{}', %s, %s, 20, now() - %s::interval, %s) RETURNING id",
        (queue, task, str(uuid.uuid4()), ago, "Traceback ...\nValueError: card declined"),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _statuses(db_url: str) -> dict[int, str]:
    with psycopg.connect(db_url) as conn:
        return {r[0]: r[1] for r in conn.execute("SELECT id, status::text FROM pgskip.jobs")}


def test_status_right_after_migrate_prints_the_empty_table(empty_db_url: str) -> None:
    migrate(empty_db_url)
    result = _run("status", "--url", empty_db_url)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "queue", "pending", "running", "scheduled", "failed", "oldest", "pending", "done/min",
    ]  # fmt: skip
    assert lines[1] == "(no messages)"
    assert lines[2].startswith("schema 'pgskip' at version ")


def test_status_with_a_consumer_registered_and_no_messages(db_url: str) -> None:
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    with Connection(broker) as conn:
        consumer = Consumer(conn, [Queue("default")], callbacks=[lambda body, message: None])
        consumer.consume()
        with contextlib.suppress(TimeoutError):  # the first fetch registers the consumer
            conn.drain_events(timeout=0.3)
        with psycopg.connect(db_url) as pg:
            assert pg.execute("SELECT count(*) FROM pgskip.consumers").fetchone() == (1,)
        result = _run("status", "--url", db_url)
        assert result.exit_code == 0, result.output
        assert "(no messages)" in result.stdout
        assert _json("status", "--url", db_url)["queues"] == []
        consumer.cancel()


def test_status_json(db_url: str) -> None:
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    with Connection(broker) as conn:
        producer = conn.Producer()
        for _ in range(2):
            producer.publish({"n": 1}, routing_key="default", declare=[Queue("default")])
    with psycopg.connect(db_url, autocommit=True) as conn:
        _failed(conn, "default", "billing.run", timedelta(hours=1))
    oldest, current = schema_window(db_url)
    got = _json("status", "--url", db_url)
    age = got["queues"][0].pop("oldest_pending_age")
    assert isinstance(age, float) and age >= 0
    assert got == {
        "schema": "pgskip",
        "schema_version": current,
        "oldest_compatible_version": oldest,
        "package_schema_version": latest_version(),
        "version": kombu_pgskip.__version__,
        "queues": [
            {
                "queue": "default",
                "pending": 2,
                "running": 0,
                "scheduled": 0,
                "failed": 1,
                "completed_last_minute": 0,
                "paused": False,
                "limited": False,
            }
        ],
        "paused": [],
        "limits": [],
    }


def test_failed_json_has_whole_errors_and_utc_times(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = _failed(conn, "a", "billing.run", timedelta(days=2))
        _failed(conn, "b", "reports.build", timedelta(hours=1))
    got = _json("failed", "--url", db_url, "--queue", "a")
    (message,) = got["messages"]
    failed_at = message.pop("failed_at")
    assert message == {
        "id": first,
        "queue": "a",
        "task": "billing.run",
        "task_id": message["task_id"],
        "attempts": 20,
        "error": "Traceback ...\nValueError: card declined",
    }
    assert failed_at.endswith("+00:00")
    assert datetime.fromisoformat(failed_at) < datetime.now().astimezone() - timedelta(days=1)
    assert _json("failed", "--url", db_url, "--queue", "nope") == {"messages": []}


def test_beat_list_json_without_entries(db_url: str) -> None:
    got = _json("beat-list", "--url", db_url)
    assert got["schema"] == "pgskip" and got["entries"] == []
    cron = got["pg_cron"]
    assert isinstance(cron["available"], bool)
    if cron["available"]:
        assert cron["jobs"] == [] and set(cron) == {"available", "version", "database", "jobs"}
    else:
        assert set(cron) == {"available", "error"}


def test_retry_failed_dry_run_lists_and_changes_nothing(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        old = _failed(conn, "a", "billing.run", timedelta(days=3))
        new = _failed(conn, "a", "billing.run", timedelta(hours=1))
    before = _statuses(db_url)
    dry = _run("retry-failed", "--url", db_url, "--older-than", "1d", "--dry-run")
    assert dry.exit_code == 0, dry.output
    listed = [int(line.split()[0]) for line in dry.stdout.splitlines()[1:-1]]
    assert listed == [old]
    assert dry.stdout.splitlines()[-1] == (
        "dry run: 1 failed message would return to pending; nothing was changed"
    )
    assert _statuses(db_url) == before
    everything = _run("retry-failed", "--url", db_url, "--dry-run")
    assert "dry run: 2 failed messages would return to pending" in everything.stdout
    assert _statuses(db_url) == before == {old: "failed", new: "failed"}


def test_counts_of_one_are_singular(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        _failed(conn, "a", "billing.run", timedelta(days=3))
        _failed(conn, "a", "billing.run", timedelta(days=3))
    retried = _run("retry-failed", "--url", db_url, "--limit", "1")
    assert retried.stdout == "1 failed message returned to pending\n", retried.output
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET status = 'failed' WHERE status = 'pending'")
    purged = _run("purge-failed", "--url", db_url, "--limit", "1", "--yes")
    assert purged.stdout == "1 failed message deleted\n", purged.output
    purged = _run("purge-failed", "--url", db_url, "--yes")
    assert purged.stdout == "1 failed message deleted\n", purged.output
    none = _run("retry-failed", "--url", db_url)
    assert none.stdout == "0 failed messages returned to pending\n", none.output


def test_version_option() -> None:
    result = _run("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"kombu-pgskip {kombu_pgskip.__version__}\n"
