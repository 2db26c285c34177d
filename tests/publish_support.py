"""Shared by the apply_async_in / send_task_in tests: apps, databases, drivers, job rows."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from celery import Celery
from psycopg import conninfo, sql

from tests.helpers import make_url


def broker_url(db_url: str) -> str:
    return db_url.replace("postgresql://", "pgskip://", 1)


def make_app(db_url: str, **conf: Any) -> Celery:
    """A Celery app on the test database's broker, with an ``add`` task (never run here)."""
    import kombu_pgskip  # noqa: F401  (registers pgskip://)

    app = Celery(f"txn-{uuid.uuid4().hex[:6]}", broker=broker_url(db_url), set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, **conf)

    @app.task(name="txn.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


@contextlib.contextmanager
def cloned_database(server_dsn: str, template: str) -> Iterator[str]:
    """A database cloned from the migrated template, for tests that share one per module."""
    name = f"pgskip_txn_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    try:
        yield make_url(server_dsn, name)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@dataclass(frozen=True)
class Job:
    id: int
    queue: str
    priority: int
    status: str
    task_name: str | None
    task_id: str | None
    payload: dict[str, Any]
    delayed: bool  # run_at after created_at
    ttl_seconds: float | None  # expires_at - created_at


def jobs(db_url: str, task_id: str | None = None) -> list[Job]:
    """Committed job rows (seen from a connection of our own), oldest first."""
    where = sql.SQL("") if task_id is None else sql.SQL("WHERE task_id = %(task_id)s")
    query = sql.SQL(
        "SELECT id, queue, priority, status::text, task_name, task_id, payload,"
        " run_at > created_at, extract(epoch FROM expires_at - created_at)::float8"
        " FROM pgskip.jobs {} ORDER BY id"
    ).format(where)
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(query, {"task_id": task_id}).fetchall()
    return [Job(*row) for row in rows]


def count_jobs(db_url: str, task_id: str) -> int:
    return len(jobs(db_url, task_id))


def client_backends(db_url: str) -> set[int]:
    """Server PIDs of every client connection to this database (seen from another database)."""
    dbname = conninfo.conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(make_url(db_url, "postgres"), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = %s AND backend_type = 'client backend'",
            (dbname,),
        ).fetchall()
    return {int(r[0]) for r in rows}


# -- the connection types apply_async_in accepts -------------------------------------------------


def _django_setup() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DATABASES={}, INSTALLED_APPS=[])
        django.setup()


@contextlib.contextmanager
def django_database(db_url: str) -> Iterator[str]:
    """A Django database alias for ``db_url``; yields the alias."""
    _django_setup()
    from django.db import connections

    params = conninfo.conninfo_to_dict(db_url)
    alias = f"txn_{uuid.uuid4().hex[:8]}"
    settings = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params["dbname"],
        "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""),
        "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
    }
    # configure_settings fills in Django's defaults; it insists on a "default" entry.
    filled = connections.configure_settings(
        {"default": {"ENGINE": "django.db.backends.dummy"}, alias: settings}
    )
    connections.settings[alias] = filled[alias]
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


class Rollback(Exception):
    """Raised inside a transaction block to roll it back."""


@dataclass
class Driver:
    """How one connection type opens a transaction, a savepoint, autocommit, an aborted state.

    ``transaction()`` yields the object to pass to apply_async_in; it commits on normal exit and
    rolls back when the block raises (:class:`Rollback` is swallowed). ``savepoint(obj)`` rolls
    back to a savepoint when its block raises :class:`Rollback`.
    """

    name: str
    transaction: Callable[[], contextlib.AbstractContextManager[Any]]
    savepoint: Callable[[Any], contextlib.AbstractContextManager[Any]]
    autocommit: Callable[[], contextlib.AbstractContextManager[Any]]
    fail_statement: Callable[[Any], None]


def _swallow_rollback() -> contextlib.AbstractContextManager[Any]:
    return contextlib.suppress(Rollback)


def _psycopg_fail(conn: Any) -> None:
    with contextlib.suppress(psycopg.Error):
        conn.execute("SELECT 1/0")


def psycopg_driver(db_url: str, *, cursor: bool = False) -> Driver:
    @contextlib.contextmanager
    def transaction() -> Iterator[Any]:
        with _swallow_rollback(), psycopg.connect(db_url) as conn, conn.transaction():
            if cursor:
                with conn.cursor() as cur:
                    yield cur
            else:
                yield conn

    @contextlib.contextmanager
    def savepoint(obj: Any) -> Iterator[None]:
        conn = obj.connection if cursor else obj
        with contextlib.suppress(Rollback), conn.transaction():
            yield

    @contextlib.contextmanager
    def autocommit() -> Iterator[Any]:
        with psycopg.connect(db_url, autocommit=True) as conn:
            yield conn.cursor() if cursor else conn

    def fail(obj: Any) -> None:
        _psycopg_fail(obj.connection if cursor else obj)

    return Driver(
        "psycopg-cursor" if cursor else "psycopg", transaction, savepoint, autocommit, fail
    )


