"""The migration operation that installs and upgrades the schema."""

from __future__ import annotations

from typing import Any

from django.db.migrations.exceptions import IrreversibleError  # type: ignore[import-untyped]
from django.db.migrations.operations.base import Operation  # type: ignore[import-untyped]

from ...sql import quote_ident
from . import conf
from .schema import connection_for, install_or_upgrade


class MigrateSchema(Operation):  # type: ignore[misc]
    """Brings the pgskip schema to the version of the installed kombu-pgskip
    (:func:`kombu_pgskip.migrate`) in the database of ``PGSKIP_DATABASE``; on other databases
    it does nothing. It commits each pgskip migration on its own and builds some indexes
    concurrently, so the Django migration holding it must be ``atomic = False``. It cannot be
    written as SQL (``sqlmigrate`` shows a comment) and is not reversed: reversing it raises
    :class:`IrreversibleError`, which says how to drop the schema by hand."""

    reversible = True  # database_backwards explains itself better than Django's message
    reduces_to_sql = False

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # no models

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        alias = schema_editor.connection.alias
        if alias == conf.database_alias():
            install_or_upgrade(connection_for(alias))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.alias != conf.database_alias():
            return
        schema = conf.schema()
        raise IrreversibleError(
            f"{app_label} migrations are not reversed: the schema {schema!r} holds the queued "
            "messages, and kombu-pgskip never drops it. To remove it, stop the workers, run "
            f"DROP SCHEMA {quote_ident(schema)} CASCADE in the database, then "
            f"`manage.py migrate {app_label} zero --fake`"
        )

    def describe(self) -> str:
        return "Install or upgrade the pgskip schema (kombu_pgskip.migrate)"
