"""The Django app: its settings check and the receiver that upgrades the schema."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]


class PgSkipConfig(AppConfig):  # type: ignore[misc]
    name = "kombu_pgskip.contrib.django"
    label = "kombu_pgskip"
    verbose_name = "kombu-pgskip"

    def ready(self) -> None:
        from django.core import checks  # type: ignore[import-untyped]
        from django.db.models.signals import pre_migrate  # type: ignore[import-untyped]

        from .checks import check_settings
        from .schema import upgrade_before_migrate

        checks.register(check_settings)
        pre_migrate.connect(
            upgrade_before_migrate, sender=self, dispatch_uid="kombu_pgskip.upgrade_schema"
        )
