"""Unique tasks at the store and through a Celery app in this process: a message whose unique
key another message of its queue holds (pending, scheduled or running) is not written, and the
caller gets :class:`DuplicateTask`; a retry of the task that holds the key takes it over; keys
are refused where a publish could not honour them. The claims table (``unique_keys``, migration
0026): a stale claim is taken over, racing claims wait for each other, an upgraded schema keeps
the keys held, a row inserted again with its id keeps its claim, and prune() deletes only what
no message holds. Real workers: tests/acceptance/test_unique.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner

from kombu_pgskip import ConfigurationError, DuplicateTask, apply_async_in, apply_many
from kombu_pgskip.__main__ import main
from kombu_pgskip.envelope import to_row
from kombu_pgskip.migrate import migrate
from kombu_pgskip.store import Store
from tests.helpers import REPO_ROOT
from tests.periodic_support import fire, make_app, sync_as_of

UTC = timezone.utc


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = Celery("unique_tests", broker=db_url.replace("postgresql://", "pgskip://", 1))
    app.conf.update(task_default_queue="default", broker_connection_retry=False)

    @app.task(name="unique_tests.sync", shared=False)
    def sync(account: int) -> int:
        return account

    yield app
    app.close()


def _rows(db_url: str) -> list[tuple[str, str, str | None, str]]:
    """(queue, status, unique_key, task_id) of every message, oldest first."""
    with psycopg.connect(db_url) as conn:
        return [
            (r[0], r[1], r[2], r[3])
            for r in conn.execute(
                "SELECT queue, status::text, unique_key, task_id FROM pgskip.jobs ORDER BY id"
            )
        ]


def _set_status(db_url: str, status: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET status = %s::pgskip.job_status", (status,))


def test_a_held_key_publishes_nothing_and_says_so(app: Celery, db_url: str) -> None:
    first = app.tasks["unique_tests.sync"].apply_async((1,), pgskip_unique="sync:1")
    with pytest.raises(DuplicateTask) as raised:
        app.tasks["unique_tests.sync"].apply_async((1,), pgskip_unique="sync:1")
    assert raised.value.queue == "default" and raised.value.key == "sync:1"
    assert "holds unique key 'sync:1'" in str(raised.value)
    other = app.tasks["unique_tests.sync"].apply_async((2,), pgskip_unique="sync:2")
    elsewhere = app.tasks["unique_tests.sync"].apply_async(
        (1,), pgskip_unique="sync:1", queue="other"
    )
    unkeyed = app.tasks["unique_tests.sync"].apply_async((1,))
    assert _rows(db_url) == [
        ("default", "pending", "sync:1", first.id),
        ("default", "pending", "sync:2", other.id),
        ("other", "pending", "sync:1", elsewhere.id),
        ("default", "pending", None, unkeyed.id),
    ]
    # The key travels in the message's headers too (a retry copies them).
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT payload->'headers'->>'pgskip_unique',"
            " (payload->'properties')::jsonb ? 'pgskip_unique' FROM pgskip.jobs WHERE task_id = %s",
            (first.id,),
        ).fetchone()
    assert row == ("sync:1", False)


@pytest.mark.parametrize(
    ("status", "held"),
    [
        ("pending", True),
        ("scheduled", True),
        ("running", True),
        ("completed", False),
        ("failed", False),
    ],
)
def test_which_states_hold_the_key(app: Celery, db_url: str, status: str, held: bool) -> None:
    app.tasks["unique_tests.sync"].apply_async((1,), pgskip_unique="k")
    _set_status(db_url, status)
    if held:
        with pytest.raises(DuplicateTask):
            app.tasks["unique_tests.sync"].apply_async((1,), pgskip_unique="k")
        assert len(_rows(db_url)) == 1
    else:
        app.tasks["unique_tests.sync"].apply_async((1,), pgskip_unique="k")
        assert [r[1] for r in _rows(db_url)] == [status, "pending"]


def test_a_countdown_holds_the_key_until_it_ran(app: Celery, db_url: str) -> None:
    app.tasks["unique_tests.sync"].apply_async((1,), countdown=3600, pgskip_unique="later")
    assert [r[1] for r in _rows(db_url)] == ["scheduled"]
    with pytest.raises(DuplicateTask):
        app.tasks["unique_tests.sync"].apply_async((1,), pgskip_unique="later")


def test_inside_a_transaction_the_key_is_held_only_if_it_commits(app: Celery, db_url: str) -> None:
    task = app.tasks["unique_tests.sync"]
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            apply_async_in(conn, task, args=(1,), pgskip_unique="txn")
            with pytest.raises(DuplicateTask):
                apply_async_in(conn, task, args=(1,), pgskip_unique="txn")
            # The duplicate aborted nothing: the transaction goes on.
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert [r[2] for r in _rows(db_url)] == ["txn"]
        conn.execute("DELETE FROM pgskip.jobs")
        conn.commit()
        with pytest.raises(RuntimeError), conn.transaction():
            apply_async_in(conn, task, args=(1,), pgskip_unique="txn")
            raise RuntimeError("the business transaction fails")
        assert _rows(db_url) == []
        with conn.transaction():
            apply_async_in(conn, task, args=(1,), pgskip_unique="txn")
    assert [r[2] for r in _rows(db_url)] == ["txn"]


def test_two_transactions_publishing_one_key_write_one_message(app: Celery, db_url: str) -> None:
    """The second waits for the first to end (its claim of the key), then writes nothing."""
    task = app.tasks["unique_tests.sync"]
    outcome: list[object] = []
    first_wrote = threading.Event()
    with psycopg.connect(db_url) as first:
        with first.transaction():
            apply_async_in(first, task, args=(1,), pgskip_unique="race")
            first_wrote.set()

            def second() -> None:
                with psycopg.connect(db_url) as conn, conn.transaction():
                    try:
                        apply_async_in(conn, task, args=(2,), pgskip_unique="race")
                        outcome.append("written")
                    except DuplicateTask as exc:
                        outcome.append(exc)

            thread = threading.Thread(target=second)
            thread.start()
            time.sleep(0.5)
            assert outcome == [], "the second waits while the first is open"
        thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], DuplicateTask)
    assert len(_rows(db_url)) == 1


def test_a_rolled_back_holder_lets_the_waiting_publish_write(app: Celery, db_url: str) -> None:
    task = app.tasks["unique_tests.sync"]
    outcome: list[object] = []
    with psycopg.connect(db_url) as first:
        first.execute("BEGIN")
        apply_async_in(first, task, args=(1,), pgskip_unique="undo")

        def second() -> None:
            with psycopg.connect(db_url) as conn, conn.transaction():
                apply_async_in(conn, task, args=(2,), pgskip_unique="undo")
                outcome.append("written")

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)
        first.rollback()
        thread.join(10)
    assert outcome == ["written"]
    assert [r[2] for r in _rows(db_url)] == ["undo"]


def _row(task_id: str, key: str, queue: str = "default") -> Any:
    message = {
        "body": "e30=",
        "headers": {"id": task_id, "task": "t", "pgskip_unique": key},
        "properties": {"delivery_tag": task_id, "body_encoding": "base64"},
        "content-type": "application/json",
        "content-encoding": "utf-8",
    }
    return to_row(queue, message, eta_threshold=2, max_message_size=10**6)


def test_the_task_holding_the_key_hands_it_to_its_retry(db_url: str) -> None:
    """Celery's retry publishes a message with the same task id while the one it retries
    still runs: that message takes the key over; a message of another task does not."""
    store = Store(db_url)
    try:
        assert store.publish(_row("t1", "k")) is not None
        _set_status(db_url, "running")
        assert store.publish(_row("t1", "k")) is None
        assert store.take_over_unique_key(_row("t2", "k")) is None, "another task"
        assert _rows(db_url) == [("default", "running", "k", "t1")]
        assert store.take_over_unique_key(_row("t1", "k")) is not None
        assert _rows(db_url) == [
            ("default", "running", None, "t1"),
            ("default", "pending", "k", "t1"),
        ]
        assert store.publish(_row("t3", "k")) is None, "the retry holds the key now"
    finally:
        store.close()


def test_bad_keys_and_publishes_that_cannot_honour_a_key_are_refused(
    app: Celery, db_url: str
) -> None:
    task = app.tasks["unique_tests.sync"]
    for bad in ("", "x" * 513, 42, "a\x00b"):
        with pytest.raises(ConfigurationError, match="a key is 1 to 512 bytes"):
            task.apply_async((1,), pgskip_unique=bad)
    with pytest.raises(ConfigurationError, match="publish keyed tasks one by one"):
        apply_many([task.s(1).set(pgskip_unique="bulk"), task.s(2)], app=app)
    assert _rows(db_url) == []
    # A concurrency key alone is fine in a publish of many.
    apply_many([task.s(1).set(pgskip_concurrency_key="c"), task.s(2)], app=app)
    with psycopg.connect(db_url) as conn:
        keys = [r[0] for r in conn.execute("SELECT concurrency_key FROM pgskip.jobs ORDER BY id")]
    assert keys == ["c", None]


def test_retry_failed_gives_a_message_back_its_key_only_if_it_is_free(
    app: Celery, db_url: str
) -> None:
    task = app.tasks["unique_tests.sync"]
    task.apply_async((1,), pgskip_unique="a")
    task.apply_async((1,), pgskip_unique="b")
    _set_status(db_url, "failed")
    task.apply_async((1,), pgskip_unique="a")  # a new message took key a meanwhile
    result = CliRunner().invoke(main, ["retry-failed", "--url", db_url])
    assert result.exit_code == 0, result.output
    assert sorted((r[1], r[2] or "") for r in _rows(db_url)) == [
        ("pending", ""),  # the old "a" comes back without it
        ("pending", "a"),
        ("pending", "b"),
    ]


def test_a_periodic_entry_with_a_key_skips_runs_while_the_last_one_waits(db_url: str) -> None:
    app = make_app(
        {
            "report": {
                "task": "periodic_tests.add",
                "schedule": 10,
                "args": (1, 2),
                "options": {"pgskip_unique": "report"},
            }
        }
    )
    start = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
    sync_as_of(app, db_url, start)
    fire(db_url, start + timedelta(seconds=35), timedelta(0))
    rows = _rows(db_url)
    assert [(r[1], r[2]) for r in rows] == [("pending", "report")], "one run while it waits"
    _set_status(db_url, "completed")
    fire(db_url, start + timedelta(seconds=45), timedelta(0))
    assert [(r[1], r[2]) for r in _rows(db_url)] == [("completed", "report"), ("pending", "report")]
    with psycopg.connect(db_url) as conn:
        payload = conn.execute("SELECT payload FROM pgskip.jobs ORDER BY id DESC").fetchone()
    assert payload is not None
    message = payload[0] if isinstance(payload[0], dict) else json.loads(payload[0])
    assert message["headers"]["pgskip_unique"] == "report"


def test_unique_keys_lists_the_held_keys(app: Celery, db_url: str) -> None:
    task = app.tasks["unique_tests.sync"]
    held = task.apply_async((1,), pgskip_unique="b")
    task.apply_async((1,), pgskip_unique="a", queue="other")
    task.apply_async((1,), pgskip_unique="c")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET status = 'completed' WHERE unique_key = 'c'")
    result = CliRunner().invoke(main, ["unique-keys", "--url", db_url, "--json"])
    assert result.exit_code == 0, result.output
    keys = json.loads(result.output)["keys"]
    assert [(k["queue"], k["key"], k["status"]) for k in keys] == [
        ("default", "b", "pending"),
        ("other", "a", "pending"),
    ]
    assert keys[0]["task"] == "unique_tests.sync" and keys[0]["task_id"] == held.id
    table = CliRunner().invoke(main, ["unique-keys", "--url", db_url, "--queue", "default"])
    assert table.exit_code == 0, table.output
    assert "unique_tests.sync" in table.output and " other " not in table.output
    empty = CliRunner().invoke(main, ["unique-keys", "--url", db_url, "--queue", "none"])
    assert "(no unique key held)" in empty.output


# -- the claims (unique_keys, migration 0026) ------------------------------------------------------


def _claims(db_url: str) -> list[tuple[str, str, int]]:
    """(queue, key, job_id) of every claim, by queue and key."""
    with psycopg.connect(db_url) as conn:
        return [
            (r[0], r[1], r[2])
            for r in conn.execute(
                "SELECT queue, unique_key, job_id FROM pgskip.unique_keys ORDER BY 1, 2"
            )
        ]


def _ids(db_url: str) -> list[int]:
    with psycopg.connect(db_url) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM pgskip.jobs ORDER BY id")]


def test_a_claim_whose_message_no_longer_holds_the_key_is_taken_over(db_url: str) -> None:
    store = Store(db_url)
    try:
        first = store.publish(_row("t1", "k"))
        assert first is not None
        assert _claims(db_url) == [("default", "k", first)]
        _set_status(db_url, "completed")
        second = store.publish(_row("t2", "k"))
        assert second is not None
        assert _claims(db_url) == [("default", "k", second)]
        assert store.publish(_row("t3", "k")) is None
        # A message deleted (purged, expired) leaves its claim behind: stale too.
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("DELETE FROM pgskip.jobs WHERE id = %s", (second,))
        third = store.publish(_row("t4", "k"))
        assert third is not None
        assert _claims(db_url) == [("default", "k", third)]
        # A claim that names a message with another key (its key given up) is stale as well.
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("UPDATE pgskip.jobs SET unique_key = NULL WHERE id = %s", (third,))
        fourth = store.publish(_row("t5", "k"))
        assert fourth is not None and _claims(db_url) == [("default", "k", fourth)]
    finally:
        store.close()


@pytest.mark.parametrize("claim", ["new", "stale"])
@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_two_transactions_claiming_one_key_wait_for_each_other(
    app: Celery, db_url: str, claim: str, first_ends: str
) -> None:
    """Whether the first claim inserts the key's row or takes a stale one over, the second
    waits for the first transaction to end: refused if it committed, written if it rolled
    back."""
    task = app.tasks["unique_tests.sync"]
    if claim == "stale":
        task.apply_async((0,), pgskip_unique="race")
        _set_status(db_url, "completed")
    outcome: list[object] = []
    with psycopg.connect(db_url) as first:
        first.execute("BEGIN")
        apply_async_in(first, task, args=(1,), pgskip_unique="race")

        def second() -> None:
            with psycopg.connect(db_url) as conn, conn.transaction():
                try:
                    apply_async_in(conn, task, args=(2,), pgskip_unique="race")
                    outcome.append("written")
                except DuplicateTask as exc:
                    outcome.append(exc)

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)
        assert outcome == [], "the second waits while the first is open"
        if first_ends == "commit":
            first.commit()
        else:
            first.rollback()
        thread.join(10)
    assert len(outcome) == 1
    if first_ends == "commit":
        assert isinstance(outcome[0], DuplicateTask)
    else:
        assert outcome == ["written"]
    held = [(r[1], r[2]) for r in _rows(db_url) if r[1] == "pending"]
    assert held == [("pending", "race")]
    pending_id = _ids(db_url)[-1]
    assert _claims(db_url) == [("default", "race", pending_id)]


def test_a_row_inserted_again_with_its_id_keeps_its_claim(db_url: str) -> None:
    """A row that moves (deleted and inserted again with its id in one transaction, as
    between partitions) finds its own claim: it is written, and keeps the key."""
    store = Store(db_url)
    try:
        held = store.publish(_row("t1", "k"))
        assert held is not None
        with psycopg.connect(db_url) as conn:
            conn.execute(
                "CREATE TEMP TABLE moving AS SELECT * FROM pgskip.jobs WHERE id = %s", (held,)
            )
            conn.execute("DELETE FROM pgskip.jobs WHERE id = %s", (held,))
            moved = conn.execute(
                "INSERT INTO pgskip.jobs OVERRIDING SYSTEM VALUE SELECT * FROM moving RETURNING id"
            ).fetchall()
            assert moved == [(held,)]
            conn.commit()
        assert _rows(db_url) == [("default", "pending", "k", "t1")]
        assert _claims(db_url) == [("default", "k", held)]
        assert store.publish(_row("t2", "k")) is None
    finally:
        store.close()


def test_retrying_failed_messages_of_one_key_gives_it_to_one_of_them(
    app: Celery, db_url: str
) -> None:
    task = app.tasks["unique_tests.sync"]
    task.apply_async((1,), pgskip_unique="k")
    _set_status(db_url, "failed")
    task.apply_async((2,), pgskip_unique="k")
    _set_status(db_url, "failed")
    result = CliRunner().invoke(main, ["retry-failed", "--url", db_url])
    assert result.exit_code == 0, result.output
    assert sorted((r[1], r[2] or "") for r in _rows(db_url)) == [("pending", ""), ("pending", "k")]
    keeper = next(i for i, r in zip(_ids(db_url), _rows(db_url), strict=True) if r[2] == "k")
    assert _claims(db_url) == [("default", "k", keeper)]
    with pytest.raises(DuplicateTask):
        task.apply_async((3,), pgskip_unique="k")


def test_a_snapshot_older_than_a_claim_fails_to_serialize_instead_of_taking_the_key(
    app: Celery, db_url: str
) -> None:
    """A publisher in a REPEATABLE READ transaction that began before a failed message took its
    key back (retry-failed) cannot see that message holding it: its claim fails to serialize,
    and the key keeps one holder."""
    task = app.tasks["unique_tests.sync"]
    task.apply_async((1,), pgskip_unique="rr")
    _set_status(db_url, "failed")
    with psycopg.connect(db_url) as publisher:
        publisher.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        publisher.execute("SELECT count(*) FROM pgskip.jobs")  # the snapshot
        result = CliRunner().invoke(main, ["retry-failed", "--url", db_url])
        assert result.exit_code == 0, result.output
        with pytest.raises(Exception) as raised:
            apply_async_in(publisher, task, args=(2,), pgskip_unique="rr")
        assert getattr(raised.value, "sqlstate", None) == "40001", raised.value
        publisher.rollback()
    assert _rows(db_url)[0][1:3] == ("pending", "rr") and len(_rows(db_url)) == 1


def test_prune_deletes_the_claims_no_message_holds(app: Celery, db_url: str) -> None:
    task = app.tasks["unique_tests.sync"]
    for key in ("held", "done", "gone", "failed"):
        task.apply_async((1,), pgskip_unique=key)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET status = 'completed' WHERE unique_key = 'done'")
        conn.execute("UPDATE pgskip.jobs SET status = 'failed' WHERE unique_key = 'failed'")
        conn.execute("DELETE FROM pgskip.jobs WHERE unique_key = 'gone'")
        assert conn.execute("SELECT * FROM pgskip.prune()").fetchone() == (0, 0, 0)
    assert [c[1] for c in _claims(db_url)] == ["held"]
    for key in ("done", "gone"):
        task.apply_async((1,), pgskip_unique=key)
    _set_status(db_url, "completed")
    with psycopg.connect(db_url, autocommit=True) as conn:
        # One stale claim per transaction: the procedure goes on until none is left.
        conn.execute("CALL pgskip.prune_in_batches('1 day', '14 days', 1)")
    assert _claims(db_url) == []


def test_prune_leaves_a_claim_a_transaction_is_taking(app: Celery, db_url: str) -> None:
    """A failed message coming back with its key holds the claim's lock until it commits:
    prune passes that claim by, and the key stays held."""
    task = app.tasks["unique_tests.sync"]
    task.apply_async((1,), pgskip_unique="back")
    _set_status(db_url, "failed")
    with psycopg.connect(db_url) as retrying:
        retrying.execute("UPDATE pgskip.jobs SET status = 'pending'")
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '2s'")
            conn.execute("SELECT * FROM pgskip.prune()")
        retrying.commit()
    assert [c[1] for c in _claims(db_url)] == ["back"]
    with pytest.raises(DuplicateTask):
        task.apply_async((2,), pgskip_unique="back")


def test_keys_held_before_the_upgrade_to_claims_stay_held(
    empty_db_url: str, tmp_path: Path
) -> None:
    """A schema at 0025 (the unique index) with messages holding keys, migrated: each holder
    has its claim, the index is gone, and a publish of a held key writes nothing."""
    for m in (REPO_ROOT / "migrations").glob("00*.sql"):
        if int(m.name[:4]) <= 25:
            (tmp_path / m.name).write_bytes(m.read_bytes())
    migrate(empty_db_url, directory=tmp_path)
    statuses = ("pending", "scheduled", "running", "completed", "failed")
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        ids = {}
        for status in statuses:
            row = conn.execute(
                "INSERT INTO pgskip.jobs (queue, status, payload, unique_key)"
                " VALUES ('default', %s, '{}', %s) RETURNING id",
                (status, status),
            ).fetchone()
            assert row is not None
            ids[status] = row[0]
        conn.execute("INSERT INTO pgskip.jobs (queue, payload) VALUES ('default', '{}')")
    migrate(empty_db_url)
    assert _claims(empty_db_url) == sorted(
        ("default", s, ids[s]) for s in ("pending", "scheduled", "running")
    )
    with psycopg.connect(empty_db_url) as conn:
        indexes = conn.execute(
            "SELECT indexrelid::regclass::text FROM pg_index"
            " WHERE indrelid IN (SELECT relid FROM pg_partition_tree('pgskip.jobs'))"
            " AND indisunique AND NOT indisprimary"
        ).fetchall()
    assert indexes == []  # the primary keys of the partitions only
    store = Store(empty_db_url)
    try:
        for status in statuses:
            written = store.publish(_row(f"new-{status}", status))
            assert (written is None) == (status in ("pending", "scheduled", "running")), status
    finally:
        store.close()
