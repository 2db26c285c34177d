"""kombu_pgskip.completing at the database: a real message fetched by a consumer, a real Celery
task whose request carries that delivery (as the worker gives it), and the task's work
committed with the mark, on its own connection or the caller's (psycopg 3, psycopg2,
SQLAlchemy). Real workers killed mid-run: tests/acceptance/test_completing.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from kombu_pgskip import DeliveryLost, completing, exceptions
from kombu_pgskip.envelope import make_tag, to_row
from kombu_pgskip.store import FetchedRow, Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (key text NOT NULL)")
    yield s
    s.close()


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = Celery("completing", broker=db_url.replace("postgresql://", "pgskip://", 1),
                 set_as_current=False)  # fmt: skip

    @app.task(bind=True, acks_late=True, name="t.late", shared=False)
    def late(self: Any) -> None:
        pass

    @app.task(bind=True, name="t.early", shared=False)
    def early(self: Any) -> None:
        pass

    yield app
    app.close()


def _deliver(store: Store) -> tuple[FetchedRow, uuid.UUID]:
    message = {
        "body": json.dumps([[], {}, {}]),
        "headers": {"task": "t.late", "id": str(uuid.uuid4())},
        "properties": {"priority": 0, "delivery_info": {}},
    }
    store.publish(to_row("q", message, eta_threshold=2, max_message_size=10**6))
    consumer = uuid.uuid4()
    store.register_consumer(consumer, hostname="t", queues=["q"], lease=30)
    (row,) = store.fetch(["q"], 1, consumer)
    return row, consumer


def _task(app: Celery, row: FetchedRow, name: str = "t.late") -> Any:
    task = app.tasks[name]
    tag = make_tag(row.id, row.delivery)  # as the worker's message carries it
    task.push_request(  # as Celery's worker builds a task's request
        id=row.payload["headers"]["id"], properties={"delivery_tag": tag}, called_directly=False
    )
    return task


def _row(db_url: str, row_id: int) -> tuple[str, bool]:
    with psycopg.connect(db_url) as conn:
        got = conn.execute(
            "SELECT status::text, finished_at IS NOT NULL FROM pgskip.jobs WHERE id = %s",
            (row_id,),
        ).fetchone()
    assert got is not None
    return got[0], got[1]


def _effects(db_url: str) -> int:
    with psycopg.connect(db_url) as conn:
        return int(conn.execute("SELECT count(*) FROM effects").fetchone()[0])  # type: ignore[index]


def test_the_work_and_the_mark_commit_together_then_the_ack_completes(
    store: Store, app: Celery, db_url: str
) -> None:
    row, consumer = _deliver(store)
    task = _task(app, row)
    with completing(task) as conn:
        conn.execute("INSERT INTO effects VALUES ('a')")
        assert _row(db_url, row.id) == ("running", False)  # not committed yet
    task.pop_request()
    assert _effects(db_url) == 1
    assert _row(db_url, row.id) == ("running", True)
    assert store.ack([row.tag], consumer) == 1  # the worker's ack: still its delivery
    assert _row(db_url, row.id) == ("completed", True)


def test_a_block_that_raises_leaves_no_work_and_no_mark(
    store: Store, app: Celery, db_url: str
) -> None:
    row, _ = _deliver(store)
    task = _task(app, row)
    with pytest.raises(ValueError), completing(task) as conn:
        conn.execute("INSERT INTO effects VALUES ('a')")
        raise ValueError("declined")
    task.pop_request()
    assert _effects(db_url) == 0
    assert _row(db_url, row.id) == ("running", False)


def test_a_delivery_taken_away_rolls_the_work_back(store: Store, app: Celery, db_url: str) -> None:
    row, consumer = _deliver(store)
    store.requeue(
        [row.tag], consumer, max_attempts=20
    )  # its lease ran out: back in the queue, for another
    task = _task(app, row)
    lost = pytest.raises(DeliveryLost, match="no longer this worker's delivery")
    with lost, completing(task) as conn:
        conn.execute("INSERT INTO effects VALUES ('a')")
    task.pop_request()
    assert _effects(db_url) == 0
    assert _row(db_url, row.id) == ("pending", False)


def test_returned_to_the_queue_after_the_commit_it_is_completed_instead(
    store: Store, app: Celery, db_url: str
) -> None:
    """The worker dies, or its channel closes, between the commit and the ack: whichever path
    returns its messages completes this one; it never runs again."""
    for leave in ("requeue", "unregister", "sweep"):
        row, consumer = _deliver(store)
        task = _task(app, row)
        with completing(task) as conn:
            conn.execute("INSERT INTO effects VALUES (%s)", (leave,))
        task.pop_request()
        if leave == "requeue":
            store.requeue([row.tag], consumer, max_attempts=20)
        elif leave == "unregister":
            store.unregister_consumer(consumer)
        else:
            with psycopg.connect(db_url, autocommit=True) as conn:
                conn.execute("DELETE FROM pgskip.consumers WHERE id = %s", (consumer,))
                conn.execute("SELECT pgskip.sweep(20)")
        assert _row(db_url, row.id) == ("completed", True), leave
    assert _effects(db_url) == 3


def test_on_the_callers_connection_the_caller_commits(
    store: Store, app: Celery, db_url: str
) -> None:
    import psycopg2
    import sqlalchemy

    row, _ = _deliver(store)
    task = _task(app, row)
    with psycopg.connect(db_url) as conn, conn.transaction(), completing(task, conn) as same:
        assert same is conn
        conn.execute("INSERT INTO effects VALUES ('psycopg')")
    task.pop_request()
    assert _row(db_url, row.id) == ("running", True)

    row, _ = _deliver(store)
    task = _task(app, row)
    pg2 = psycopg2.connect(db_url)
    try:
        with completing(task, pg2):
            pg2.cursor().execute("INSERT INTO effects VALUES ('psycopg2')")
        assert _row(db_url, row.id) == ("running", False)  # the caller has not committed
        pg2.rollback()  # ... and rolls back: neither the work nor the mark
        assert _row(db_url, row.id) == ("running", False)
    finally:
        pg2.close()
    task.pop_request()

    row, _ = _deliver(store)
    task = _task(app, row)
    engine = sqlalchemy.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as sa, completing(task, sa):
            sa.execute(sqlalchemy.text("INSERT INTO effects VALUES ('sqlalchemy')"))
    finally:
        engine.dispose()
    task.pop_request()
    assert _row(db_url, row.id) == ("running", True)
    assert _effects(db_url) == 2


def test_what_completing_refuses_and_what_it_leaves_alone(
    store: Store, app: Celery, db_url: str
) -> None:
    row, _ = _deliver(store)
    early = _task(app, row, "t.early")
    with pytest.raises(exceptions.ConfigurationError, match="acks_late=True"), completing(early):
        pass
    early.pop_request()
    with psycopg.connect(db_url, autocommit=True) as conn:
        task = _task(app, row)
        with pytest.raises(exceptions.ConnectionInAutocommit), completing(task, conn):
            pass
        task.pop_request()
    # Run eagerly (no message): the block commits, nothing is marked.
    task = app.tasks["t.late"]
    task.push_request(id="eager", is_eager=True)
    with completing(task) as conn:
        conn.execute("INSERT INTO effects VALUES ('eager')")
    task.pop_request()
    assert _effects(db_url) == 1
    assert _row(db_url, row.id) == ("running", False)
