"""Pure logic: URLs, queue names, message -> row, delivery tags, transport options."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from kombu_pgskip import exceptions
from kombu_pgskip.envelope import (
    Rebodied,
    _encode,
    make_tag,
    parse_tag,
    to_row,
    validate_queue_name,
)
from kombu_pgskip.fetcher import Cooldown
from kombu_pgskip.transport import Options
from kombu_pgskip.urls import build_url, mask_url, to_conninfo

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
