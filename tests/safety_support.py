"""Helpers for tests/chaos/test_bad_input.py and test_security.py: login roles with real
passwords, least-privilege role sets, a TCP server that is not PostgreSQL, workers of
``tests/apps/safetyapp.py``."""

from __future__ import annotations

import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.conftest import PgServer
from tests.helpers import REPO_ROOT, CeleryWorker, make_url

APPS_DIR = str(REPO_ROOT / "tests" / "apps")
#: Members of this group must log in with a password over TCP (see require_passwords).
PASSWORD_GROUP = "pgskip_password_login"


def broker(db_url: str) -> str:
    return db_url.replace("postgresql://", "pgskip://", 1)


def as_role(url: str, user: str, password: str | None) -> str:
    """``url`` with its credentials replaced (percent-encoded)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{auth}@{host}"))


@contextmanager
def worker_role(server_dsn: str, db_url: str) -> Iterator[str]:
    """A login role granted what `pgskip grant --worker` grants: the URL of ``db_url`` as it;
    dropped afterwards."""
    with _granted_role(server_dsn, db_url, "worker") as url:
        yield url


@contextmanager
def publisher_role(server_dsn: str, db_url: str) -> Iterator[str]:
    """A login role granted what `pgskip grant --publisher` grants: the URL of ``db_url`` as
    it; dropped afterwards."""
    with _granted_role(server_dsn, db_url, "publisher") as url:
        yield url


@contextmanager
def _granted_role(server_dsn: str, db_url: str, kind: str) -> Iterator[str]:
    from kombu_pgskip.grants import apply_grants, grant_statements

    name, password = f"{kind}_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    role = sql.Identifier(name)
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(role, sql.Literal(password))
        )
    try:
        dbname = db_url.rsplit("/", 1)[1]
        roles = {"workers": [name] if kind == "worker" else [], "publishers": []}
        if kind == "publisher":
            roles["publishers"] = [name]
        apply_grants(db_url, grant_statements(dbname, "pgskip", **roles))
        yield as_role(db_url, name, password)
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            conn.execute(sql.SQL("DROP ROLE {}").format(role))


def scalar(db_url: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def rows(db_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute(query).fetchall()


def count_jobs(db_url: str) -> int:
    return int(scalar(db_url, "SELECT count(*) FROM pgskip.jobs"))


def create_runs_table(db_url: str) -> None:
    """The table ``safetyapp.record`` writes (task name, args, kwargs as JSON) into."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE safety_runs (id bigserial PRIMARY KEY, task text NOT NULL,"
            " args text NOT NULL, kwargs text NOT NULL)"
        )


def wait_for_runs(db_url: str, n: int, timeout: float = 30) -> None:
    """Wait until ``safety_runs`` has ``n`` rows."""
    from tests.acceptance.conftest import wait_until

    wait_until(
        lambda: scalar(db_url, "SELECT count(*) FROM safety_runs") >= n, timeout, f"{n} runs"
    )


def require_passwords(server: PgServer) -> None:
    """Members of :data:`PASSWORD_GROUP` must give a password (scram) on 127.0.0.1.

    Prepends one ``pg_hba.conf`` line on the session's embedded server and reloads it. Other
    roles keep trust authentication.
    """
    server_dsn = server.dsn
    if server.embedded is None:
        pytest.fail(
            "these tests edit pg_hba.conf to require passwords, which needs the embedded "
            "PostgreSQL: unset PGSKIP_TEST_DSN and set PGSKIP_TEST_SERVER=embedded"
        )
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (PASSWORD_GROUP,))
        if exists.fetchone() is None:
            conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(PASSWORD_GROUP)))
        hba = Path(server.embedded.data_dir) / "pg_hba.conf"
        line = f"host all +{PASSWORD_GROUP} 127.0.0.1/32 scram-sha-256\n"
        text = hba.read_text()
        if line in text:
            return
        hba.write_text(line + text)  # truncates in place: owner and mode stay
        conn.execute("SELECT pg_reload_conf()")
    # The postmaster reloads asynchronously: wait until a password-less login is refused.
    probe = f"pgskip_probe_{uuid.uuid4().hex[:8]}"
    with login_role(server_dsn, probe, "x") as role:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                psycopg.connect(as_role(server_dsn, role.name, None), connect_timeout=2).close()
            except psycopg.OperationalError:
                return
            time.sleep(0.1)
    raise AssertionError("pg_hba.conf change did not take effect")


@dataclass(frozen=True)
class Role:
    name: str
    password: str

    def url(self, db_url: str) -> str:
        return as_role(db_url, self.name, self.password)


@contextmanager
def login_role(
    server_dsn: str,
    name: str | None = None,
    password: str | None = None,
    *,
    databases: tuple[str, ...] = (),
    extra: str = "",
) -> Iterator[Role]:
    """A LOGIN role with a password, in :data:`PASSWORD_GROUP`; dropped afterwards (with what
    it owns or was granted in ``databases``)."""
    role = Role(
        name or f"pgskip_{uuid.uuid4().hex[:10]}",
        password or "pw-" + secrets.token_urlsafe(12),
    )
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {} " + extra).format(
                sql.Identifier(role.name),
                sql.Literal(role.password),
                sql.Identifier(PASSWORD_GROUP),
            )
        )
    try:
        yield role
    finally:
        for dbname in databases:
            with (
                suppress(psycopg.Error),
                psycopg.connect(make_url(server_dsn, dbname), autocommit=True) as conn,
            ):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role.name)))
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role.name,),
            )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role.name)))


@contextmanager
def not_postgres_server(reply: bytes = b"HTTP/1.1 400 Bad Request\r\n\r\n") -> Iterator[int]:
    """A TCP server on 127.0.0.1 that answers every connection with ``reply``; yields its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                with suppress(OSError):
                    conn.recv(1024)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, name="not-postgres", daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def safety_worker(broker_url: str, runs_dsn: str, **kwargs: Any) -> CeleryWorker:
    """A ``celery -A safetyapp worker`` (threads pool) whose record task writes to ``runs_dsn``."""
    env = {"SAFETY_RUNS_DSN": runs_dsn, **kwargs.pop("extra_env", {})}
    kwargs.setdefault("pool", "threads")
    kwargs.setdefault("concurrency", 2)
    return CeleryWorker("safetyapp", broker_url, cwd=APPS_DIR, extra_env=env, **kwargs)


def safety_app(broker_url: str, **conf: Any) -> Any:
    """A publishing Celery app (not the worker's module: nothing else is imported)."""
    from celery import Celery

    import kombu_pgskip  # noqa: F401

    app = Celery("safety_publisher", broker=broker_url, set_as_current=False)
    app.conf.update(task_ignore_result=True, broker_connection_retry=False, **conf)
    return app
