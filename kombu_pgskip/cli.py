"""``celery -A proj pgskip ...`` subcommands, and ``python -m kombu_pgskip ...`` for deploy scripts.

Celery finds the ``pgskip`` group through the ``celery.commands`` entry point; importing this
module imports :mod:`kombu_pgskip`, which registers the ``pgskip://`` scheme in every ``celery``
CLI process (worker, inspect, events, purge, flower).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from . import exceptions
from .migrate import DEFAULT_SCHEMA, migrate
from .store import Store
from .urls import mask_url


class Target:
    """Where a command acts: a broker URL and a schema."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema

    @classmethod
    def from_app(cls, app: Any, schema: str | None) -> Target:
        url = app.conf.broker_write_url or app.conf.broker_url
        if not url:
            raise click.UsageError("the Celery app has no broker_url")
        if isinstance(url, (list, tuple)):
            url = url[0]
        options = app.conf.broker_transport_options or {}
        return cls(str(url), schema or options.get("schema", DEFAULT_SCHEMA))


def _fail(exc: BaseException) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def do_migrate(target: Target, dry_run: bool) -> None:
    try:
        result = migrate(target.url, schema=target.schema, dry_run=dry_run)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    where = f"{mask_url(target.url)} schema {target.schema!r}"
    if dry_run:
        if not result:
            click.echo(f"{where}: up to date, nothing would run")
        for block in result:
            click.echo(block)
        return
    if not result:
        click.echo(f"{where}: up to date")
    for label in result:
        click.echo(f"{where}: applied {label}")


def do_status(target: Target) -> None:
    store = Store(target.url, schema=target.schema)
    try:
        rows = store.queue_stats()
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    finally:
        store.close()
    headers = ("queue", "pending", "running", "scheduled", "failed", "oldest pending", "done/min")
    table = [
        (
            r["queue"],
            str(r["pending"]),
            str(r["running"]),
            str(r["scheduled"]),
            str(r["failed"]),
            "-" if r["oldest_pending_age"] is None else f"{r['oldest_pending_age']:.1f}s",
            str(r["completed_last_minute"]),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    if not table:
        click.echo("(no messages)")


_schema_option = click.option(
    "--schema",
    default=None,
    help="Schema name (default: broker_transport_options['schema'] or 'pgskip').",
)


@click.group(name="pgskip")
@click.pass_context
def pgskip(ctx: click.Context) -> None:
    """kombu-pgskip: the PostgreSQL broker's schema and operations."""


def _target(ctx: click.Context, schema: str | None) -> Target:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run as `celery -A proj pgskip ...`")
    return Target.from_app(app, schema)


@pgskip.command(name="migrate")
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@_schema_option
@click.pass_context
def migrate_cmd(ctx: click.Context, dry_run: bool, schema: str | None) -> None:
    """Install or upgrade the schema (safe to run concurrently; idempotent)."""
    do_migrate(_target(ctx, schema), dry_run)


@pgskip.command(name="status")
@_schema_option
@click.pass_context
def status_cmd(ctx: click.Context, schema: str | None) -> None:
    """A table per queue: pending, running, scheduled, failed, oldest pending, done per minute."""
    do_status(_target(ctx, schema))
