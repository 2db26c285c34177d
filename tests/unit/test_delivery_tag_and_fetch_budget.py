"""The delivery tag carries the delivery's fencing token; the byte budget of a fetch is a
validated transport option, and a fetch it stopped asks for another."""

from __future__ import annotations

import pytest

from kombu_pgskip import exceptions
from kombu_pgskip.envelope import make_tag, parse_tag, to_message
from kombu_pgskip.store import FETCH_MAX_BYTES, FetchedRow, fetch_filled
from kombu_pgskip.transport import Options


def _row(n: int, *, delivery: int = 7, budget_full: bool = False) -> FetchedRow:
    return FetchedRow(n, "q", {"body": "", "properties": {}}, False, 1, delivery, budget_full)


def test_a_delivery_tag_carries_the_token_of_its_delivery_not_the_attempt_number() -> None:
    token = 2**40 + 12345  # a transaction id with its epoch
    row = FetchedRow(42, "q", {"body": "", "properties": {}}, False, 3, token)
    assert to_message(row)["properties"]["delivery_tag"] == f"42.{token}"
    assert parse_tag(make_tag(42, token)) == (42, token) == row.tag


def test_a_fetch_stopped_by_its_limit_or_its_budget_is_filled() -> None:
    assert not fetch_filled([], 5)
    assert not fetch_filled([_row(1), _row(2)], 5)
    assert fetch_filled([_row(n) for n in range(5)], 5)
    assert fetch_filled([_row(1), _row(2, budget_full=True)], 5)


def test_fetch_max_bytes_defaults_to_16_mib_and_is_coerced() -> None:
    assert Options().fetch_max_bytes == FETCH_MAX_BYTES == 16 * 1024 * 1024
    assert Options.from_transport_options({"fetch_max_bytes": "1048576"}).fetch_max_bytes == 2**20


@pytest.mark.parametrize("value", [0, -1, "many"])
def test_a_fetch_max_bytes_below_one_is_refused(value: object) -> None:
    with pytest.raises(exceptions.ConfigurationError, match="fetch_max_bytes"):
        Options.from_transport_options({"fetch_max_bytes": value})
