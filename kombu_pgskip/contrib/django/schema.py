"""The schema brought to the version of the installed kombu-pgskip, on Django's connection to
the database of ``PGSKIP_DATABASE``: by the app's migration, and before every ``migrate``."""

from __future__ import annotations

import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.db import connections  # type: ignore[import-untyped]

from ...migrate import latest_version, migrate
from ...migrate import plan as migration_plan
from . import conf


def connection_for(alias: str) -> Any:
    """Django's connection to ``alias``, or :class:`ImproperlyConfigured` saying why it
    cannot hold the schema."""
    problem = conf.database_problem(alias)
    if problem is not None:
        raise ImproperlyConfigured(problem)
    return connections[alias]


def install_or_upgrade(connection: Any) -> list[str]:
    """:func:`kombu_pgskip.migrate` on ``connection``, for the schema of the settings; the
    labels of the migrations applied."""
    return migrate(connection, schema=conf.schema())


def upgrade_before_migrate(
    sender: Any,
    *,
    using: str,
    plan: Any = None,
    verbosity: int = 1,
    stdout: Any = None,
    **kwargs: Any,
) -> None:
    """``pre_migrate``: an installed schema older than the installed kombu-pgskip is brought
    to its version before Django's migrations run (a migration of the project's that enqueues
    finds it current). A schema not installed is left to ``kombu_pgskip.0001_initial``; a
    ``migrate`` that unapplies migrations changes nothing."""
    alias = conf.database_alias()
    if using != alias or any(backwards for _, backwards in plan or ()):
        return
    connection = connection_for(alias)
    schema = conf.schema()
    state = migration_plan(connection, schema=schema)
    if not state.current or not state.steps:
        return
    applied = migrate(connection, schema=schema)
    if applied and verbosity >= 1:
        out = stdout if stdout is not None else sys.stdout
        out.write(
            f"  Upgraded the pgskip schema {schema!r} from {state.current:04d} to "
            f"{latest_version():04d}: applied {', '.join(applied)}\n"
        )
