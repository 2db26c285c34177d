"""apply_async_in on every supported connection type: commit, rollback, savepoint, misuse.

Each connection type (psycopg 3 connection and cursor, psycopg2 connection and cursor,
SQLAlchemy Connection over psycopg and psycopg2, SQLAlchemy Session, Django's connection and
the ``django.db.connection`` proxy) runs the same five behaviours against one database.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from kombu_pgskip import (
    ConnectionInAutocommit,
    TransactionAborted,
    apply_async_in,
    send_task_in,
)
from kombu_pgskip.adapters import Query, adapt
from kombu_pgskip.executor import CallerConnection
from kombu_pgskip.store import Store
from tests.publish_support import DRIVERS, Driver, Rollback, cloned_database, count_jobs, make_app

pytestmark = pytest.mark.parametrize("driver_name", list(DRIVERS))


@pytest.fixture(scope="module")
def shared_db(pg_server_dsn: str, template_db: str) -> Iterator[str]:
    with cloned_database(pg_server_dsn, template_db) as url:
        yield url


@pytest.fixture(scope="module")
def app(shared_db: str) -> Iterator[Celery]:
    app = make_app(shared_db)
    yield app
    app.close()


@pytest.fixture
def driver(driver_name: str, shared_db: str) -> Driver:
    return DRIVERS[driver_name](shared_db)


def _tid() -> str:
    return str(uuid.uuid4())


def test_job_exists_after_commit_and_not_before(
    driver: Driver, app: Celery, shared_db: str
) -> None:
    tid = _tid()
    with driver.transaction() as conn:
        result = apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), task_id=tid)
        assert result.id == tid
        assert count_jobs(shared_db, tid) == 0  # other sessions do not see it yet
    assert count_jobs(shared_db, tid) == 1


def test_rollback_leaves_no_job(driver: Driver, app: Celery, shared_db: str) -> None:
    tid_task, tid_named = _tid(), _tid()
    with driver.transaction() as conn:
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), task_id=tid_task)
        send_task_in(conn, "billing.send_invoice", args=(7,), app=app, task_id=tid_named)
        raise Rollback
    assert count_jobs(shared_db, tid_task) == 0
    assert count_jobs(shared_db, tid_named) == 0


def test_job_written_in_rolled_back_savepoint_is_gone(
    driver: Driver, app: Celery, shared_db: str
) -> None:
    outer, inner, kept_inner = _tid(), _tid(), _tid()
    with driver.transaction() as conn:
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 1), task_id=outer)
        with driver.savepoint(conn):
            apply_async_in(conn, app.tasks["txn.add"], args=(2, 2), task_id=inner)
            raise Rollback
        with driver.savepoint(conn):
            apply_async_in(conn, app.tasks["txn.add"], args=(3, 3), task_id=kept_inner)
    assert count_jobs(shared_db, outer) == 1
    assert count_jobs(shared_db, inner) == 0
    assert count_jobs(shared_db, kept_inner) == 1


def test_autocommit_connection_is_refused_and_nothing_written(
    driver: Driver, app: Celery, shared_db: str
) -> None:
    tid = _tid()
    with driver.autocommit() as conn, pytest.raises(ConnectionInAutocommit) as info:
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), task_id=tid)
    assert "committed on its own" in str(info.value)
    assert count_jobs(shared_db, tid) == 0


def test_aborted_transaction_is_refused_and_nothing_written(
    driver: Driver, app: Celery, shared_db: str
) -> None:
    tid = _tid()
    with driver.transaction() as conn:
        driver.fail_statement(conn)
        with pytest.raises(TransactionAborted):
            apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), task_id=tid)
        raise Rollback
    assert count_jobs(shared_db, tid) == 0


def test_store_statements_with_uuid_and_array_parameters_run_on_the_connection(
    driver: Driver, app: Celery, shared_db: str
) -> None:
    """Not only publish: any named statement runs through the adapter with its parameters."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    consumer = uuid.uuid4()
    with driver.transaction() as conn:
        tid = apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), queue=queue).id
        store = Store.on(CallerConnection(adapt(conn), schema="pgskip"))
        assert store.size(queue) == 1
        fetched = store.fetch([queue, "no-such-queue"], 5, consumer)  # text[] and uuid
        assert [row.payload["headers"]["id"] for row in fetched] == [tid]
        assert store.ack([fetched[0].tag], consumer) == 1
        raise Rollback
    assert count_jobs(shared_db, tid) == 0


def test_a_routed_publish_runs_through_the_connection(
    driver: Driver, app: Celery, shared_db: str
) -> None:
    """publish_routed runs through the adapter, inside the caller's transaction, every time."""
    from kombu_pgskip.envelope import to_routed_row

    name = f"ex-{uuid.uuid4().hex[:8]}"
    owner = Store(shared_db)
    try:
        owner.bind(name, name, "k", type="direct")
    finally:
        owner.close()
    message = {"body": "{}", "headers": {}, "properties": {"delivery_info": {}}}
    row = to_routed_row(name, message, eta_threshold=60, max_message_size=10**6)
    with driver.transaction() as conn:
        adapter = adapt(conn)
        store = Store.on(CallerConnection(adapter, schema="pgskip"))
        ran: list[str] = []
        run = adapter.run

        def recording(query: Query, text: str, params: Any) -> list[tuple[Any, ...]]:
            # Which runtime statement the adapter was given.
            ran.append(next((n for n, q in store.q.items() if q is query), text))
            return run(query, text, params)

        adapter.run = recording  # type: ignore[method-assign]
        for _ in range(3):
            assert store.publish_routed(row, exchange=name, routing_key="k", queues=[]) == [name]
        assert ran == ["publish_routed"] * 3
        assert store.size(name) == 3
        raise Rollback
