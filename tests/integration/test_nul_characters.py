"""U+0000 and the text ``\\u0000``: what PostgreSQL refuses, and what the broker does about it.

A message's JSON escapes a NUL as ``\\u0000``. PostgreSQL's ``json`` stores that, but every
``->``/``->>`` on the value and every cast to ``jsonb`` then fails, and a text column cannot hold
a NUL at all: a NUL outside a base64-encoded body is refused before anything is written. The
text ``\\u0000`` (JSON ``\\\\u0000``) and any byte of a base64-encoded body are plain data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Producer, Queue
from psycopg import errors as pg_errors

from kombu_pgskip import apply_async_in, exceptions, send_task_in
from tests.safety_support import broker, count_jobs, safety_app

LITERAL = "\\u0000"  # the six characters backslash, u, 0, 0, 0, 0
NUL_ESCAPE = '{"a": "x\\u0000y", "b": 1}'  # JSON holding U+0000
ESCAPED_BACKSLASH = '{"a": "x\\\\u0000y", "b": 1}'  # JSON holding the text \u0000


@pytest.fixture
def app(db_url: str) -> Iterator[Any]:
    app = safety_app(broker(db_url), task_default_queue="nul")
    yield app
    app.close()


def _fetch(db_url: str, n: int, queue: str = "nul") -> list[Any]:
    """The ``n`` messages waiting in ``queue``, fetched and acknowledged as a consumer does."""
    got: list[Any] = []
    with Connection(broker(db_url)) as conn:
        bound = Queue(queue)(conn.channel())
        while len(got) < n:
            message = bound.get(accept=["json", "application/data", "text/plain"])
            assert message is not None, f"{len(got)} of {n} messages in {queue!r}"
            message.ack()
            got.append(message)
        assert bound.get() is None
    return got


def test_where_postgresql_refuses_a_nul(db_url: str) -> None:
    """The facts the envelope's check rests on (PostgreSQL 15 and later)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(psycopg.DataError, match="cannot contain NUL"):
            conn.execute("SELECT %s::text", ("a\x00b",))  # psycopg refuses to send it
        # json stores the escape and gives it back whole ...
        row = conn.execute("SELECT %s::json", (NUL_ESCAPE,)).fetchone()
        assert row == ({"a": "x\x00y", "b": 1},)
        # ... but nothing that reads inside it, whatever the key, nor jsonb, accepts it.
        for query in (
            "SELECT %s::json->'b'",
            "SELECT %s::json->>'b'",
            "SELECT %s::jsonb",
            "SELECT %s::json::jsonb",
            "SELECT * FROM json_to_recordset(('[' || %s || ']')::json) AS (a text, b int)",
        ):
            with pytest.raises(pg_errors.UntranslatableCharacter):
                conn.execute(query, (NUL_ESCAPE,))
        # An escaped backslash followed by u0000 is the six characters, everywhere.
        for query in ("SELECT %s::json->>'a'", "SELECT %s::jsonb->>'a'"):
            assert conn.execute(query, (ESCAPED_BACKSLASH,)).fetchone() == ("x\\u0000y",)
        # In the jobs table: stored, then a row that breaks operators' queries on the table.
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, payload) VALUES ('q', %s::json)", (NUL_ESCAPE,)
        )
        with pytest.raises(pg_errors.UntranslatableCharacter):
            conn.execute("SELECT payload->>'b' FROM pgskip.jobs")
        conn.execute("DELETE FROM pgskip.jobs")


def test_the_text_backslash_u0000_round_trips_through_send_task_and_apply_async_in(
    db_url: str, app: Any
) -> None:
    args = (LITERAL, "\\" + LITERAL, f"a{LITERAL}b")
    kwargs = {LITERAL: LITERAL}
    options = {"headers": {"h": LITERAL}}
    app.send_task(f"t{LITERAL}", args=args, kwargs=kwargs, **options)
    with psycopg.connect(db_url) as conn:
        apply_async_in(conn, app.signature(f"t{LITERAL}", args=args, kwargs=kwargs, **options))
        send_task_in(conn, f"t{LITERAL}", args, kwargs, app=app, **options)
    with psycopg.connect(db_url) as conn:  # readable inside, by SQL, as any other text
        texts = conn.execute(
            "SELECT task_name, payload->'headers'->>'h', payload->'headers'->>'kwargsrepr'"
            " FROM pgskip.jobs"
        ).fetchall()
    assert texts == [(f"t{LITERAL}", LITERAL, f"{{'{LITERAL}': '{LITERAL}'}}")] * 3
    for message in _fetch(db_url, 3):
        assert message.headers["task"] == f"t{LITERAL}"
        assert message.headers["h"] == LITERAL
        assert message.decode()[:2] == [list(args), kwargs]


