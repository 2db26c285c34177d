"""Which keys ``transport_options`` may hold: the transport's options, the keys kombu and Celery
put there for every transport, other transports' options (a warning), and nothing else."""

from __future__ import annotations

import logging

import pytest
from celery import Celery
from kombu import Connection

from kombu_pgskip import exceptions, options
from kombu_pgskip.options import KOMBU_OPTIONS, OTHER_TRANSPORT_OPTIONS, Options

URL = "pgskip://u:pw@127.0.0.1:1/db"


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "_warned", set())


def test_a_misspelled_option_names_the_key_the_closest_option_and_the_docs() -> None:
    with pytest.raises(exceptions.ConfigurationError) as caught:
        Options.from_transport_options({"polling_intervall": 0.5})
    message = str(caught.value)
    assert "unknown transport option 'polling_intervall'" in message
    assert "did you mean 'polling_interval'?" in message
    assert "docs/reference/options.md" in message
    assert "kombu_pgskip.transport" in message


def test_an_unknown_option_with_nothing_close_lists_the_options() -> None:
    with pytest.raises(exceptions.ConfigurationError, match="'zzz'; the options: schema, "):
        Options.from_transport_options({"zzz": 1})


def test_kombu_and_celery_keys_are_accepted_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Celery's task_publish_retry_policy, as Producer.publish(retry=True) adds it to the
    # connection's transport options, and Connection's failover settings.
    keys = {
        "max_retries": 3,
        "interval_start": 0,
        "interval_step": 0.2,
        "interval_max": 1,
        "errback": None,
        "on_revive": None,
        "retry_errors": None,
        "connect_retries_timeout": 5,
        "callback": None,
        "body_encoding": "base64",
        "deadletter_queue": "dead",
    }
    assert set(keys) | {options.CALLER_CONNECTION_OPTION} == KOMBU_OPTIONS
    with caplog.at_level(logging.WARNING, logger="kombu_pgskip.options"):
        assert Options.from_transport_options({**keys, "lease_seconds": 9}).lease_seconds == 9
    assert caplog.records == []


def test_another_transports_option_is_accepted_with_one_warning_per_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kombu_pgskip.options"):
        for _ in range(3):
            Options.from_transport_options({"visibility_timeout": 3600, "fanout_prefix": True})
    assert [r.getMessage() for r in caplog.records] == [
        "transport option visibility_timeout is another kombu transport's and has no effect "
        "on pgskip (here: a message returns to its queue when its consumer's lease runs out: "
        "lease_seconds)",
        "transport option fanout_prefix is another kombu transport's and has no effect on pgskip",
    ]


def test_no_option_is_both_ours_and_foreign() -> None:
    ours = {f for f in Options.__dataclass_fields__}
    assert not ours & KOMBU_OPTIONS and not ours & set(OTHER_TRANSPORT_OPTIONS)
    assert not KOMBU_OPTIONS & set(OTHER_TRANSPORT_OPTIONS)


def test_a_kombu_connection_refuses_a_misspelled_option() -> None:
    conn = Connection(URL, transport_options={"lease_second": 10})
    with pytest.raises(exceptions.ConfigurationError, match="did you mean 'lease_seconds'"):
        conn.transport  # noqa: B018  (the transport is made, and its options read, here)


def test_celery_broker_transport_options_are_checked_and_its_defaults_pass() -> None:
    app = Celery("t", broker=URL, set_as_current=False)
    assert app.connection_for_write().transport.options.schema == "pgskip"
    app.conf.broker_transport_options = {"polling_intervall": 1}
    with pytest.raises(exceptions.ConfigurationError, match="did you mean 'polling_interval'"):
        app.connection_for_write().transport  # noqa: B018
    app.conf.broker_transport_options = dict(app.conf.task_publish_retry_policy)
    assert app.connection_for_read().transport.options.polling_interval == 1.0
