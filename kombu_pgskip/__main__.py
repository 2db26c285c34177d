"""``python -m kombu_pgskip ...``: the CLI without a Celery app, for deploy scripts."""

from __future__ import annotations

import click

from .cli import Target, do_migrate, do_status
from .migrate import DEFAULT_SCHEMA

_url = click.option(
    "--url",
    envvar="PGSKIP_URL",
    required=True,
    help="Broker or PostgreSQL URL (pgskip://... or postgresql://...); env PGSKIP_URL.",
)
_schema = click.option("--schema", default=DEFAULT_SCHEMA, show_default=True)


@click.group()
def main() -> None:
    """kombu-pgskip administration without a Celery app."""


@main.command()
@_url
@_schema
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
def migrate(url: str, schema: str, dry_run: bool) -> None:
    """Install or upgrade the schema."""
    do_migrate(Target(url, schema), dry_run)


@main.command()
@_url
@_schema
def status(url: str, schema: str) -> None:
    """Per-queue counts."""
    do_status(Target(url, schema))


if __name__ == "__main__":
    main()
