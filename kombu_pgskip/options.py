"""The transport's options, validated once (their meaning: the table in ``transport.py``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import exceptions
from .envelope import MAX_MESSAGE_SIZE_LIMIT
from .store import validate_schema_name


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
        values: dict[str, Any] = {}
        for name, value in options.items():
            if name not in known:
                continue  # kombu and Celery pass their own options through the same dict
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
