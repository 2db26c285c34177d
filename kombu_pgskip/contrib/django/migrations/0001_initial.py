"""Installs the pgskip schema, or brings it to the version of the installed kombu-pgskip.

Not atomic: each pgskip migration commits on its own, and some build indexes with CREATE INDEX
CONCURRENTLY, which cannot run in a transaction. Later releases need no new Django migration:
``manage.py migrate`` upgrades an installed schema before it runs the migrations
(``kombu_pgskip.contrib.django.schema.upgrade_before_migrate``).
"""

from django.db import migrations  # type: ignore[import-untyped]

from kombu_pgskip.contrib.django.operations import MigrateSchema


class Migration(migrations.Migration):  # type: ignore[misc]
    atomic = False
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [MigrateSchema()]
