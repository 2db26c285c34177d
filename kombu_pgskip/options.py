"""The transport's options, validated once (their meaning: the table in ``transport.py``).

``transport_options`` (Celery's ``broker_transport_options``) is one dict shared by kombu, Celery
and the transport. A key in it is one of:

* an option of this transport (the fields of :class:`Options`);
* a key kombu itself reads from, or writes into, every transport's options
  (:data:`KOMBU_OPTIONS`): accepted;
* an option of another kombu transport (:data:`OTHER_TRANSPORT_OPTIONS`), left in a
  configuration moved here from Redis, RabbitMQ or SQS: accepted, with one WARNING per process
  saying it has no effect here;
* anything else: a :class:`~kombu_pgskip.exceptions.ConfigurationError` naming the key and the
  closest option of this transport.
"""

from __future__ import annotations

import difflib
import logging
import threading
from dataclasses import dataclass, fields
from typing import Any

from . import exceptions
from .envelope import MAX_MESSAGE_SIZE_LIMIT
from .store import validate_schema_name

logger = logging.getLogger(__name__)

#: The key under which ``apply_async_in`` hands the caller's connection to its transport.
CALLER_CONNECTION_OPTION = "pgskip_caller_connection"

#: Keys kombu and Celery put into, or read from, the options of any transport:
#: ``Connection.ensure``'s retry policy (``Producer.publish(retry=True)`` adds the publish's
#: ``retry_policy``, e.g. Celery's ``task_publish_retry_policy``, to the connection's transport
#: options, and clones of the connection carry it), ``Connection``'s failover settings
#: (``_extract_failover_opts``), and the options kombu's virtual channel reads, which this
#: transport's channel honours (``body_encoding``, ``deadletter_queue``).
KOMBU_OPTIONS = frozenset(
    {
        # Connection.ensure() and a publish's retry_policy
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "errback",
        "on_revive",
        "retry_errors",
        # Connection._extract_failover_opts()
        "connect_retries_timeout",
        "callback",
        # kombu.transport.virtual.Channel.from_transport_options
        "body_encoding",
        "deadletter_queue",
        CALLER_CONNECTION_OPTION,
    }
)

#: Options of kombu's other transports that a configuration moved to pgskip may still carry,
#: with what plays their part here (empty: nothing needs to).
OTHER_TRANSPORT_OPTIONS: dict[str, str] = {
    # Redis and SQS (visibility_timeout also pgmq and SoftLayer MQ)
    "visibility_timeout": "a message returns to its queue when its consumer's lease runs out: "
    "lease_seconds",
    "fanout_prefix": "",
    "fanout_patterns": "",
    "global_keyprefix": "schema",
    "queue_order_strategy": "",
    "sep": "",
    "priority_steps": "",
    "max_connections": "",
    "socket_timeout": "connect_timeout",
    "socket_connect_timeout": "connect_timeout",
    "socket_keepalive": "",
    "socket_keepalive_options": "",
    "health_check_interval": "",
    "retry_on_timeout": "",
    "client_name": "",
    "master_name": "",
    "sentinel_kwargs": "",
    "min_other_sentinels": "",
    "ack_emulation": "",
    "unacked_key": "",
    "unacked_index_key": "",
    "unacked_mutex_key": "",
    "unacked_mutex_expire": "",
    "unacked_restore_limit": "",
    "unacked_restore_interval": "",
    "unacked_restore_throttle": "",
    "region": "",
    "predefined_queues": "",
    "queue_name_prefix": "",
    "wait_time_seconds": "",
    "is_secure": "",
    "sts_role_arn": "",
    "sts_token_timeout": "",
    # RabbitMQ (py-amqp's Connection arguments, and its management API)
    "confirm_publish": "publishes wait for the WAL flush unless durable_publish is False",
    "client_properties": "",
    "read_timeout": "",
    "write_timeout": "",
    "socket_settings": "",
    "channel_max": "",
    "frame_max": "",
    "manager_hostname": "",
    "manager_port": "",
    "manager_userid": "",
    "manager_password": "",
    # kombu's SQLAlchemy transport
    "queue_tablename": "schema",
    "message_tablename": "schema",
}

