"""The app's settings, read from Django's: the database alias and the schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings  # type: ignore[import-untyped]
from django.db import DEFAULT_DB_ALIAS, connections  # type: ignore[import-untyped]

from ...exceptions import ConfigurationError
from ...options import Options

#: The alias in ``DATABASES`` of the database the schema lives in.
DATABASE_SETTING = "PGSKIP_DATABASE"
#: The broker's transport options, as Celery reads them with ``namespace="CELERY"``.
OPTIONS_SETTING = "CELERY_BROKER_TRANSPORT_OPTIONS"


def database_alias() -> str:
    """``settings.PGSKIP_DATABASE``, default ``"default"``."""
    alias = getattr(settings, DATABASE_SETTING, DEFAULT_DB_ALIAS)
    if not isinstance(alias, str):
        raise ConfigurationError(
            f"{DATABASE_SETTING} must be the alias of a database in DATABASES, not {alias!r}"
        )
    return alias


def schema() -> str:
    """The ``schema`` of ``settings.CELERY_BROKER_TRANSPORT_OPTIONS`` (default ``pgskip``);
    the other options are validated as the broker validates them."""
    options = getattr(settings, OPTIONS_SETTING, None) or {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"{OPTIONS_SETTING} must be a dict, not {type(options).__name__}")
    return Options.from_transport_options(dict(options)).schema


def database_problem(alias: str) -> str | None:
    """Why the database ``alias`` cannot hold the schema, or None."""
    if alias not in list(connections):  # the aliases of DATABASES
        return (
            f"{DATABASE_SETTING} is {alias!r}, which names no database in DATABASES: set it to "
            "the alias of the PostgreSQL database that apply_async_in writes to"
        )
    connection: Any = connections[alias]
    if connection.vendor != "postgresql":
        return (
            f"the pgskip schema lives in PostgreSQL, and the database {alias!r} "
            f"({DATABASE_SETTING}) uses Django's {connection.vendor} backend: point "
            f"{DATABASE_SETTING} at a database whose ENGINE is 'django.db.backends.postgresql'. "
            "Without one, remove 'kombu_pgskip.contrib.django' from INSTALLED_APPS and install "
            "the schema in the broker's database with `celery -A proj pgskip migrate`"
        )
    return None
