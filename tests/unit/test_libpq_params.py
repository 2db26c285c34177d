"""The text-format parameters and placeholders of kombu_pgskip.libpq (pure logic)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from kombu_pgskip.libpq import array_literal, positional, text_value


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
