"""When a worker sends the limited fetch of a queue (policy.LimitGate), and how a rate is read
(limits.parse_rate): no database."""

from __future__ import annotations

from typing import Any

import pytest

from kombu_pgskip import exceptions
from kombu_pgskip.limits import Limit, format_rate, parse_rate
from kombu_pgskip.policy import LimitGate


@pytest.mark.parametrize(
    ("text", "per_second"),
    [("10/s", 10.0), ("100/m", 100 / 60), ("1000/h", 1000 / 3600), ("2.5", 2.5), (" 3 / s ", 3.0),
     (7, 7.0), (".5", 0.5)],
)  # fmt: skip
def test_rates_read_as_celerys_rate_limit(text: Any, per_second: float) -> None:
    assert parse_rate(text) == pytest.approx(per_second)


@pytest.mark.parametrize("text", ["fast", "10/d", "-1/s", "0", "0/m", "1e3", "", "10/", True])
def test_other_rates_are_refused(text: Any) -> None:
    with pytest.raises(exceptions.ConfigurationError, match="rate"):
        parse_rate(text)


def test_rates_and_limits_read_back() -> None:
    assert [format_rate(r) for r in (10.0, 100 / 60, 1 / 3600, 0.25)] == [
        "10/s", "100/m", "1/h", "15/m",
    ]  # fmt: skip
    assert (
        Limit("q", 5, 1, 2.0, 2).describe() == "at most 5 running, 1 running per key, 2/s (burst 2)"
    )


def _fetched(gate: LimitGate, now: float, **found: Any) -> None:
    found = {"asked": 10, "took": 0, "limited": True, "more": True, "free": None,
             "tokens": None, "rate": None, **found}  # fmt: skip
    gate.fetched("q", now, **found)


def test_a_queue_becomes_due_when_it_is_known_and_goes_when_unlimited() -> None:
    gate = LimitGate(polling_interval=1.0)
    assert gate.known({"q", "r"}) is True
    assert gate.known({"q", "r"}) is False  # nothing new: no fetch owed
    assert gate.due(["p", "q", "r"], 0.0) == ["q", "r"]
    _fetched(gate, 0.0, limited=False)
    assert gate.due(["q", "r"], 0.0) == ["r"]


def test_at_its_limit_a_queue_waits_for_a_settle_or_the_poll_never_spinning() -> None:
    gate = LimitGate(polling_interval=1.0)
    gate.known({"q"})
    _fetched(gate, 10.0, took=2, free=0)
    assert gate.due(["q"], 10.5) == []
    assert gate.next_at(10.5) == 11.0  # the poll
    gate.notified({"q"})  # a new message frees no slot
    assert gate.due(["q"], 10.5) == []
    assert gate.settled("q") is True
    assert gate.due(["q"], 10.5) == ["q"]
    assert gate.next_at(10.5) is None
    assert gate.settled("q") is False  # once


def test_out_of_tokens_a_queue_is_due_when_the_next_token_is() -> None:
    gate = LimitGate(polling_interval=1.0)
    gate.known({"q"})
    _fetched(gate, 10.0, took=4, tokens=0.5, rate=4.0)
    assert gate.next_at(10.0) == pytest.approx(10.125)
    assert gate.due(["q"], 10.1) == []
    assert gate.due(["q"], 10.125) == ["q"]
    # A slow rate waits for the poll at most (a limit changed meanwhile is seen then).
    _fetched(gate, 20.0, tokens=0.0, rate=0.01)
    assert gate.next_at(20.0) == 21.0


def test_a_drained_queue_waits_for_a_notification_and_one_stopped_by_credit_does_not() -> None:
    gate = LimitGate(polling_interval=1.0)
    gate.known({"q"})
    _fetched(gate, 10.0, took=3, more=False)
    assert gate.due(["q"], 10.2) == []
    assert gate.settled("q") is False
    gate.notified({"q"})
    assert gate.due(["q"], 10.2) == ["q"]
    _fetched(gate, 11.0, asked=3, took=3, free=5)
    assert gate.due(["q"], 11.0) == ["q"]
    assert gate.next_at(11.0) is None


def test_every_message_waiting_for_its_keys_slot_waits_for_a_settle() -> None:
    gate = LimitGate(polling_interval=2.0)
    gate.known({"q"})
    _fetched(gate, 0.0, took=1, free=3, tokens=5.0, rate=10.0)
    assert gate.due(["q"], 1.0) == []
    assert gate.next_at(0.0) == 2.0
    assert gate.settled("q") is True
