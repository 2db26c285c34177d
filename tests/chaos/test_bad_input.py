"""Bad input: each a clear error that says what to do, and nothing written.

What tests/integration/test_errors.py already proves is not repeated here (invalid ports, an
unknown role, an unreachable host, a missing schema, empty/NUL/300-byte queue names, a message
over a small max_message_size). The table of inputs, errors and remedies is in
docs/operations.md.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from kombu import Connection, Producer
from psycopg import sql

from kombu_pgskip import apply_async_in, exceptions
from kombu_pgskip.grants import apply_grants, grant_statements
from tests.conftest import PgServer
from tests.safety_support import (
    Role,
    broker,
    count_jobs,
    create_runs_table,
    login_role,
    not_postgres_server,
    require_passwords,
    rows,
    safety_app,
    safety_worker,
    scalar,
    wait_for_runs,
)

SECRET = "s3cret-Pa55"


@pytest.mark.parametrize(
    "url",
    [
        f"pgskip://app:{SECRET}@[::1/db",  # libpq echoes the whole URI in its message
        f"pgskip://app:p@ss:{SECRET}@db.internal/app",  # unencoded "@" in the password
        f"pgskip://app:p:{SECRET}@db.internal/app",  # unencoded ":" in the password
        f"pgskip://app:{SECRET}@db.internal?application_name=me@x",  # "@" after "?"
        f"pgskip://app@db.internal/app?sslpassword={SECRET}%zz",  # any secret libpq option
        f"pgskip://app@db.internal/app?oauth_client_secret={SECRET}&no_such_option=1",
        f"pgskip://app:{SECRET}%zz@db.internal/app",  # bad percent-encoding
        f"pgskip://app:{SECRET}@db.internal/app?sslmode",  # option without a value
        f"pgskip://app:{SECRET}@db.internal/app?no_such_option=1",
        f"pgskip:/app:{SECRET}@db.internal/app",  # one slash
        f"redis://app:{SECRET}@db.internal/0",
    ],
)
def test_malformed_url_says_what_is_expected_and_never_shows_the_password(url: str) -> None:
    from kombu_pgskip.urls import to_conninfo

    with pytest.raises(exceptions.InvalidURL) as info:
        to_conninfo(url)
    message = str(info.value)
    assert SECRET not in message and "Pa55" not in message
    assert "pgskip://user:password@host:5432/dbname" in message or "percent-encode" in message


@pytest.fixture
def password_role(pg_server: PgServer, db_url: str) -> Iterator[Role]:
    require_passwords(pg_server)
    with login_role(pg_server.dsn, password=SECRET, databases=(db_url.rsplit("/", 1)[1],)) as r:
        yield r


def test_wrong_password_says_check_the_password_and_writes_nothing(
    db_url: str, password_role: Role
) -> None:
    url = broker(db_url).replace("postgres@", f"{password_role.name}:wrong-{SECRET}@", 1)
    with pytest.raises(exceptions.ConnectionFailed) as info, Connection(url) as conn:
        Producer(conn.channel()).publish({"x": 1}, routing_key="q")
    message = str(info.value)
    assert "password authentication failed" in message
    assert "check the user and password" in message
    assert SECRET not in message
    assert count_jobs(db_url) == 0


def test_a_server_that_is_not_postgresql_is_named_as_such() -> None:
    with not_postgres_server() as port:
        url = f"pgskip://app:{SECRET}@127.0.0.1:{port}/app"
        with (
            pytest.raises(exceptions.ConnectionFailed) as info,
            Connection(url, transport_options={"connect_timeout": 5}) as conn,
        ):
            conn.connect()
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and SECRET not in message
    assert "PostgreSQL server (not another service on that port)" in message
    assert "received invalid response" in message or "expected authentication" in message


@pytest.fixture
def read_only_database(db_url: str) -> str:
    """``db_url``'s database with ``default_transaction_read_only = on`` for new sessions."""
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
                sql.Identifier(dbname)
            )
        )
    return dbname


