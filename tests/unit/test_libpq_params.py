"""The text-format parameters and placeholders of kombu_pgskip.libpq, and the parameters of
publish_many's statement (pure logic)."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pytest

from kombu_pgskip import exceptions
from kombu_pgskip.libpq import array_literal, positional, text_value
from kombu_pgskip.store import NewMessage, _many_params


def test_placeholders_become_numbered_once_per_name() -> None:
    query, names = positional("SELECT %(a)s, %(b)s, %(a)s || %(c)s")
    assert query == "SELECT $1, $2, $1 || $3"
    assert names == ["a", "b", "c"]


def test_text_values() -> None:
    assert text_value(None) is None
    assert text_value("é") == "é".encode()
    assert text_value(True) == b"t" and text_value(False) == b"f"
    assert text_value(-12) == b"-12"
    u = uuid.uuid4()
    assert text_value(u) == str(u).encode()
    when = datetime(2026, 11, 29, 12, 0, 1, 500, tzinfo=timezone.utc)
    assert text_value(when) == b"2026-11-29T12:00:01.000500+00:00"
    assert text_value(["a", 'b"\\c']) == b'{"a","b\\"\\\\c"}'


def test_array_literals_quote_strings_and_not_ints() -> None:
    assert array_literal([1, 2]) == b"{1,2}"
    assert array_literal([]) == b"{}"
    assert array_literal(["NULL", "{x}", "a,b"]) == b'{"NULL","{x}","a,b"}'


def test_unknown_parameter_types_are_refused() -> None:
    with pytest.raises(TypeError, match="float"):
        text_value(1.5)


def test_publish_many_parameters_split_back_into_each_message() -> None:
    when = datetime(2026, 11, 29, 12, 0, 1, tzinfo=timezone.utc)
    messages = [
        NewMessage("q", 1, "pending", None, json.dumps({"b": f"\x1e{i}"}), "t", f"id{i}", None)
        for i in range(3)
    ] + [NewMessage('q "2"', 9, "scheduled", when, "{}", None, None, 1500)]
    params = _many_params(messages)
    # The separator in a body is escaped by JSON, so it only separates.
    assert params["payloads"].split("\x1e") == [m.payload for m in messages]
    rows = json.loads(params["rows"])
    assert [r["queue"] for r in rows] == ["q", "q", "q", 'q "2"']
    assert rows[3] == {
        "queue": 'q "2"', "priority": 9, "status": "scheduled", "run_at": when.isoformat(),
        "task_name": None, "task_id": None, "ttl_ms": 1500,
    }  # fmt: skip
    assert rows[0]["task_id"] == "id0" and "payload" not in rows[0]


def test_publish_many_refuses_a_payload_that_is_not_json_text() -> None:
    raw = NewMessage("q", 0, "pending", None, '{"b": "\x1e"}', None, None, None)
    with pytest.raises(exceptions.ConfigurationError, match="U\\+001E"):
        _many_params([NewMessage("q", 0, "pending", None, "{}", None, None, None), raw])


def test_publish_many_parameters_of_no_messages_are_empty_not_refused() -> None:
    # No payload means no separator: the U+001E check must not count one that is missing.
    assert _many_params([]) == {"rows": "[]", "payloads": ""}
