"""Bad input gets a clear error that says what to do, and nothing is half-written."""

from __future__ import annotations

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue

from kombu_pgskip import exceptions
from tests.helpers import make_url


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def _count(db_url: str) -> int:
    with psycopg.connect(db_url) as conn:
        return int(conn.execute("SELECT count(*) FROM pgskip.jobs").fetchone()[0])  # type: ignore[index]


@pytest.mark.parametrize(
    "url",
    ["pgskip://u:hunter2@host:notaport/db", "pgskip://u:hunter2@host:70000/db"],
)
def test_malformed_url_is_refused_with_the_expected_form(url: str) -> None:
    with pytest.raises(exceptions.InvalidURL) as info, Connection(url) as conn:
        conn.connect()
    assert "hunter2" not in str(info.value)
    assert "pgskip://user:password@host:5432/dbname" in str(info.value) or "port" in str(info.value)


def test_wrong_credentials_name_the_server_but_not_the_password(pg_server_dsn: str) -> None:
    url = _broker(pg_server_dsn).replace("postgres@", "no_such_role:hunter2@", 1)
    with pytest.raises(exceptions.ConnectionFailed) as info, Connection(url) as conn:
        conn.connect()
    message = str(info.value)
    assert "no_such_role" in message and "hunter2" not in message
    # kombu and Celery retry these: the server may come back or the password be fixed.
    assert isinstance(info.value, psycopg.OperationalError)


def test_unreachable_server_says_cannot_connect() -> None:
    with (
        pytest.raises(exceptions.ConnectionFailed, match="cannot connect to PostgreSQL"),
        Connection(
            "pgskip://u:pw@127.0.0.1:1/db", transport_options={"connect_timeout": 2}
        ) as conn,
    ):
        conn.connect()


def test_missing_schema_names_the_migrate_command(empty_db_url: str) -> None:
    with (
        pytest.raises(exceptions.SchemaNotInstalled, match="pgskip migrate"),
        Connection(_broker(empty_db_url)) as conn,
    ):
        conn.connect()


def test_missing_schema_is_not_a_retryable_connection_error(empty_db_url: str) -> None:
    with Connection(_broker(empty_db_url)) as conn:
        assert not issubclass(exceptions.SchemaNotInstalled, conn.connection_errors)


@pytest.mark.parametrize("queue", ["", "q" * 300, "bad\x00name"])
def test_invalid_queue_name_writes_nothing(db_url: str, queue: str) -> None:
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        with pytest.raises(exceptions.InvalidQueueName, match="queue name"):
            producer.publish({"x": 1}, routing_key=queue, exchange="")
        with pytest.raises(exceptions.InvalidQueueName):
            Queue(queue or "x" * 256, Exchange("e"), queue or "x")(conn.channel()).declare()
    assert _count(db_url) == 0


def test_oversized_message_writes_nothing(db_url: str) -> None:
    with Connection(_broker(db_url), transport_options={"max_message_size": 4096}) as conn:
        producer = Producer(conn.channel())
        with pytest.raises(exceptions.MessageTooLarge, match="max_message_size"):
            producer.publish({"blob": "x" * 10_000}, routing_key="q", exchange="")
    assert _count(db_url) == 0


def test_injection_strings_are_plain_data(db_url: str) -> None:
    evil = "q'; DROP TABLE pgskip.jobs; --"
    with Connection(_broker(db_url)) as conn:
        queue = conn.SimpleQueue(evil)
        queue.put({"task": "x'); DELETE FROM pgskip.jobs; --"})
        message = queue.get(timeout=2)
        assert message.payload == {"task": "x'); DELETE FROM pgskip.jobs; --"}
        message.ack()
        queue.close()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT queue FROM pgskip.jobs").fetchall() == [(evil,)]


def test_repr_of_transport_masks_the_password(db_url: str) -> None:
    url = _broker(make_url(db_url, "x")).replace("postgres@", "postgres:hunter2@", 1)
    with Connection(url) as conn:
        assert "hunter2" not in repr(conn.transport)
        assert "hunter2" not in conn.as_uri()