def test_read_only_database_refuses_publishing_with_the_fix(
    db_url: str, read_only_database: str
) -> None:
    with pytest.raises(exceptions.ReadOnlyDatabase) as info, Connection(broker(db_url)) as conn:
        Producer(conn.channel()).publish({"x": 1}, routing_key="q")
    message = str(info.value)
    assert "default_transaction_read_only is on (set by: database)" in message
    assert f'ALTER DATABASE "{read_only_database}" RESET default_transaction_read_only' in message
    # Not a connection error: retrying cannot help, so Celery must not retry it forever.
    assert not isinstance(info.value, psycopg.OperationalError)
    # In the caller's transaction the INSERT itself is refused, with the same error class.
    app = safety_app(broker(db_url))
    with psycopg.connect(db_url) as conn, pytest.raises(exceptions.ReadOnlyDatabase):
        apply_async_in(conn, app.signature("safetyapp.noop"))
    assert count_jobs(db_url) == 0


def test_read_only_role_refuses_the_worker_with_the_fix(
    pg_server: PgServer, db_url: str, password_role: Role
) -> None:
    dbname = db_url.rsplit("/", 1)[1]
    apply_grants(
        db_url, grant_statements(dbname, "pgskip", workers=[password_role.name], publishers=[])
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER ROLE {} IN DATABASE {} SET default_transaction_read_only = on").format(
                sql.Identifier(password_role.name), sql.Identifier(dbname)
            )
        )
    worker = safety_worker(broker(password_role.url(db_url)), db_url)
    worker.start(wait_ready=False)
    try:
        log = worker.wait_for_log(r"default_transaction_read_only is on[^\n]*", timeout=30).group(0)
        assert "(set by: database user)" in log
        assert f'ALTER ROLE "{password_role.name}" IN DATABASE "{dbname}" RESET' in log
        assert SECRET not in worker.log_text()
        assert "ReadOnlySqlTransaction" not in worker.log_text()  # no raw driver traceback
        worker.stop(timeout=10)
    finally:
        worker.kill9()
        worker.remove_log()
    assert count_jobs(db_url) == 0
    assert scalar(db_url, "SELECT count(*) FROM pgskip.consumers") == 0


def test_schema_option_naming_a_missing_schema_says_run_migrate(db_url: str) -> None:
    with (
        pytest.raises(exceptions.SchemaNotInstalled, match=r"'nosuch' not installed.*migrate"),
        Connection(broker(db_url), transport_options={"schema": "nosuch"}) as conn,
    ):
        conn.connect()


def test_a_100_mb_payload_is_refused_before_anything_is_written(db_url: str) -> None:
    app = safety_app(broker(db_url))
    blob = "x" * (100 * 1024 * 1024)
    with pytest.raises(exceptions.MessageTooLarge) as info:
        app.send_task("safetyapp.noop", args=(blob,))
    message = str(info.value)
    assert "max_message_size (67108864 bytes)" in message and "nothing was written" in message
    assert "pass large data by reference" in message
    with psycopg.connect(db_url) as conn, pytest.raises(exceptions.MessageTooLarge):
        apply_async_in(conn, app.signature("safetyapp.noop", args=(blob,)))
    assert count_jobs(db_url) == 0
    with pytest.raises(exceptions.ConfigurationError, match="max_message_size between"):
        Connection(broker(db_url), transport_options={"max_message_size": 2**31}).connect()


# Queue names: 1 to 255 bytes of UTF-8 without NUL, anything else round-trips exactly. Task
# names, exchange names and routing keys: any text round-trips exactly, 10 KB included.
WEIRD_QUEUES = ["q'\"; DROP TABLE pgskip.jobs; --", "очередь-队列-🚀 $$ \\ `x`", "é" * 127]
WEIRD_TASKS = ["t'\"; DELETE FROM pgskip.jobs; --", "задача.任务.🚀", "t" * 10_240]