def psycopg2_driver(db_url: str, *, cursor: bool = False) -> Driver:
    import psycopg2

    @contextlib.contextmanager
    def transaction() -> Iterator[Any]:
        conn = psycopg2.connect(db_url)
        try:
            try:
                yield conn.cursor() if cursor else conn
            except Rollback:
                conn.rollback()
            else:
                conn.commit()
        finally:
            conn.close()

    @contextlib.contextmanager
    def savepoint(obj: Any) -> Iterator[None]:
        conn = obj.connection if cursor else obj
        with conn.cursor() as cur:
            cur.execute("SAVEPOINT sp")
        try:
            yield
        except Rollback:
            with conn.cursor() as cur:
                cur.execute("ROLLBACK TO SAVEPOINT sp")
        else:
            with conn.cursor() as cur:
                cur.execute("RELEASE SAVEPOINT sp")

    @contextlib.contextmanager
    def autocommit() -> Iterator[Any]:
        conn = psycopg2.connect(db_url)
        conn.autocommit = True
        try:
            yield conn.cursor() if cursor else conn
        finally:
            conn.close()

    def fail(obj: Any) -> None:
        conn = obj.connection if cursor else obj
        with contextlib.suppress(psycopg2.Error), conn.cursor() as cur:
            cur.execute("SELECT 1/0")

    return Driver(
        "psycopg2-cursor" if cursor else "psycopg2", transaction, savepoint, autocommit, fail
    )


def sqlalchemy_driver(db_url: str, *, dbapi: str = "psycopg", session: bool = False) -> Driver:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    url = db_url.replace("postgresql://", f"postgresql+{dbapi}://", 1)

    @contextlib.contextmanager
    def transaction() -> Iterator[Any]:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            if session:
                with _swallow_rollback(), Session(engine) as s, s.begin():
                    yield s
            else:
                with _swallow_rollback(), engine.begin() as conn:
                    yield conn
        finally:
            engine.dispose()

    @contextlib.contextmanager
    def savepoint(obj: Any) -> Iterator[None]:
        with contextlib.suppress(Rollback), obj.begin_nested():
            yield

    @contextlib.contextmanager
    def autocommit() -> Iterator[Any]:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        try:
            if session:
                with Session(engine) as s:
                    yield s
            else:
                with engine.connect() as conn:
                    yield conn
        finally:
            engine.dispose()

    def fail(obj: Any) -> None:
        with contextlib.suppress(sa.exc.DBAPIError):
            obj.execute(sa.text("SELECT 1/0"))

    kind = "session" if session else "connection"
    return Driver(f"sqlalchemy-{dbapi}-{kind}", transaction, savepoint, autocommit, fail)


def django_driver(db_url: str, *, proxy: bool = False) -> Driver:
    def connection_for(alias: str) -> Any:
        from django.db import connections
        from django.utils.connection import ConnectionProxy

        # django.db.connection is exactly such a proxy, for the "default" alias.
        return ConnectionProxy(connections, alias) if proxy else connections[alias]

    @contextlib.contextmanager
    def transaction() -> Iterator[Any]:
        from django.db import transaction as dj_transaction

        with (
            django_database(db_url) as alias,
            _swallow_rollback(),
            dj_transaction.atomic(using=alias),
        ):
            yield connection_for(alias)

    @contextlib.contextmanager
    def savepoint(obj: Any) -> Iterator[None]:
        from django.db import transaction as dj_transaction

        with contextlib.suppress(Rollback), dj_transaction.atomic(using=obj.alias):
            yield

    @contextlib.contextmanager
    def autocommit() -> Iterator[Any]:
        with django_database(db_url) as alias:
            yield connection_for(alias)

    def fail(obj: Any) -> None:
        from django.db import DatabaseError
        from django.db import transaction as dj_transaction

        # As Django code does it: the error leaves an inner atomic block, which marks the
        # outer one as needing rollback.
        with (
            contextlib.suppress(DatabaseError),
            dj_transaction.atomic(using=obj.alias, savepoint=False),
            obj.cursor() as cur,
        ):
            cur.execute("SELECT 1/0")

    return Driver("django-proxy" if proxy else "django", transaction, savepoint, autocommit, fail)


DRIVERS: dict[str, Callable[[str], Driver]] = {
    "psycopg": psycopg_driver,
    "psycopg-cursor": lambda url: psycopg_driver(url, cursor=True),
    "psycopg2": psycopg2_driver,
    "psycopg2-cursor": lambda url: psycopg2_driver(url, cursor=True),
    "sqlalchemy-psycopg-connection": sqlalchemy_driver,
    "sqlalchemy-psycopg2-connection": lambda url: sqlalchemy_driver(url, dbapi="psycopg2"),
    "sqlalchemy-psycopg-session": lambda url: sqlalchemy_driver(url, session=True),
    "sqlalchemy-psycopg2-session": lambda url: sqlalchemy_driver(
        url, dbapi="psycopg2", session=True
    ),
    "django": django_driver,
    "django-proxy": lambda url: django_driver(url, proxy=True),
}
