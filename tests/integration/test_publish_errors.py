"""apply_async_in refuses what it cannot do in the caller's transaction, before writing anything.

Per-driver autocommit and aborted-transaction refusals are in test_publish_drivers.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from celery import Celery
from celery.signals import before_task_publish

from kombu_pgskip import (
    ConfigurationError,
    ConnectionClosed,
    NotAConnection,
    PgSkipError,
    SchemaNotInstalled,
    apply_async_in,
    send_task_in,
)
from kombu_pgskip.exceptions import SchemaTooNew
from tests.publish_support import count_jobs, jobs, make_app


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = make_app(db_url)
    yield app
    app.close()


@pytest.fixture
def published() -> Iterator[list[str]]:
    """Task ids for which Celery's before_task_publish fired."""
    seen: list[str] = []

    def on_before(sender: str, headers: dict[str, Any], **kwargs: Any) -> None:
        seen.append(headers["id"])

    before_task_publish.connect(on_before, weak=False)
    yield seen
    before_task_publish.disconnect(on_before)


def test_database_without_schema_is_refused_and_the_transaction_stays_usable(
    empty_db_url: str, published: list[str]
) -> None:
    app = make_app(empty_db_url)
    try:
        with psycopg.connect(empty_db_url) as conn, conn.transaction():
            with pytest.raises(SchemaNotInstalled) as info:
                apply_async_in(conn, app.tasks["txn.add"], args=(1, 2))
            assert "pgskip migrate" in str(info.value)
            # The check cannot fail a statement, so the caller's work goes on.
            assert conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR
            assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
    finally:
        app.close()
    assert published == []


def test_schema_newer_than_this_package_is_refused(
    app: Celery, db_url: str, published: list[str]
) -> None:
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(
            "INSERT INTO pgskip.migrations (version, name, checksum) VALUES (9999, 'future', '')"
        )
    with psycopg.connect(db_url) as conn, conn.transaction(), pytest.raises(SchemaTooNew):
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 2))
    assert jobs(db_url) == []
    assert published == []


@pytest.mark.parametrize(
    "thing",
    [
        pytest.param(lambda url: object(), id="object"),
        pytest.param(lambda url: url, id="dsn-string"),
        pytest.param(
            lambda url: sa.create_engine(url.replace("postgresql", "postgresql+psycopg")),
            id="sqlalchemy-engine",
        ),
    ],
)
def test_object_that_is_not_a_connection_is_refused(
    app: Celery, db_url: str, thing: Any, published: list[str]
) -> None:
    with pytest.raises(NotAConnection) as info:
        apply_async_in(thing(db_url), app.tasks["txn.add"], args=(1, 2))
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, PgSkipError)
    assert "psycopg" in str(info.value) or "Engine" in str(info.value)
    assert jobs(db_url) == []
    assert published == []


def test_closed_connection_is_refused(app: Celery, db_url: str, published: list[str]) -> None:
    conn = psycopg.connect(db_url)
    conn.close()
    with pytest.raises(ConnectionClosed):
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 2))
    assert published == []


def test_autocommit_connection_inside_an_explicit_transaction_block_is_accepted(
    app: Celery, db_url: str
) -> None:
    tid = str(uuid.uuid4())
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(ZeroDivisionError), conn.transaction():
            apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), task_id=tid)
            _ = 1 / 0
        assert count_jobs(db_url, tid) == 0
        with conn.transaction():
            apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), task_id=tid)
    assert count_jobs(db_url, tid) == 1


def test_app_whose_broker_is_not_pgskip_is_refused(db_url: str, published: list[str]) -> None:
    other = Celery("other", broker="memory://", set_as_current=False)
    try:
        with (
            psycopg.connect(db_url) as conn,
            conn.transaction(),
            pytest.raises(ConfigurationError) as info,
        ):
            send_task_in(conn, "billing.send_invoice", app=other)
        assert "pgskip://" in str(info.value)
    finally:
        other.close()
    assert jobs(db_url) == []
    assert published == []


@pytest.mark.parametrize("option", ["connection", "producer", "retry"])
def test_options_that_would_leave_the_transaction_are_refused(
    app: Celery, db_url: str, option: str
) -> None:
    value: Any = True if option == "retry" else object()
    with (
        psycopg.connect(db_url) as conn,
        conn.transaction(),
        pytest.raises(TypeError, match=option),
    ):
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 2), **{option: value})
    assert jobs(db_url) == []


def test_caller_connection_is_left_open_and_in_its_transaction(app: Celery, db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("CREATE TEMP TABLE marker (x int)")  # opens the implicit transaction
        apply_async_in(conn, app.tasks["txn.add"], args=(1, 2))
        assert not conn.closed
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert jobs(db_url) == []  # not committed by apply_async_in
        conn.commit()
    assert len(jobs(db_url)) == 1