#: Where the options of this transport are documented (named in the error of an unknown key).
DOCUMENTED_IN = (
    "docs/reference/options.md, and the docstring of kombu_pgskip.transport "
    "(python -c 'import kombu_pgskip.transport as t; help(t)')"
)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _check_keys(names: list[str], known: list[str]) -> None:
    """Raise on the first key that is neither an option of this transport nor kombu's; warn
    (once per process and key) of the options of other transports."""
    for name in names:
        if name in known or name in KOMBU_OPTIONS:
            continue
        if name in OTHER_TRANSPORT_OPTIONS:
            with _warned_lock:
                if name in _warned:
                    continue
                _warned.add(name)
            instead = OTHER_TRANSPORT_OPTIONS[name]
            logger.warning(
                "transport option %s is another kombu transport's and has no effect on pgskip%s",
                name,
                f" (here: {instead})" if instead else "",
                extra={"action": "options"},
            )
            continue
        valid = [*known, *sorted(KOMBU_OPTIONS - {CALLER_CONNECTION_OPTION})]
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the options: {', '.join(known)}."
        raise exceptions.ConfigurationError(
            f"unknown transport option {name!r}{hint} They are listed in {DOCUMENTED_IN}."
        )


@dataclass
class Options:
    """Transport options, validated. See the module docstring for their meaning."""

    schema: str = "pgskip"
    polling_interval: float = 1.0
    listen: bool = True
    lease_seconds: float = 30.0
    sweep_interval: float = 10.0
    max_attempts: int = 20
    eta_threshold: float = 2.0
    fetch_limit: int = 100
    fetch_max_bytes: int = 16 * 1024 * 1024
    max_message_size: int = 64 * 1024 * 1024
    connect_timeout: float = 10.0
    check_schema: bool = True
    synchronous_acks: bool = False
    async_fetch: bool = True
    durable_publish: bool = True
    notify_after_commit: bool = True
    xmin_horizon_warning: float = 300.0
    prepared_statements: bool = True
    fetch_cooldown: float = 0.002
    fetch_cooldown_max: float = 0.02
    keep_completed: bool = True

    @property
    def connect_kwargs(self) -> dict[str, Any]:
        """psycopg arguments for every broker connection of a transport."""
        kwargs: dict[str, Any] = {"connect_timeout": self.connect_timeout}
        if not self.prepared_statements:
            # Transaction pooling runs each statement on any server connection: a statement
            # psycopg prepared on one is unknown, or another statement, on the next.
            kwargs["prepare_threshold"] = None
        if not self.listen:
            # Poll-only is the mode for PgBouncer in transaction pooling, where a session
            # setting would reach whichever client uses the server session next.
            kwargs["pin_search_path"] = False
        return kwargs

    @classmethod
    def from_transport_options(cls, options: dict[str, Any]) -> Options:
        known = {f.name: f for f in fields(cls)}
        _check_keys([str(name) for name in options], list(known))
        values: dict[str, Any] = {}
        for name, value in options.items():
            if name not in known:
                continue  # kombu's, Celery's, or another transport's (checked above)
            default = getattr(cls, name)
            try:
                if isinstance(default, bool):
                    if isinstance(value, str):
                        value = value.strip().lower() in ("1", "true", "yes", "on")
                    values[name] = bool(value)
                else:
                    values[name] = type(default)(value)
            except (TypeError, ValueError):
                raise exceptions.ConfigurationError(
                    f"transport option {name}={value!r}: expected {type(default).__name__}"
                ) from None
        opts = cls(**values)
        opts.validate()
        return opts

    def validate(self) -> None:
        validate_schema_name(self.schema)
        for name in ("polling_interval", "lease_seconds", "sweep_interval", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise exceptions.ConfigurationError(f"transport option {name} must be > 0")
        if self.lease_seconds < 3:
            raise exceptions.ConfigurationError("transport option lease_seconds must be >= 3")
        if (
            self.max_attempts < 1
            or self.fetch_limit < 1
            or self.fetch_max_bytes < 1
            or not 1024 <= self.max_message_size <= MAX_MESSAGE_SIZE_LIMIT
        ):
            raise exceptions.ConfigurationError(
                "transport options max_attempts, fetch_limit and fetch_max_bytes must be >= 1, "
                f"max_message_size between 1024 and {MAX_MESSAGE_SIZE_LIMIT}"
            )
        for name in (
            "eta_threshold",
            "xmin_horizon_warning",
            "fetch_cooldown",
            "fetch_cooldown_max",
        ):
            if getattr(self, name) < 0:
                raise exceptions.ConfigurationError(f"transport option {name} must be >= 0")


def app_broker(app: Any) -> tuple[str | None, str]:
    """A Celery app's broker URL (``broker_write_url``, else ``broker_url``; the first of a
    list of failover URLs; None when it has none) and the schema of its transport options
    (``broker_transport_options['schema']``, else ``pgskip``)."""
    from .migrate import DEFAULT_SCHEMA

    url = app.conf.broker_write_url or app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    options = app.conf.broker_transport_options or {}
    return (str(url) if url else None), str(options.get("schema", DEFAULT_SCHEMA))
