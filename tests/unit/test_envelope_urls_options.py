"""Pure logic: URLs, queue names, message -> row, delivery tags, transport options."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import kombu
import pytest
from psycopg import pq

from kombu_pgskip import exceptions
from kombu_pgskip.envelope import (
    Rebodied,
    _encode,
    make_tag,
    parse_tag,
    refuse_nul,
    to_row,
    validate_queue_name,
)
from kombu_pgskip.policy import Cooldown
from kombu_pgskip.transport import Options
from kombu_pgskip.urls import (
    SECRET_PARAMETERS,
    build_url,
    connect,
    mask_url,
    scrub,
    to_conninfo,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def _message(**headers: object) -> dict[str, object]:
    return {
        "body": "e30=",
        "headers": {"task": "proj.add", "id": "abc", **headers},
        "properties": {"priority": 0, "delivery_info": {}},
    }


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("pgskip://u:secret@h:5432/db", "pgskip://u:***@h:5432/db"),
        (
            "pgskip://u@h/db?password=secret&sslmode=require",
            "pgskip://u@h/db?password=***&sslmode=require",
        ),
        ("pgskip://h/db", "pgskip://h/db"),
    ],
)
def test_mask_url_never_shows_the_password(url: str, expected: str) -> None:
    assert mask_url(url) == expected
    assert "secret" not in mask_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "pgskip://u:pw@h:5432/db",
        "pgskip+postgresql://u:pw@h1:5432,h2:5433/db?target_session_attrs=read-write",
        "postgresql://u@localhost/db?sslmode=disable",
    ],
)
def test_accepted_url_forms_become_libpq_urls(url: str) -> None:
    assert to_conninfo(url).startswith("postgresql://")


@pytest.mark.parametrize(
    "url",
    ["", "redis://localhost:6379/0", "pgskip://u:pw@h:notaport/db", "pgskip://u:pw@h:99999/db"],
)
def test_malformed_urls_raise_invalid_url_without_the_password(url: str) -> None:
    with pytest.raises(exceptions.InvalidURL) as info:
        to_conninfo(url)
    assert "pw" not in str(info.value).replace("pgskip", "")
    assert "pgskip://" in str(info.value)


def test_build_url_quotes_special_characters() -> None:
    url = build_url(hostname="h", port=5433, userid="a@b", password="p/w:@", virtual_host="db")
    assert url == "postgresql://a%40b:p%2Fw%3A%40@h:5433/db"
    assert "p%2Fw" not in mask_url(url)


def test_the_secret_parameters_are_those_libpq_displays_as_passwords_and_more() -> None:
    shown_as_password = {
        o.keyword.decode() for o in pq.Conninfo.get_defaults() if o.dispchar == b"*"
    }
    assert {"password", "sslpassword"} <= shown_as_password <= SECRET_PARAMETERS
    # Masked whatever the loaded libpq's version: PostgreSQL 18's OAuth secret and SCRAM keys.
    assert {"oauth_client_secret", "scram_client_key", "scram_server_key"} <= SECRET_PARAMETERS


SECRET = "Zq9Xw7Kv"


@pytest.mark.parametrize("key", sorted(SECRET_PARAMETERS | {"SSLPassword", "ssl%70assword"}))
def test_every_secret_parameter_is_masked_in_urls_conninfo_and_errors(key: str) -> None:
    url = f"pgskip://u@h:5432/db?sslmode=require&{key}={SECRET}&application_name=a"
    assert mask_url(url) == f"pgskip://u@h:5432/db?sslmode=require&{key}=***&application_name=a"
    conninfo = f"host=h {key}='{SECRET} x' {key} = {SECRET} dbname=db"
    assert mask_url(conninfo) == f"host=h {key}=*** {key} = *** dbname=db"
    echoed = f'invalid percent-encoded token: "{SECRET}" in "{SECRET}&application_name" of {url}'
    assert SECRET[:4] not in scrub(echoed, url)
    with pytest.raises(exceptions.InvalidURL) as info:  # libpq echoes the bad percent-encoding
        to_conninfo(f"pgskip://u@h/db?{key}={SECRET}%zz")
    assert SECRET[:4] not in str(info.value) and SECRET[:4] not in repr(info.value)
    with pytest.raises(exceptions.InvalidURL) as info:  # unknown to libpq, or badly written
        to_conninfo(f"pgskip://u@h/db?{key.upper()}={SECRET}")
    assert SECRET[:4] not in str(info.value)


@pytest.mark.parametrize("key", ["sslpassword", "oauth_client_secret"])
def test_reprs_and_connection_errors_mask_every_secret_parameter(key: str) -> None:
    url = f"pgskip://u@127.0.0.1:1/db?{key}={SECRET}&connect_timeout=2"
    with kombu.Connection(url) as connection:
        assert SECRET not in repr(connection.transport)
        with pytest.raises(exceptions.ConnectionFailed) as info:  # nothing listens on port 1
            connect(url)
    assert "127.0.0.1" in str(info.value) and SECRET[:4] not in str(info.value)


def test_a_parameter_whose_name_only_contains_a_secret_ones_is_shown() -> None:
    url = "pgskip://u@h/db?application_name=password&fallback_application_name=sslpassword"
    assert mask_url(url) == url


def _pieces(secret: str, size: int = 3) -> set[str]:
    return {secret[i : i + size] for i in range(len(secret) - size + 1)}


@pytest.mark.parametrize(
    ("url", "password"),
    [
        ("pgskip://user:p@ss@127.0.0.1/db", "p@ss"),
        ("pgskip://user:Zq9@Xw7Kv@127.0.0.1:5432/db", "Zq9@Xw7Kv"),
        ("pgskip://user:Zq9@Xw7@Kv@h1:5432,h2:5432/db?sslmode=require", "Zq9@Xw7@Kv"),
        ("pgskip://user:Zq9@Xw7Kv@h", "Zq9@Xw7Kv"),  # neither path nor query
        ("pgskip://user:Zq9?Xw7@Kv1@h/db", "Zq9?Xw7@Kv1"),  # libpq: host "Kv1@h"
        ("pgskip://user:Zq9@Xw7?Kv1@h/db", "Zq9@Xw7?Kv1"),  # libpq: query "Kv1@h/db"
        ("pgskip://user:Zq9@Xw7?Kv1=Qp2@h", "Zq9@Xw7?Kv1=Qp2"),  # or the query Kv1=Qp2@h?
        ("pgskip://user:Zq9:Xw7Kv@127.0.0.1/db", "Zq9:Xw7Kv"),
        ("pgskip://user:Zq9:Xw7@Kv1@127.0.0.1/db", "Zq9:Xw7@Kv1"),
        ("postgresql://user:Zq9:@127.0.0.1/db", "Zq9:"),
        ("pgskip+postgresql://me@corp:Zq9Xw7Kv@127.0.0.1/db", "Zq9Xw7Kv"),  # "@" in the user
    ],
)
def test_an_unencoded_at_or_colon_in_the_user_info_is_refused_without_a_piece_of_it(
    url: str, password: str
) -> None:
    with pytest.raises(exceptions.InvalidURL) as info:
        to_conninfo(url)
    message = str(info.value)
    assert "percent-encode" in message
    assert "@ as %40" in message and ": as %3A" in message
    for shown in (message, repr(info.value)):
        assert not _pieces(password) & _pieces(shown)
        assert "ss@1" not in shown


@pytest.mark.parametrize(
    "url",
    [
        "pgskip://user:p%40ss%3Aw%2Fd%3F@127.0.0.1/db",  # the same characters, percent-encoded
        "pgskip://me%40corp:pw@127.0.0.1/db",
        "pgskip://user:pw@h1:5432,h2:5432/db?target_session_attrs=read-write",
        "pgskip://user:pw@[::1]:5432,[fe80::1%25eth0]:5433/db",
        "pgskip://user:pw@h/db?options=-c%20x%3Dy&application_name=me@host:1",
        "pgskip://h/db?user=me@corp&password=p@ss:w",  # credentials as query values
        "pgskip://user:p?w#d@h/db",  # libpq ends the user info at "@" only (or at a "/")
        "pgskip://user:@h/db",
        "pgskip://user@h",
    ],
)
def test_at_and_colon_where_they_can_be_read_one_way_only_are_accepted(url: str) -> None:
    assert to_conninfo(url).startswith("postgresql://")


def test_an_at_in_a_query_value_after_the_host_alone_asks_for_percent_encoding() -> None:
    # "u:pw@h?application_name=me@x" could be the password "pw@h?application_name=me".
    with pytest.raises(exceptions.InvalidURL, match=r"write it as %40.*/dbname\?"):
        to_conninfo("pgskip://user:pw@h?application_name=me@x")
    assert to_conninfo("pgskip://user:pw@h?application_name=me%40x")
    assert to_conninfo("pgskip://user:pw@h/?application_name=me@x")


@pytest.mark.parametrize(
    "url", ["pgskip://user:p@ss@127.0.0.1/db", "pgskip://user:p:ss@127.0.0.1/db"]
)
def test_kombu_refuses_the_url_before_connecting_and_shows_no_piece_of_the_password(
    url: str,
) -> None:
    connection = kombu.Connection(url)
    with pytest.raises(exceptions.InvalidURL, match="percent-encode") as info:
        connection.connect()
    shown = [str(info.value), repr(info.value)]
    # kombu builds the transport to show the URL (the transport parses it), so showing the
    # connection raises the same error: what a log line gets is that error's text.
    for show in (repr, lambda c: c.as_uri(), lambda c: c.info()):
        try:
            shown.append(str(show(connection)))
        except exceptions.InvalidURL as exc:
            shown += [str(exc), repr(exc)]
    for text in shown:
        for piece in ("p@ss", "p:ss", "ss@1", "@ss", ":ss"):
            assert piece not in text, (piece, text)


@pytest.mark.parametrize("name", ["", "x" * 256, "a\x00b", "é" * 128, 42])
def test_invalid_queue_names_are_refused(name: object) -> None:
    with pytest.raises(exceptions.InvalidQueueName):
        validate_queue_name(name)


@pytest.mark.parametrize(
    "name", ["celery", "x" * 255, "emails.high", "ü-queue", "a'; DROP TABLE x;--"]
)
def test_valid_queue_names_pass_through(name: str) -> None:
    assert validate_queue_name(name) == name


def test_eta_beyond_threshold_waits_in_the_database() -> None:
    eta = NOW + timedelta(seconds=60)
    row = to_row(
        "q", _message(eta=eta.isoformat()), eta_threshold=2, max_message_size=10**6, now=NOW
    )
    assert (row.status, row.run_at) == ("scheduled", eta)


def test_eta_within_threshold_is_delivered_now() -> None:
    eta = NOW + timedelta(seconds=1)
    row = to_row(
        "q", _message(eta=eta.isoformat()), eta_threshold=2, max_message_size=10**6, now=NOW
    )
    assert (row.status, row.run_at) == ("pending", None)


def test_naive_eta_is_taken_as_utc() -> None:
    row = to_row(
        "q", _message(eta="2026-01-01T13:00:00"), eta_threshold=2, max_message_size=10**6, now=NOW
    )
    assert row.run_at == NOW + timedelta(hours=1)


def test_priority_is_clamped_to_amqp_range_and_task_fields_lifted() -> None:
    message = _message()
    message["properties"] = {"priority": 42}
    row = to_row("q", message, eta_threshold=2, max_message_size=10**6)
    assert row.priority == 9
    assert (row.task_name, row.task_id) == ("proj.add", "abc")


def test_oversized_message_is_refused_with_advice() -> None:
    message = _message()
    message["body"] = "x" * 5000
    with pytest.raises(exceptions.MessageTooLarge, match="max_message_size"):
        to_row("q", message, eta_threshold=2, max_message_size=1024)


LITERAL = "\\u0000"  # the six characters backslash, u, 0, 0, 0, 0
PLACES = ["header", "task name", "task id", "property", "delivery info", "header key", "body"]


def _place(message: dict[str, Any], where: str, text: str) -> dict[str, Any]:
    """A copy of ``message`` with ``text`` at ``where``."""
    message = json.loads(json.dumps(message))
    headers, properties = message["headers"], message["properties"]
    if where == "header key":
        headers[f"k{text}"] = 1
        return message
    node, key = {
        "header": (headers, "h"),
        "task name": (headers, "task"),
        "task id": (headers, "id"),
        "property": (properties, "reply_to"),
        "delivery info": (properties["delivery_info"], "routing_key"),
        "body": (message, "body"),  # a body without body_encoding
    }[where]
    node[key] = text
    return message


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("text", [LITERAL, "\\" + LITERAL, "a\\\\\\u0000b", '"\\u0000"'])
def test_the_text_backslash_u0000_is_a_value_like_any_other(where: str, text: str) -> None:
    message = _place(_message(), where, text)
    row = to_row("q", message, eta_threshold=2, max_message_size=10**6, now=NOW)
    assert json.loads(row.payload) == message


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("text", ["\x00", "a\x00b", "\\\x00", LITERAL + "\x00"])
def test_a_real_nul_outside_a_base64_body_is_refused(where: str, text: str) -> None:
    message = _place(_message(), where, text)
    with pytest.raises(exceptions.ConfigurationError, match="NUL character") as info:
        to_row("q", message, eta_threshold=2, max_message_size=10**6, now=NOW)
    assert "argsrepr" in str(info.value)  # where Celery puts the args a NUL came with


def test_a_real_nul_inside_a_base64_body_is_accepted_and_kept() -> None:
    body = json.dumps([["a\x00b", LITERAL], {}, {}]).encode() + b"\x00\xff"
    message: dict[str, Any] = _message()
    message["body"] = base64.b64encode(body).decode()
    message["properties"]["body_encoding"] = "base64"
    row = to_row("q", message, eta_threshold=2, max_message_size=10**6, now=NOW)
    assert base64.b64decode(json.loads(row.payload)["body"]) == body


def _holds_nul(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(v) for v in value)
    return isinstance(value, str) and "\x00" in value


@pytest.mark.parametrize(
    ("json_text", "nul"),
    [
        ('"\\u0000"', True),  # the escape of U+0000
        ('"\\\\u0000"', False),  # an escaped backslash, then u0000
        ('"\\\\\\u0000"', True),  # an escaped backslash, then the escape of U+0000
        ('"\\\\\\\\u0000"', False),
        ('["\\\\u0000", "\\u0000"]', True),  # the second one
        ('"\\u00000"', True),
        ('["\\u0001", "\\u1000", "u0000", "\\\\"]', False),
        ('{"\\\\": "u0000", "\\\\u0000": 1}', False),
    ],
)
def test_only_an_unescaped_backslash_u0000_is_taken_for_a_nul(json_text: str, nul: bool) -> None:
    assert _holds_nul(json.loads(json_text)) is nul  # as a JSON parser reads it
    if nul:
        with pytest.raises(exceptions.ConfigurationError, match="NUL character"):
            refuse_nul(json_text)
    else:
        refuse_nul(json_text)


@pytest.mark.parametrize(("body", "nul"), [(LITERAL, False), ("\\\x00", True), ("a\x00", True)])
def test_a_rebodied_row_refuses_a_nul_in_its_body_and_nothing_else(body: str, nul: bool) -> None:
    message = _message()
    message["body"] = "b"
    rows = Rebodied(to_row("q", message, eta_threshold=2, max_message_size=10**6), "queue 'q'",
                    max_message_size=10**6)  # fmt: skip
    if nul:
        with pytest.raises(exceptions.ConfigurationError, match="NUL character"):
            rows.with_body(body, "t")
    else:
        assert json.loads(rows.with_body(body, "t").payload)["body"] == body


def test_a_rebodied_row_is_the_row_of_the_same_message_with_another_body() -> None:
    message = _message(eta=(NOW + timedelta(hours=1)).isoformat(), note='"quoted" — ü \\ ')
    message["properties"] = {"priority": 4, "delivery_tag": "t-1", "body_encoding": "base64"}
    first = to_row("q", message, eta_threshold=2, max_message_size=10**6, now=NOW)
    rows = Rebodied(first, "queue 'q'", max_message_size=10**6)
    row = rows.with_body("b3RoZXI=", 't-2 "quoted"')
    tag = json.loads(row.payload)["properties"]["delivery_tag"]
    assert tag == 't-2 "quoted"'
    other = {**message, "body": "b3RoZXI=", "properties": {**message["properties"]}}
    other["properties"]["delivery_tag"] = tag
    assert row.payload == _encode(other)  # the same JSON text as encoding it whole
    assert row.to("q") == to_row("q", other, eta_threshold=2, max_message_size=10**6, now=NOW)
    small = Rebodied(first, "queue 'q'", max_message_size=len(first.payload) + 10)
    with pytest.raises(exceptions.MessageTooLarge, match="queue 'q'"):
        small.with_body("x" * 99, "t")


def test_delivery_tag_round_trips_row_and_attempt() -> None:
    assert parse_tag(make_tag(123, 4)) == (123, 4)


def test_options_defaults_and_coercion() -> None:
    opts = Options.from_transport_options(
        {"polling_interval": "0.5", "listen": "false", "visibility_timeout": 5}
    )
    assert opts.polling_interval == 0.5
    assert opts.listen is False
    assert opts.schema == "pgskip"


@pytest.mark.parametrize(
    "options",
    [
        {"lease_seconds": 1},
        {"max_attempts": 0},
        {"polling_interval": "soon"},
        {"schema": ""},
        {"fetch_cooldown": -0.001},
        {"fetch_cooldown_max": -1},
    ],
)
def test_invalid_options_raise_configuration_error(options: dict[str, object]) -> None:
    with pytest.raises(exceptions.ConfigurationError):
        Options.from_transport_options(options)


def test_prepared_statements_off_disables_psycopg_statement_preparation() -> None:
    # Behind PgBouncer in transaction pooling a prepared statement lives on one server
    # connection and the next statement may run on another (tests/chaos/test_pgbouncer.py).
    assert Options().connect_kwargs == {"connect_timeout": 10.0}
    opts = Options.from_transport_options({"prepared_statements": "false"})
    assert opts.connect_kwargs == {"connect_timeout": 10.0, "prepare_threshold": None}


def test_cooldown_doubles_on_empty_fetches_and_shrinks_to_base_on_rows() -> None:

    c = Cooldown(0.002, 0.02)
    for expected in (0.004, 0.008, 0.016, 0.02, 0.02):
        c.observe(0)
        assert c.value == pytest.approx(expected)
    c.observe(3)
    assert c.value == pytest.approx(0.018)
    for _ in range(40):
        c.observe(1)
    assert c.value == 0.002
    off = Cooldown(0.0, 0.02)  # fetch_cooldown=0: every notification fetches, always
    off.observe(0)
    assert off.value == 0.0
    fixed = Cooldown(0.005, 0.001)  # a ceiling below the base: fixed at the base
    fixed.observe(0)
    assert fixed.value == 0.005