def test_a_real_nul_in_args_round_trips_when_no_header_repeats_it(db_url: str, app: Any) -> None:
    """Celery copies the args into ``argsrepr`` and ``kwargsrepr`` (refused below), but the
    body is base64-encoded: given other reprs, the NULs reach the worker intact."""
    args, kwargs = ("a\x00b", "\x00"), {"k\x00": "\x00v"}
    reprs = {"argsrepr": "('a?b', '?')", "kwargsrepr": "{'k?': '?v'}"}
    app.send_task("t", args=args, kwargs=kwargs, **reprs)
    with psycopg.connect(db_url) as conn:
        apply_async_in(conn, app.signature("t", args=args, kwargs=kwargs, **reprs))
    with Connection(broker(db_url)) as conn:
        producer = Producer(conn.channel())
        producer.publish({"a": "x\x00y"}, routing_key="nul", declare=[Queue("nul")])
        producer.publish(b"\x00\xff\x00", routing_key="nul", content_type="application/data",
                         content_encoding="binary")  # fmt: skip
    got = _fetch(db_url, 4)
    assert [m.decode()[:2] for m in got[:2]] == [[list(args), kwargs]] * 2
    assert got[2].decode() == {"a": "x\x00y"}
    assert got[3].body == b"\x00\xff\x00"


NUL_PLACES: dict[str, tuple[str, dict[str, Any]]] = {
    "args (argsrepr)": ("t", {"args": ("a\x00b",)}),
    "kwargs (kwargsrepr)": ("t", {"kwargs": {"k": "\x00"}}),
    "header": ("t", {"headers": {"h": "a\x00b"}}),
    "task name": ("t\x00", {}),
    "task id": ("t", {"task_id": "id\x00"}),
    "queue": ("t", {"queue": "q\x00"}),
}


@pytest.mark.parametrize("where", list(NUL_PLACES))
def test_a_real_nul_outside_the_body_is_refused_with_nothing_written(
    db_url: str, app: Any, where: str
) -> None:
    name, options = NUL_PLACES[where]
    # (For a queue, Celery first declares an exchange named after it: refused there.)
    with pytest.raises(exceptions.ConfigurationError) as info:
        app.send_task(name, **options)
    assert "NUL" in str(info.value) and "\x00" not in str(info.value)
    with psycopg.connect(db_url) as conn, pytest.raises(exceptions.ConfigurationError, match="NUL"):
        apply_async_in(conn, app.signature(name, **options))
    if where in ("header", "task name", "queue"):  # the same, published with kombu alone
        with Connection(broker(db_url)) as conn, pytest.raises(exceptions.ConfigurationError):
            Producer(conn.channel()).publish(
                [[], {}, {}], routing_key=options.get("queue", "nul"),
                headers={"task": name, "id": "1", **options.get("headers", {})},
            )  # fmt: skip
    assert count_jobs(db_url) == 0


def test_a_periodic_entry_with_a_nul_is_refused_at_sync_with_nothing_stored(db_url: str) -> None:
    from kombu_pgskip.periodic import ScheduleRefused, beat_sync
    from tests.periodic_support import make_app

    schedule = {
        "fine": {"task": "periodic_tests.add", "schedule": 60, "args": ("\\u0000", 1)},
        "nul": {"task": "periodic_tests.add", "schedule": 60, "args": ("a\x00b", 1)},
    }
    with pytest.raises(ScheduleRefused, match=r"nul.*NUL character"):
        beat_sync(make_app(schedule), db_url, "pgskip", use_cron=False)
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM pgskip.beat_entries").fetchone() == (0,)
