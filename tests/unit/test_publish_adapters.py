"""apply_async_in's pure logic: quoting, statement text, connection detection, error mapping."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from celery import Celery, chain, chord, group
from psycopg import errors as pg_errors

from kombu_pgskip import (
    NotAConnection,
    SchemaNotInstalled,
    TransactionAborted,
    UnsupportedCanvas,
    apply_async_in,
)
from kombu_pgskip.adapters import (
    adapt,
    pyformat_text,
    quote_ident,
    sqlstate_of,
    translate_driver_error,
)
from kombu_pgskip.sql import queries_for, raw_queries


@pytest.fixture
def app() -> Iterator[Celery]:
    # A broker nobody listens on: these tests must fail before any connection is attempted.
    app = Celery("unit", broker="pgskip://nobody@127.0.0.1:1/none", set_as_current=False)

    @app.task(name="unit.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    yield app
    app.close()


@pytest.mark.parametrize(
    ("name", "quoted"),
    [("pgskip", '"pgskip"'), ('we"ird', '"we""ird"'), ("Mixed Case", '"Mixed Case"')],
)
def test_identifier_quoting_doubles_inner_quotes(name: str, quoted: str) -> None:
    assert quote_ident(name) == quoted


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_identifier_that_postgres_cannot_hold_is_rejected(name: str) -> None:
    with pytest.raises(ValueError):
        quote_ident(name)


@pytest.mark.parametrize("schema", ["pgskip", 'odd"schema'])
def test_pyformat_text_is_the_statement_psycopg_composes(schema: str) -> None:
    """For every named statement, the text other drivers get equals psycopg's own rendering."""
    for name, composed in queries_for(schema).items():
        text = pyformat_text(raw_queries()[name], schema)
        assert text == composed.as_string(None), name
    publish = pyformat_text(raw_queries()["publish"], schema)
    assert f"{quote_ident(schema)}.jobs" in publish
    assert "%(payload)s" in publish


@pytest.mark.parametrize(
    "thing",
    [object(), "postgresql://localhost/db", 42, None],
    ids=["object", "dsn", "int", "none"],
)
def test_non_connections_are_rejected_naming_what_was_given(thing: object) -> None:
    with pytest.raises(NotAConnection) as info:
        adapt(thing)
    message = str(info.value)
    assert type(thing).__qualname__ in message
    for supported in ("psycopg 3", "psycopg2", "SQLAlchemy", "Django"):
        assert supported in message


def test_sqlalchemy_engine_is_rejected_with_how_to_get_a_connection() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(NotAConnection, match=r"engine\.begin\(\)"):
        adapt(engine)
    engine.dispose()


def test_sqlalchemy_connection_to_another_database_kind_is_rejected() -> None:
    engine = sa.create_engine("sqlite://")
    with engine.connect() as conn, pytest.raises(NotAConnection, match="PostgreSQL"):
        adapt(conn)
    engine.dispose()


def test_async_psycopg_connection_is_rejected() -> None:
    fake = object.__new__(psycopg.AsyncConnection)
    with pytest.raises(NotAConnection, match="async"):
        adapt(fake)


class _FakeDjangoConnection:
    vendor = "sqlite"
    alias = "default"
    in_atomic_block = True
    needs_rollback = False
    connection = None

    def get_autocommit(self) -> bool:
        return False

    def cursor(self) -> Any:
        raise AssertionError("must not be used")


def test_django_connection_to_another_backend_is_rejected() -> None:
    with pytest.raises(NotAConnection, match="sqlite"):
        adapt(_FakeDjangoConnection())


class _SAWrapped(Exception):
    def __init__(self, orig: BaseException) -> None:
        super().__init__("wrapped")
        self.orig = orig


class _Psycopg2Like(Exception):
    pgcode = "42P01"


def test_sqlstate_is_found_through_sqlalchemy_and_django_wrapping() -> None:
    assert sqlstate_of(pg_errors.UndefinedTable("x")) == "42P01"
    assert sqlstate_of(_SAWrapped(_Psycopg2Like())) == "42P01"
    try:
        try:
            raise pg_errors.InFailedSqlTransaction("x")
        except Exception as exc:
            raise RuntimeError("django's wrapper") from exc
    except RuntimeError as wrapped:
        assert sqlstate_of(wrapped) == "25P02"
    assert sqlstate_of(ValueError("no code")) is None


def test_driver_errors_translate_by_sqlstate() -> None:
    assert isinstance(translate_driver_error(_SAWrapped(_Psycopg2Like())), SchemaNotInstalled)
    assert isinstance(
        translate_driver_error(pg_errors.InFailedSqlTransaction("x")), TransactionAborted
    )
    assert translate_driver_error(pg_errors.DivisionByZero("x")) is None
    assert translate_driver_error(ValueError("no code")) is None


@pytest.mark.parametrize("shape", ["chord", "chain-group-task", "group-with-chord", "nested"])
def test_chords_are_refused_before_the_connection_is_looked_at(app: Celery, shape: str) -> None:
    add = app.tasks["unit.add"]
    header = [add.s(1, 1), add.s(2, 2)]
    canvas = {
        "chord": chord(header, add.s()),
        "chain-group-task": chain(group(header), add.s()),
        "group-with-chord": group(add.s(0, 0), chord(header, add.s())),
        "nested": chain(chain(group(header), add.s()), add.s(1)),
    }[shape]
    with pytest.raises(UnsupportedCanvas):
        apply_async_in(object(), canvas)


def test_chain_ending_in_a_group_is_not_a_chord(app: Celery) -> None:
    add = app.tasks["unit.add"]
    # Refused for the connection, not for the canvas: the group runs later, from the worker.
    with pytest.raises(NotAConnection):
        apply_async_in(object(), chain(add.s(1, 1), group(add.s(2), add.s(3))))


def test_something_that_is_not_a_task_is_rejected(app: Celery) -> None:
    with pytest.raises(TypeError, match="task or signature"):
        apply_async_in(object(), "unit.add")
