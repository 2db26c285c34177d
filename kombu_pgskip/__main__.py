"""``python -m kombu_pgskip ...``: the CLI without a Celery app, for deploy scripts."""

from __future__ import annotations

from typing import Any

import click

from . import cli
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


# -- periodic tasks, maintenance, failed messages (see kombu_pgskip.cli) -------------------------


@main.command(name="beat-list")
@_url
@_schema
@cli.cron_database_option
def beat_list(url: str, schema: str, cron_database: str | None) -> None:
    """Stored periodic tasks and their pg_cron jobs."""
    cli.do_beat_list(Target(url, schema), cron_database)


@main.command(name="tick")
@_url
@_schema
@cli.maintenance_options
def tick(url: str, schema: str, **maintenance: Any) -> None:
    """Fire due periodic tasks and run maintenance once: run it every minute without pg_cron."""
    cli.do_tick(Target(url, schema), cli._maintenance_config(None, maintenance))


@main.command(name="maintenance")
@_url
@_schema
@click.option("--remove", is_flag=True, help="Unschedule the maintenance jobs.")
@cli.maintenance_options
@cli.cron_database_option
def maintenance(
    url: str, schema: str, remove: bool, cron_database: str | None, **options: Any
) -> None:
    """Install or update the pg_cron maintenance jobs."""
    config = cli._maintenance_config(None, options)
    cli.do_maintenance(Target(url, schema), config, remove, cron_database)


@main.command(name="cron-remove")
@_url
@_schema
@cli.cron_database_option
def cron_remove(url: str, schema: str, cron_database: str | None) -> None:
    """Unschedule every pg_cron job of this database and schema."""
    cli.do_cron_remove(Target(url, schema), cron_database)


@main.command(name="failed")
@_url
@_schema
@cli.failed_filters
@click.option("--full", is_flag=True, help="Print whole error texts.")
def failed(
    url: str,
    schema: str,
    queue: str | None,
    task: str | None,
    older_than: str | None,
    limit: int | None,
    full: bool,
) -> None:
    """List failed messages with their errors."""
    cli.do_failed(
        Target(url, schema), cli._failed_filter(queue, task, older_than, limit or 100), full
    )


@main.command(name="retry-failed")
@_url
@_schema
@cli.failed_filters
def retry_failed(
    url: str,
    schema: str,
    queue: str | None,
    task: str | None,
    older_than: str | None,
    limit: int | None,
) -> None:
    """Return failed messages to their queues."""
    cli.do_retry_failed(Target(url, schema), cli._failed_filter(queue, task, older_than, limit))


@main.command(name="purge-failed")
@_url
@_schema
@cli.failed_filters
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def purge_failed(
    url: str,
    schema: str,
    queue: str | None,
    task: str | None,
    older_than: str | None,
    limit: int | None,
    yes: bool,
) -> None:
    """Delete failed messages."""
    if not yes:
        click.confirm("Delete the matching failed messages?", abort=True)
    cli.do_purge_failed(Target(url, schema), cli._failed_filter(queue, task, older_than, limit))


@main.command()
@_url
@_schema
@cli.grant_options
def grant(
    url: str, schema: str, workers: tuple[str, ...], publishers: tuple[str, ...], dry_run: bool
) -> None:
    """GRANT a worker and a publisher role what they need (run as the schema's owner)."""
    cli.do_grant(Target(url, schema), list(workers), list(publishers), dry_run)


@main.command(name="doctor")
@_url
@_schema
def doctor(url: str, schema: str) -> None:
    """Check privileges and functions (run as the schema's owner); exits 1 on a finding."""
    cli.do_doctor(Target(url, schema))


@main.command(name="queue-args")
@_url
@_schema
@cli.queue_args_options
def queue_args(
    url: str, schema: str, queue: str, assignments: tuple[str, ...], unset: tuple[str, ...]
) -> None:
    """Show or change a declared queue's arguments (run as the schema's owner)."""
    cli.do_queue_args(Target(url, schema), queue, assignments, unset)


if __name__ == "__main__":
    main()