def test_weird_queue_and_task_names_round_trip_through_a_real_worker(db_url: str) -> None:
    create_runs_table(db_url)
    app = safety_app(broker(db_url))
    args = ["'; DROP TABLE pgskip.jobs; --", "🚀" * 2_500, "\\x00 \\\\ $$"]
    env = {"SAFETY_EXTRA_TASK_NAMES": json.dumps(WEIRD_TASKS)}
    with safety_worker(broker(db_url), db_url, queues=WEIRD_QUEUES, extra_env=env) as worker:
        for queue in WEIRD_QUEUES:
            for task in WEIRD_TASKS:
                app.send_task(task, args=args, kwargs={"queue": queue}, queue=queue)
        wait_for_runs(db_url, 9)
        log = worker.log_text()
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT task, args, kwargs FROM safety_runs").fetchall()
    ran = sorted((r[0], json.loads(r[2])["queue"]) for r in rows)
    assert ran == sorted((t, q) for t in WEIRD_TASKS for q in WEIRD_QUEUES)
    assert all(json.loads(r[1]) == args for r in rows)
    assert "Traceback" not in log
    assert count_jobs(db_url) == scalar(
        db_url, "SELECT count(*) FROM pgskip.jobs WHERE status = 'completed'"
    )


def test_a_256_byte_unicode_queue_name_is_refused_before_anything_is_written(
    db_url: str,
) -> None:
    app = safety_app(broker(db_url))
    with pytest.raises(exceptions.InvalidQueueName, match="256 bytes"):
        app.send_task("safetyapp.noop", queue="é" * 128)
    assert count_jobs(db_url) == 0


COMPRESSION = {"bad compression": {"compression": "application/x-gzip"}}
UNDECODABLE = {
    "invalid utf-8": (b"\xff\xfe[[], {}, {}]", "application/json", "utf-8", "UnicodeDecodeError"),
    "unknown content-encoding": (b"[[], {}, {}]", "application/json", "x-nosuch", "LookupError"),
    "invalid json": (b'[[1, 2], {"a": ', "application/json", "utf-8", "JSONDecodeError"),
    "bad compression": (b"not zlib", "application/json", "utf-8", "cannot decompress"),
}


def test_undecodable_bodies_go_to_failed_with_the_reason_and_the_worker_carries_on(
    db_url: str,
) -> None:
    create_runs_table(db_url)
    app = safety_app(broker(db_url))
    with safety_worker(broker(db_url), db_url, queues=["default"]) as worker:
        with Connection(broker(db_url)) as conn:
            producer = Producer(conn.channel())
            for name, (body, content_type, encoding, _) in UNDECODABLE.items():
                task_id = str(uuid.uuid4())
                producer.publish(
                    body,
                    routing_key="default",
                    content_type=content_type,
                    content_encoding=encoding,
                    headers={"task": "safetyapp.record", "id": task_id, "lang": "py",
                             "argsrepr": name, **COMPRESSION.get(name, {})},
                )  # fmt: skip
        app.send_task("safetyapp.record", args=["after the bad ones"], queue="default")
        app.send_task("safetyapp.record", args=["compressed"], queue="default", compression="zlib")
        wait_for_runs(db_url, 2)
        assert worker.is_running()
    with psycopg.connect(db_url) as conn:
        failed = conn.execute(
            "SELECT payload->'headers'->>'argsrepr', last_error FROM pgskip.jobs"
            " WHERE status = 'failed' ORDER BY id"
        ).fetchall()
        statuses = conn.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1")
        assert dict(statuses.fetchall()) == {"failed": len(UNDECODABLE), "completed": 2}
    assert [f[0] for f in failed] == list(UNDECODABLE)
    for (_, error), (_, content_type, encoding, exc_name) in zip(
        failed, UNDECODABLE.values(), strict=True
    ):
        assert error.startswith("undecodable message body")
        assert content_type in error and encoding in error and exc_name in error
    ran = [r[0] for r in rows(db_url, "SELECT args FROM safety_runs ORDER BY id")]
    assert sorted(ran) == ['["after the bad ones"]', '["compressed"]']


def test_a_standby_is_named_with_target_session_attrs() -> None:
    """No standby in CI: the error built from what ``write_access`` reads on one."""
    error = exceptions.ReadOnlyDatabase.because(
        standby=True, source="default", user="app", database="app", where="pgskip://app:***@r/app"
    )
    assert "read-only standby" in str(error) and "target_session_attrs=read-write" in str(error)
