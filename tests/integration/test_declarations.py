"""Declarations follow AMQP: the first declaration of a queue or exchange fixes its settings, a
later one with other settings fails (PRECONDITION_FAILED) and changes nothing, a passive one
only asks whether it exists."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import ChannelError

import kombu_pgskip  # noqa: F401  (registers pgskip://)
from kombu_pgskip import exceptions


@pytest.fixture
def conn(connections: Any) -> Connection:
    return connections()


def _queue_row(db_url: str, name: str) -> tuple[Any, ...] | None:
    with psycopg.connect(db_url) as c:
        return c.execute(
            "SELECT auto_delete, max_priority, message_ttl, expires, arguments::text, last_used_at"
            " FROM pgskip.queues WHERE name = %s",
            (name,),
        ).fetchone()


def test_the_same_declaration_again_refreshes_the_expiry_clock(
    conn: Connection, db_url: str
) -> None:
    queue = Queue("q", expires=60, max_priority=5)
    queue(conn.channel()).declare()
    first = _queue_row(db_url, "q")
    queue(conn.channel()).declare()
    again = _queue_row(db_url, "q")
    assert first is not None and again is not None
    assert (
        again[:5]
        == first[:5]
        == (False, 5, None, 60_000, '{"x-expires": 60000, "x-max-priority": 5}')
    )
    assert again[5] > first[5]


@pytest.mark.parametrize(
    ("first", "then", "named"),
    [
        ({}, {"expires": 1}, "x-expires=none, this declaration asks for "),
        ({"expires": 60}, {"expires": 30}, "x-expires=60000"),
        ({"message_ttl": 10}, {}, "x-message-ttl=10000"),
        ({"max_priority": 9}, {"max_priority": 4}, "x-max-priority=9"),
        ({}, {"auto_delete": True}, "auto_delete=False"),
    ],
)
def test_a_declaration_with_other_settings_fails_and_changes_nothing(
    conn: Connection, db_url: str, first: dict[str, Any], then: dict[str, Any], named: str
) -> None:
    Queue("q", **first)(conn.channel()).declare()
    Producer(conn.channel()).publish({"n": 1}, routing_key="q")
    before = _queue_row(db_url, "q")
    with pytest.raises(exceptions.PreconditionFailed) as info:
        Queue("q", **then)(conn.channel()).declare()
    message = str(info.value)
    assert message.startswith("PRECONDITION_FAILED - queue 'q' was declared with ")
    assert named in message and "pgskip queue-args q" in message
    assert isinstance(info.value, ChannelError)  # what kombu and Celery treat as a channel error
    assert _queue_row(db_url, "q") == before
    assert conn.default_channel.queue_declare("q", passive=True).message_count == 1


def test_settings_without_an_effect_here_do_not_have_to_agree(
    conn: Connection, db_url: str
) -> None:
    """Every queue is a table (durable); other x- arguments are kept as first declared."""
    Queue("q", durable=True, queue_arguments={"x-queue-type": "quorum"})(conn.channel()).declare()
    Queue("q", durable=False, queue_arguments={"x-dead-letter-exchange": "dlx"})(
        conn.channel()
    ).declare()
    row = _queue_row(db_url, "q")
    assert row is not None and row[4] == '{"x-queue-type": "quorum"}'


def test_an_exchange_of_another_type_fails_and_changes_nothing(
    conn: Connection, connections: Any, db_url: str
) -> None:
    Exchange("ex", "topic", durable=True)(conn.channel()).declare()
    other = connections()  # another process
    Exchange("ex", "topic", durable=False)(other.channel()).declare()  # no effect here
    with pytest.raises(exceptions.PreconditionFailed, match="type 'topic', not 'fanout'"):
        Exchange("ex", "fanout")(other.channel()).declare()
    assert other.default_channel.state.exchanges["ex"]["type"] == "topic"
    with psycopg.connect(db_url) as c:
        assert c.execute("SELECT type FROM pgskip.exchanges WHERE name = 'ex'").fetchone() == (
            "topic",
        )


def test_passive_declarations_only_ask(conn: Connection, connections: Any, db_url: str) -> None:
    channel = conn.channel()
    with pytest.raises(ChannelError, match="NOT_FOUND - no queue 'nope'"):
        channel.queue_declare("nope", passive=True)
    with pytest.raises(ChannelError, match="NOT_FOUND - no exchange 'nope'"):
        channel.exchange_declare("nope", passive=True)
    Queue("q", expires=60)(channel).declare()
    Exchange("ex", "topic")(channel).declare()
    fresh = connections()  # another process
    # A passive declaration with other settings is no declaration: it neither fails nor
    # changes them.
    ok = fresh.channel().queue_declare("q", passive=True, arguments={"x-expires": 1})
    assert ok.queue == "q"
    fresh.channel().exchange_declare("ex", "fanout", passive=True)
    row = _queue_row(db_url, "q")
    assert row is not None and row[3] == 60_000
