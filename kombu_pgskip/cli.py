"""The ``pgskip`` command line: one click group, run by two entry points.

``celery -A proj pgskip <command>`` (Celery finds the group through the ``celery.commands``
entry point) and ``python -m kombu_pgskip <command>`` (also the ``kombu-pgskip`` script, for
deploy scripts without a Celery app) run the same commands with the same options. A command acts
on ``--url`` when given (env ``PGSKIP_URL``; the owner's commands ``grant``, ``doctor`` and
``queue-args`` read ``PGSKIP_OWNER_URL`` first), else on the Celery app's broker URL; without
either it stops with a usage error. The schema is ``--schema``, else the app's
``broker_transport_options['schema']``, else ``pgskip``. ``beat-sync`` reads the app's
``beat_schedule`` and so runs under Celery only; ``tick`` and ``maintenance`` take their
settings from their options, over ``app.conf.pgskip_maintenance`` when there is an app.

``--version`` prints ``kombu-pgskip <version>``. ``status``, ``failed``, ``beat-list`` and
``doctor`` take ``--json``: one JSON object on stdout, in the shape their ``--help`` shows (and
docs/cli-json.md); keys are only ever added to it. Times are ISO 8601 in UTC, durations
seconds, absent values ``null``. Errors go to stderr with exit status 1, as without ``--json``
(``doctor`` exits 1 when a check fails, after printing the object).

Each command's work is a ``do_*`` function; the click commands only resolve where it acts.
Importing this module imports :mod:`kombu_pgskip`, which registers the ``pgskip://`` scheme in
every ``celery`` CLI process (worker, inspect, events, purge, flower).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import click

from . import __version__, exceptions
from .migrate import DEFAULT_LOCK_TIMEOUT, DEFAULT_RETRIES, DEFAULT_SCHEMA, migrate
from .options import app_broker
from .store import Store
from .urls import mask_url


class Target:
    """Where a command acts: a broker URL and a schema."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema

    @classmethod
    def from_app(cls, app: Any, schema: str | None) -> Target:
        url, app_schema = app_broker(app)
        if not url:
            raise click.UsageError("the Celery app has no broker_url")
        return cls(url, schema or app_schema)


def _fail(exc: BaseException) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1: ``1 failed message``,
    ``3 failed messages``, ``0 failed messages``."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def _echo_json(value: dict[str, Any]) -> None:
    click.echo(json.dumps(value, indent=2))


def _utc(value: datetime | None) -> str | None:
    """A stored time as ISO 8601 in UTC (``2026-01-31T12:00:00+00:00``), or None."""
    return None if value is None else value.astimezone(timezone.utc).isoformat()


def do_migrate(
    target: Target,
    dry_run: bool,
    plan: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
) -> None:
    if plan:
        do_migrate_plan(target, lock_timeout, retries)
        return
    try:
        result = migrate(
            target.url,
            schema=target.schema,
            dry_run=dry_run,
            lock_timeout=lock_timeout,
            retries=retries,
        )
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


def do_migrate_plan(target: Target, lock_timeout: float, retries: int) -> None:
    """What ``migrate`` would run, the locks each statement takes, and whether the code running
    against the database stays compatible; changes nothing."""
    from .migrate import plan

    try:
        result = plan(target.url, schema=target.schema, lock_timeout=lock_timeout, retries=retries)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    click.echo(f"{mask_url(target.url)}: the plan (nothing is changed)")
    for line in result.lines():
        click.echo(line)


def do_status(target: Target, as_json: bool = False) -> None:
    from .migrate import latest_version, schema_window

    try:
        store = Store(target.url, schema=target.schema)
        try:
            rows = store.queue_stats()
            paused = store.paused()
            limits = store.limits()
        finally:
            store.close()
        oldest, current = schema_window(target.url, target.schema)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    paused_names = {str(p["name"]) for p in paused}
    limited_names = {str(lim["name"]) for lim in limits}
    if as_json:
        _echo_json(
            {
                "schema": target.schema,
                "schema_version": current,
                "oldest_compatible_version": oldest,
                "package_schema_version": latest_version(),
                "version": __version__,
                "queues": [
                    {
                        "queue": str(r["queue"]),
                        "pending": int(r["pending"]),
                        "running": int(r["running"]),
                        "scheduled": int(r["scheduled"]),
                        "failed": int(r["failed"]),
                        "oldest_pending_age": (
                            None
                            if r["oldest_pending_age"] is None
                            else float(r["oldest_pending_age"])
                        ),
                        "completed_last_minute": int(r["completed_last_minute"]),
                        "paused": str(r["queue"]) in paused_names,
                        "limited": str(r["queue"]) in limited_names,
                    }
                    for r in rows
                ],
                "paused": [
                    {
                        "queue": str(p["name"]),
                        "paused_at": _utc(p["paused_at"]),
                        "paused_by": str(p["paused_by"]),
                        "reason": p["reason"],
                        "pending": int(p["pending"]),
                    }
                    for p in paused
                ],
                "limits": [
                    {
                        "queue": str(lim["name"]),
                        "max_running": lim["max_running"],
                        "max_running_per_key": lim["max_running_per_key"],
                        "rate": lim["rate"],
                        "burst": lim["burst"],
                        "set_at": _utc(lim["set_at"]),
                        "set_by": str(lim["set_by"]),
                        "running": int(lim["running"]),
                        "pending": int(lim["pending"]),
                    }
                    for lim in limits
                ],
            }
        )
        return
    headers = ("queue", "pending", "running", "scheduled", "failed", "oldest pending", "done/min")
    table = [
        (
            str(r["queue"]),
            str(r["pending"]),
            str(r["running"]),
            str(r["scheduled"]),
            str(r["failed"]),
            "-" if r["oldest_pending_age"] is None else f"{r['oldest_pending_age']:.1f}s",
            str(r["completed_last_minute"]),
        )
        for r in rows
    ]
    _table(headers, table, "(no messages)")
    for p in paused:
        why = f": {p['reason']}" if p["reason"] else ""
        click.echo(
            f"paused: {p['name']!r} since {_fmt_time(p['paused_at'])} by {p['paused_by']}{why} "
            f"({plural(int(p['pending']), 'pending message')}; `pgskip resume {p['name']}`)"
        )
    for lim in limits:
        click.echo(
            f"limited: {lim['name']!r}: {_limits_text(lim)} since {_fmt_time(lim['set_at'])} "
            f"by {lim['set_by']} ({plural(int(lim['running']), 'running message')}, "
            f"{plural(int(lim['pending']), 'pending message')}; `pgskip unlimit {lim['name']}`)"
        )
    span = f"{oldest:04d}" if oldest >= current else f"{oldest:04d} to {current:04d}"
    click.echo(
        f"schema {target.schema!r} at version {current:04d}: code built for schema {span} runs "
        f"against it; this kombu-pgskip is built for {latest_version():04d}"
    )


def do_grant(target: Target, workers: list[str], publishers: list[str], dry_run: bool) -> None:
    from .grants import apply_grants, database_of, grant_statements

    try:
        grants = grant_statements(
            database_of(target.url), target.schema, workers=workers, publishers=publishers
        )
        for grant in grants:
            click.echo(f"{grant.text()};")
        if not dry_run:
            apply_grants(target.url, grants)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if dry_run:
        click.echo("dry run: nothing was granted")
    else:
        click.echo(
            f"granted ({plural(len(grants), 'statement')}) as the role of {mask_url(target.url)}"
        )


def do_queue_args(
    target: Target, queue: str, assignments: Sequence[str], unset: Sequence[str]
) -> None:
    from .queue_args import parse_assignment, set_queue_arguments

    try:
        changes = dict(parse_assignment(a) for a in assignments)
        before, after = set_queue_arguments(
            target.url, target.schema, queue, set=changes, unset=unset
        )
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if before == after:
        click.echo(f"queue {queue!r}: {json.dumps(after, sort_keys=True)}")
        return
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            old = json.dumps(before[key]) if key in before else "none"
            new = json.dumps(after[key]) if key in after else "none"
            click.echo(f"queue {queue!r}: {key} {old} -> {new}")


def _owner_only(
    exc: exceptions.PermissionDenied,
    target: Target,
    what: str,
    table: str = "paused_queues",
    privileges: str = "INSERT, DELETE",
) -> None:
    """A permission error of a command that writes what only the schema's owner writes."""
    _fail(
        exceptions.PermissionDenied(
            f"{what} writes {target.schema}.{table}, which only the schema's owner (and "
            f"roles it grants {privileges} on it) may write: run it as the owner (--url or "
            f"PGSKIP_OWNER_URL). {exc}"
        )
    )


def do_pause(target: Target, queues: Sequence[str], reason: str | None) -> None:
    try:
        store = Store(target.url, schema=target.schema)
        try:
            paused = store.pause(queues, reason)
            pending = {str(r["name"]): int(r["pending"]) for r in store.paused()}
        finally:
            store.close()
    except exceptions.PermissionDenied as exc:
        _owner_only(exc, target, "pausing")
        return
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    for queue in sorted(set(queues)):
        state = "paused" if queue in paused else "already paused"
        n = pending.get(queue, 0)
        click.echo(
            f"queue {queue!r}: {state}; {plural(n, 'pending message')} "
            f"{'waits' if n == 1 else 'wait'} until `pgskip resume {queue}`"
        )


def do_resume(target: Target, queues: Sequence[str], resume_all: bool) -> None:
    try:
        store = Store(target.url, schema=target.schema)
        try:
            names = [str(r["name"]) for r in store.paused()] if resume_all else list(queues)
            resumed = store.resume(names) if names else []
        finally:
            store.close()
    except exceptions.PermissionDenied as exc:
        _owner_only(exc, target, "resuming")
        return
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if resume_all and not names:
        click.echo("no queue is paused")
    for queue in sorted(set(names)):
        click.echo(f"queue {queue!r}: {'resumed' if queue in resumed else 'was not paused'}")


def do_unique_keys(target: Target, queue: str | None, limit: int, as_json: bool) -> None:
    try:
        store = Store(target.url, schema=target.schema)
        try:
            held = store.unique_keys(queue, limit)
        finally:
            store.close()
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if as_json:
        _echo_json({"keys": [{**k, "created_at": _utc(k["created_at"])} for k in held]})
        return
    _table(
        ("queue", "key", "status", "task", "task id", "published"),
        [
            (
                k["queue"],
                k["key"],
                k["status"],
                k["task"] or "-",
                k["task_id"] or "-",
                _fmt_time(k["created_at"]),
            )
            for k in held
        ],
        "(no unique key held)",
    )


def _limits_text(row: dict[str, Any]) -> str:
    from .limits import Limit

    return Limit(
        str(row["name"]), row["max_running"], row["max_running_per_key"], row["rate"], row["burst"]
    ).describe()


def do_limit(
    target: Target,
    queue: str,
    max_running: int | None,
    per_key: int | None,
    rate: str | None,
    burst: int | None,
) -> None:
    from .limits import parse_rate

    try:
        per_second = None if rate is None else parse_rate(rate)
        store = Store(target.url, schema=target.schema)
        try:
            row = store.set_limit(
                queue,
                max_running=max_running,
                max_running_per_key=per_key,
                rate=per_second,
                burst=burst,
            )
        finally:
            store.close()
    except exceptions.PermissionDenied as exc:
        _owner_only(exc, target, "limiting", "queue_limits", "INSERT, UPDATE, DELETE")
        return
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    state = "limits replaced" if row["replaced"] else "limited"
    click.echo(
        f"queue {queue!r}: {state}: {_limits_text(row)}, across every worker "
        f"({plural(int(row['running']), 'running message')}, "
        f"{plural(int(row['pending']), 'pending message')}; `pgskip unlimit {queue}`)"
    )


def do_unlimit(target: Target, queues: Sequence[str], unlimit_all: bool) -> None:
    try:
        store = Store(target.url, schema=target.schema)
        try:
            names = [str(r["name"]) for r in store.limits()] if unlimit_all else list(queues)
            removed = store.unlimit(names) if names else []
        finally:
            store.close()
    except exceptions.PermissionDenied as exc:
        _owner_only(exc, target, "unlimiting", "queue_limits", "INSERT, UPDATE, DELETE")
        return
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if unlimit_all and not names:
        click.echo("no queue is limited")
    for queue in sorted(set(names)):
        click.echo(f"queue {queue!r}: {'unlimited' if queue in removed else 'was not limited'}")


def do_revoke(target: Target, task_ids: Sequence[str], app: Any = None) -> None:
    from .control import revoke_waiting

    try:
        store = Store(target.url, schema=target.schema)
        try:
            marked = set(
                revoke_waiting(store, task_ids, backend=app.backend if app is not None else None)
            )
        finally:
            store.close()
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if app is not None:  # the memory of the workers running now, as Celery's revoke
        app.control.revoke(list(task_ids))
    told = "the workers running now were told" if app is not None else "no worker was told"
    for task_id in dict.fromkeys(task_ids):
        if task_id in marked:
            click.echo(f"task {task_id}: revoked; its waiting message will never be delivered")
        else:
            click.echo(
                f"task {task_id}: no waiting message (running, held by a worker, finished or "
                f"unknown); {told}"
            )


def do_doctor(
    target: Target,
    as_json: bool = False,
    *,
    xmin_threshold: float | None = None,
    use_cron: bool = True,
    cron_database: str | None = None,
) -> None:
    from .doctor import DEFAULT_XMIN_THRESHOLD, FAIL, WARN, run_doctor

    try:
        checks = run_doctor(
            target.url,
            target.schema,
            xmin_threshold=DEFAULT_XMIN_THRESHOLD if xmin_threshold is None else xmin_threshold,
            cron=use_cron,
            cron_database=cron_database,
        )
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    failed = sum(1 for c in checks if c.status == FAIL)
    warned = sum(1 for c in checks if c.status == WARN)
    if as_json:
        _echo_json(
            {
                "schema": target.schema,
                "version": __version__,
                "failed": failed,
                "warnings": warned,
                "checks": [c.as_json() for c in checks],
            }
        )
    else:
        for check in checks:
            click.echo(check.text())
        if failed:
            more = f", {plural(warned, 'warning')}" if warned else ""
            click.echo(f"{failed} of {plural(len(checks), 'check')} failed{more}", err=True)
        elif warned:
            click.echo(f"{plural(len(checks), 'check')}: {plural(warned, 'warning')}", err=True)
    if failed:
        sys.exit(1)


def _fmt_time(value: Any, tz: Any = None) -> str:
    if value is None:
        return "-"
    if tz is not None:
        value = value.astimezone(tz)
    return str(value.isoformat(sep=" ", timespec="seconds"))


def _table(headers: tuple[str, ...], rows: Sequence[tuple[str, ...]], empty: str) -> None:
    """Columns as wide as their widest cell or header; ``empty`` below the headers when there
    are no rows."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        click.echo(empty)


def do_beat_list(target: Target, cron_database: str | None = None, as_json: bool = False) -> None:
    from .periodic import list_entries
    from .schedule_spec import zone

    try:
        entries = list_entries(target.url, target.schema)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if as_json:
        _beat_list_json(target, entries, cron_database)
        return
    rows = []
    for e in entries:
        tz = zone(e.timezone)
        rows.append(
            (
                e.name,
                e.task,
                e.schedule,
                _fmt_time(e.next_run, tz),
                _fmt_time(e.last_run, tz),
                e.last_task_id or "-",
                e.missed,
            )
        )
    _table(
        ("entry", "task", "schedule", "next run", "last run", "last message id", "missed"),
        rows,
        "(no periodic tasks stored: run `celery -A proj pgskip beat-sync`)",
    )
    try:
        server, jobs, runs = _cron_jobs(target, cron_database)
    except exceptions.PgSkipError as exc:
        click.echo(f"\npg_cron: {exc}")
        return
    click.echo("")
    _table(
        ("pg_cron job", "schedule", "database", "active", "last run", "status"),
        [
            (
                j.name,
                j.schedule,
                j.database,
                "yes" if j.active else "no",
                _fmt_time(runs[j.name][1]) if j.name in runs else "-",
                (
                    runs[j.name][0]
                    + (
                        f" ({runs[j.name][2]})"
                        if runs[j.name][0] != "succeeded" and runs[j.name][2]
                        else ""
                    )
                )
                if j.name in runs
                else "-",
            )
            for j in jobs
        ],
        f"(no pg_cron jobs for this schema; pg_cron {server.version} in database "
        f"{server.cron_database!r})",
    )
    if any(runs[j.name][0] == "failed" for j in jobs if j.name in runs):
        _cron_failure_advice(target, server)


def _cron_failure_advice(target: Target, server: Any) -> None:
    """Below ``beat-list``'s jobs: what a failed latest run means and what to change."""
    from . import cron

    prefix = cron.job_prefix(server.app_database, target.schema)
    try:
        advice = cron.failure_advice(target.url, server, prefix)
    except exceptions.PgSkipError:
        return
    if advice:
        click.echo(f"\n{advice}")


def _cron_jobs(target: Target, cron_database: str | None) -> tuple[Any, list[Any], dict[str, Any]]:
    """pg_cron's server, the schema's jobs and their latest runs (``beat-list``)."""
    from . import cron

    server = cron.locate(target.url, cron_database)
    prefix = cron.job_prefix(server.app_database, target.schema)
    with cron.cron_session(target.url, server) as conn:
        return server, cron.list_jobs(conn, prefix), cron.last_runs(conn, prefix)


def _beat_list_json(target: Target, entries: Sequence[Any], cron_database: str | None) -> None:
    result: dict[str, Any] = {
        "schema": target.schema,
        "entries": [
            {
                "name": e.name,
                "task": e.task,
                "schedule": e.schedule,
                "timezone": e.timezone,
                "missed": e.missed,
                "queues": list(e.queues),
                "next_run": _utc(e.next_run),
                "last_run": _utc(e.last_run),
                "last_task_id": e.last_task_id,
                "last_fired_at": _utc(e.last_fired_at),
            }
            for e in entries
        ],
    }
    try:
        server, jobs, runs = _cron_jobs(target, cron_database)
    except exceptions.PgSkipError as exc:
        result["pg_cron"] = {"available": False, "error": str(exc)}
    else:
        result["pg_cron"] = {
            "available": True,
            "version": server.version,
            "database": server.cron_database,
            "jobs": [
                {
                    "name": j.name,
                    "schedule": j.schedule,
                    "database": j.database,
                    "active": j.active,
                    "last_run": _utc(runs[j.name][1]) if j.name in runs else None,
                    "last_status": runs[j.name][0] if j.name in runs else None,
                    "last_message": (runs[j.name][2] or None) if j.name in runs else None,
                }
                for j in jobs
            ],
        }
    _echo_json(result)


def do_tick(target: Target, maintenance_config: Any) -> None:
    from .maintenance import run_once
    from .periodic import fire_due

    try:
        fired = fire_due(target.url, target.schema)
        done = run_once(target.url, target.schema, maintenance_config)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    click.echo(
        f"fired {plural(fired, 'periodic slot')}; " + ", ".join(f"{k} {v}" for k, v in done.items())
    )


def do_maintenance(
    target: Target, config: Any, remove: bool, cron_database: str | None = None
) -> None:
    from . import cron
    from .maintenance import install

    try:
        changes = install(
            target.url, target.schema, config, remove=remove, cron_database=cron_database
        )
    except cron.PgCronMissing as exc:
        if not remove:
            _fail(exc)
            return
        click.echo(f"nothing to remove: {exc.context.get('reason', exc)}")
        return
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    for line in changes:
        click.echo(line)
    if not changes:
        click.echo("maintenance jobs up to date")


def do_cron_remove(target: Target, cron_database: str | None = None) -> None:
    from . import cron
    from .maintenance import remove_all_jobs

    try:
        changes = remove_all_jobs(target.url, target.schema, cron_database)
    except cron.PgCronMissing as exc:
        click.echo(f"nothing to remove: {exc.context.get('reason', exc)}")
        return
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    for line in changes:
        click.echo(line)
    if not changes:
        click.echo("no pg_cron jobs for this schema")


def _failed_filter(
    queue: str | None, task: str | None, older_than: str | None, limit: int | None
) -> Any:
    from .maintenance import FailedFilter, parse_duration

    try:
        age = parse_duration(older_than, "--older-than") if older_than else None
    except exceptions.PgSkipError as exc:
        raise click.BadParameter(str(exc)) from None
    return FailedFilter(queue=queue, task=task, older_than=age, limit=limit)


def _failed_json(failed: Sequence[Any]) -> dict[str, Any]:
    return {
        "messages": [
            {
                "id": m.id,
                "queue": m.queue,
                "task": m.task_name,
                "task_id": m.task_id,
                "attempts": m.attempts,
                "failed_at": _utc(m.failed_at),
                "error": m.error,
            }
            for m in failed
        ]
    }


def do_failed(target: Target, filt: Any, full: bool, as_json: bool = False) -> None:
    from .maintenance import list_failed

    try:
        failed = list_failed(target.url, target.schema, filt)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if as_json:
        _echo_json(_failed_json(failed))
        return
    _failed_table(failed, full)


def _failed_table(failed: Sequence[Any], full: bool) -> None:
    rows = []
    for m in failed:
        error = (m.error or "").strip()
        if not full:
            error = error.splitlines()[-1] if error else ""
            error = error if len(error) <= 100 else error[:97] + "..."
        rows.append(
            (
                str(m.id),
                m.queue,
                m.task_name or "-",
                m.task_id or "-",
                str(m.attempts),
                _fmt_time(m.failed_at),
                error,
            )
        )
    _table(
        ("id", "queue", "task", "task id", "attempts", "failed at", "error"),
        rows,
        "(no failed messages)",
    )


def do_retry_failed(target: Target, filt: Any, dry_run: bool = False) -> None:
    from .maintenance import list_failed, retry_failed

    try:
        if dry_run:
            would = list_failed(target.url, target.schema, filt)
        else:
            count = retry_failed(target.url, target.schema, filt)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if dry_run:
        _failed_table(would, full=False)
        click.echo(
            f"dry run: {plural(len(would), 'failed message')} would return to pending; "
            "nothing was changed"
        )
        return
    click.echo(f"{plural(count, 'failed message')} returned to pending")


def do_purge_failed(target: Target, filt: Any) -> None:
    from .maintenance import purge_failed

    try:
        count = purge_failed(target.url, target.schema, filt)
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    click.echo(f"{plural(count, 'failed message')} deleted")


def do_metrics(
    target: Target, port: int, addr: str, timeout: float, cron_database: str | None = None
) -> None:
    try:
        from .metrics import serve
    except ImportError as exc:
        _fail(exc)
        return
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve(
            target.url,
            target.schema,
            port=port,
            addr=addr,
            timeout=timeout,
            cron_database=cron_database,
            announce=click.echo,
        )
    except OSError as exc:
        _fail(OSError(f"cannot serve the metrics on {addr}:{port}: {exc}"))


# -- the command line ----------------------------------------------------------------------------


class AppCommand(click.Command):
    """A command that reads the Celery app's configuration, not only its broker URL: it runs
    under ``celery -A proj pgskip`` only."""


class PgSkipGroup(click.Group):
    """The commands of both entry points. Without a Celery app (``python -m kombu_pgskip``) the
    :class:`AppCommand` commands are left out of ``--help``, and naming one is a usage error
    that says to run it as ``celery -A proj pgskip <command>``."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        if _app_or_none(ctx) is not None:
            return names
        return [n for n in names if not isinstance(self.commands.get(n), AppCommand)]

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if (
            isinstance(command, AppCommand)
            and _app_or_none(ctx) is None
            and not ctx.resilient_parsing
        ):
            raise click.UsageError(
                f"{name} needs the Celery app: run it as `celery -A proj pgskip {name}`", ctx
            )
        return name, command, rest


@click.group(name="pgskip", cls=PgSkipGroup)
@click.version_option(
    __version__,
    "--version",
    prog_name="kombu-pgskip",
    message="%(prog)s %(version)s",
    help="Print the version of kombu-pgskip and exit.",
)
def pgskip() -> None:
    """kombu-pgskip: the PostgreSQL broker's schema and operations.

    Under `celery -A proj pgskip` a command acts on the app's broker_url and
    broker_transport_options['schema']; --url and --schema override them. Without a Celery
    app (`python -m kombu_pgskip`, `kombu-pgskip`) pass --url or set $PGSKIP_URL.
    """


def _app_or_none(ctx: click.Context) -> Any:
    """The Celery app when ``celery -A proj`` runs the group, else None."""
    return getattr(ctx.find_root().obj, "app", None)


def _app(ctx: click.Context) -> Any:
    app = _app_or_none(ctx)
    if app is None:
        raise click.UsageError(
            f"no Celery app: run it as `celery -A proj pgskip {ctx.info_name}`", ctx
        )
    return app


def _target(ctx: click.Context, url: str | None, schema: str | None) -> Target:
    """Where a command acts: ``--url`` (or its environment variable), else the Celery app's
    broker; the schema is ``--schema``, else the app's ``broker_transport_options['schema']``,
    else ``pgskip``. Without either URL this is a usage error."""
    app = _app_or_none(ctx)
    if url:
        return Target(url, schema or (app_broker(app)[1] if app is not None else DEFAULT_SCHEMA))
    if app is None:
        raise click.UsageError(
            "no broker URL: pass --url (or set $PGSKIP_URL), "
            f"or run it as `celery -A proj pgskip {ctx.info_name}`",
            ctx,
        )
    return Target.from_app(app, schema)


_url_option = click.option(
    "--url",
    envvar="PGSKIP_URL",
    default=None,
    help="Connect here: pgskip://... or postgresql://... (env PGSKIP_URL; "
    "default under Celery: the app's broker_url).",
)

_owner_url_option = click.option(
    "--url",
    envvar=["PGSKIP_OWNER_URL", "PGSKIP_URL"],
    default=None,
    help="Connect as the schema's owner: pgskip://... or postgresql://... (env "
    "PGSKIP_OWNER_URL, then PGSKIP_URL; default under Celery: the app's broker_url).",
)

_json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object instead of the table (its shape: above, and docs/cli-json.md).",
)

_schema_option = click.option(
    "--schema",
    default=None,
    help="Schema name (default: broker_transport_options['schema'] under Celery, else "
    f"{DEFAULT_SCHEMA!r}).",
)


def _failed_filters(func: Any) -> Any:
    """The --queue/--task/--older-than/--limit options of the failed-message commands."""
    func = click.option(
        "--limit",
        type=click.IntRange(min=1),
        default=None,
        help="At most this many messages (oldest failures first).",
    )(func)
    func = click.option(
        "--older-than",
        default=None,
        help="Only messages that failed longer ago than this (30s, 15m, 2h, 7d).",
    )(func)
    func = click.option(
        "--task", default=None, help="Only this task name; * matches any characters."
    )(func)
    func = click.option("--queue", default=None, help="Only this queue.")(func)
    return func


_MAINTENANCE_OPTIONS = (
    ("--sweep-schedule", "pg_cron schedule of the sweeper (default every minute)."),
    ("--max-attempts", "Deliveries before a dead consumer's message goes to failed (20)."),
    ("--prune-schedule", "pg_cron schedule of the pruning job (default hourly)."),
    ("--completed-retention", "Keep completed messages this long (1d; 'never')."),
    ("--failed-retention", "Keep failed messages this long (14d; 'never' keeps them)."),
    ("--prune-batch", "Completed messages deleted per transaction by pruning (10000)."),
    ("--cron-history-schedule", "pg_cron schedule of the cron.job_run_details pruning."),
    ("--cron-history-retention", "Keep cron.job_run_details rows this long (7d)."),
)
#: What ``tick`` uses: it sweeps and prunes once, now; no schedule and no pg_cron history.
_TICK_OPTIONS = ("--max-attempts", "--completed-retention", "--failed-retention", "--prune-batch")


def _maintenance_options(func: Any, only: Sequence[str] | None = None) -> Any:
    """The maintenance settings (``only`` those named); under Celery they override
    ``app.conf.pgskip_maintenance``."""
    for name, help_text in reversed(_MAINTENANCE_OPTIONS):
        if only is None or name in only:
            func = click.option(name, default=None, help=help_text)(func)
    return func


def _tick_options(func: Any) -> Any:
    return _maintenance_options(func, _TICK_OPTIONS)


_cron_database_option = click.option(
    "--cron-database",
    envvar="PGSKIP_CRON_DATABASE",
    default=None,
    help="Database holding pg_cron (cron.database_name); found by itself for superusers, "
    "else 'postgres' and the app's database are tried.",
)


def _maintenance_config(app: Any, options: dict[str, Any]) -> Any:
    from .maintenance import MaintenanceConfig

    overrides = {k: v for k, v in options.items() if v is not None}
    try:
        if app is None:
            return MaintenanceConfig.build(overrides)
        return MaintenanceConfig.from_app(app, **overrides)
    except exceptions.PgSkipError as exc:
        raise click.UsageError(str(exc)) from None


@pgskip.command(name="migrate")
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@click.option(
    "--plan",
    "show_plan",
    is_flag=True,
    help="List each pending migration with the locks its statements take and whether running "
    "code stays compatible; change nothing.",
)
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0.001),
    default=DEFAULT_LOCK_TIMEOUT,
    show_default=True,
    help="Seconds a statement waits for a lock before its migration is rolled back and retried.",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=DEFAULT_RETRIES,
    show_default=True,
    help="Retries of a migration whose lock was not granted (with a growing pause between).",
)
@_url_option
@_schema_option
@click.pass_context
def migrate_cmd(
    ctx: click.Context,
    dry_run: bool,
    show_plan: bool,
    lock_timeout: float,
    retries: int,
    url: str | None,
    schema: str | None,
) -> None:
    """Install or upgrade the schema.

    Each migration in a transaction of its own, whose statements wait at most --lock-timeout for
    a lock; idempotent, and safe to run concurrently (an advisory lock). With a release whose
    migrations keep running code compatible (see --plan), migrate first, then roll the code out
    (docs/operations.md, "Migrations and rolling deploys")."""
    if dry_run and show_plan:
        raise click.UsageError("--dry-run and --plan: choose one", ctx)
    do_migrate(_target(ctx, url, schema), dry_run, show_plan, lock_timeout, retries)


@pgskip.command(name="status")
@_json_option
@_url_option
@_schema_option
@click.pass_context
def status_cmd(ctx: click.Context, as_json: bool, url: str | None, schema: str | None) -> None:
    """Per-queue counts, and the schema's version.

    A table per queue: pending, running, scheduled, failed, oldest pending, done per minute;
    the paused queues (`pgskip pause`), the limited ones (`pgskip limit`); then the schema's
    version and the code versions that run against it.

    \b
    --json prints:
    {"schema": "pgskip", "schema_version": 22, "oldest_compatible_version": 19,
     "package_schema_version": 22, "version": "0.1.0",
     "queues": [{"queue": "default", "pending": 3, "running": 1, "scheduled": 0,
                 "failed": 0, "oldest_pending_age": 2.5, "completed_last_minute": 40,
                 "paused": false, "limited": false}],
     "paused": [{"queue": "reports", "paused_at": "2026-01-31T12:00:00+00:00",
                 "paused_by": "app_owner", "reason": "deploy", "pending": 120}],
     "limits": [{"queue": "emails", "max_running": 5, "max_running_per_key": 1,
                 "rate": 10.0, "burst": 10, "set_at": "2026-01-31T12:00:00+00:00",
                 "set_by": "app_owner", "running": 5, "pending": 300}]}
    """
    do_status(_target(ctx, url, schema), as_json)


@pgskip.command(name="grant")
@click.option("--worker", "workers", multiple=True, help="Role that runs workers (repeatable).")
@click.option(
    "--publisher", "publishers", multiple=True, help="Role that only publishes (repeatable)."
)
@click.option("--dry-run", is_flag=True, help="Print the GRANTs; change nothing.")
@_owner_url_option
@_schema_option
@click.pass_context
def grant_cmd(
    ctx: click.Context,
    workers: tuple[str, ...],
    publishers: tuple[str, ...],
    dry_run: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """Grant a worker and a publisher role what they need.

    Only what they need (docs/security.md); run as the schema's owner."""
    do_grant(_target(ctx, url, schema), list(workers), list(publishers), dry_run)


@pgskip.command(name="doctor")
@click.option(
    "--xmin-threshold",
    type=click.FloatRange(min=0),
    default=None,
    help="Warn when a snapshot or transaction has held the xmin horizon back, or rotations "
    "of jobs' slots have been refused a slot's lock, this many seconds (default 300).",
)
@click.option(
    "--no-cron",
    is_flag=True,
    help="Leave the pg_cron check out (periodic tasks and maintenance run by `pgskip tick`).",
)
@_json_option
@_cron_database_option
@_owner_url_option
@_schema_option
@click.pass_context
def doctor_cmd(
    ctx: click.Context,
    xmin_threshold: float | None,
    no_cron: bool,
    as_json: bool,
    cron_database: str | None,
    url: str | None,
    schema: str | None,
) -> None:
    """Check upkeep and privileges; exits 1 on a failure.

    One line per check, ok, WARN or FAIL, with what to do: the schema's version, the
    autovacuum settings of jobs, invalid indexes, the xmin horizon, the runs of the schema's
    pg_cron jobs; then what would let a worker or publisher role destroy messages or run code
    as the schema's owner, which it runs as. Warnings leave the exit status 0.

    \b
    --json prints:
    {"schema": "pgskip", "version": "0.1.0", "failed": 0, "warnings": 1,
     "checks": [{"name": "xmin horizon", "status": "warn", "detail": "held back by ...",
                 "advice": null}]}
    """
    do_doctor(
        _target(ctx, url, schema),
        as_json,
        xmin_threshold=xmin_threshold,
        use_cron=not no_cron,
        cron_database=cron_database,
    )


@pgskip.command(name="queue-args")
@click.argument("queue")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set an argument, e.g. x-expires=60000 (milliseconds; repeatable).",
)
@click.option("--unset", multiple=True, metavar="KEY", help="Remove an argument (repeatable).")
@_owner_url_option
@_schema_option
@click.pass_context
def queue_args_cmd(
    ctx: click.Context,
    queue: str,
    assignments: tuple[str, ...],
    unset: tuple[str, ...],
    url: str | None,
    schema: str | None,
) -> None:
    """Show or change a declared queue's arguments.

    x-expires, x-message-ttl, x-max-priority, as the schema's owner: declarations cannot change
    them."""
    do_queue_args(_target(ctx, url, schema), queue, assignments, unset)


@pgskip.command(name="pause")
@click.argument("queues", nargs=-1, required=True)
@click.option("--reason", default=None, help="Why, shown by `pgskip status`.")
@_owner_url_option
@_schema_option
@click.pass_context
def pause_cmd(
    ctx: click.Context,
    queues: tuple[str, ...],
    reason: str | None,
    url: str | None,
    schema: str | None,
) -> None:
    """Pause queues for the whole fleet.

    As the schema's owner. No worker takes their messages until `pgskip resume`: they stay
    pending, publishes and countdowns go on, tasks already running finish. Kept in the
    database: workers started later honour it too."""
    do_pause(_target(ctx, url, schema), queues, reason)


@pgskip.command(name="resume")
@click.argument("queues", nargs=-1)
@click.option("--all", "resume_all", is_flag=True, help="Resume every paused queue.")
@_owner_url_option
@_schema_option
@click.pass_context
def resume_cmd(
    ctx: click.Context,
    queues: tuple[str, ...],
    resume_all: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """Resume paused queues.

    As the schema's owner; their workers fetch at once."""
    if bool(queues) == resume_all:
        raise click.UsageError("name the queues to resume, or pass --all", ctx)
    do_resume(_target(ctx, url, schema), queues, resume_all)


@pgskip.command(name="limit")
@click.argument("queue")
@click.option(
    "--max-running",
    type=click.IntRange(min=1, max=2**31 - 1),
    default=None,
    metavar="N",
    help="At most N of its messages running at once.",
)
@click.option(
    "--per-key",
    type=click.IntRange(min=1, max=2**31 - 1),
    default=None,
    metavar="N",
    help="At most N running per concurrency key.",
)
@click.option(
    "--rate",
    default=None,
    metavar="R",
    help="At most R started: 10/s, 100/m, 1000/h, 2.5.",
)
@click.option(
    "--burst",
    type=click.IntRange(min=1, max=2**31 - 1),
    default=None,
    metavar="N",
    help="Starts at once after idling (--rate).",
)
@_owner_url_option
@_schema_option
@click.pass_context
def limit_cmd(
    ctx: click.Context,
    queue: str,
    max_running: int | None,
    per_key: int | None,
    rate: str | None,
    burst: int | None,
    url: str | None,
    schema: str | None,
) -> None:
    """Limit a queue across every worker.

    As the schema's owner. From the commit on, every worker together runs at most
    --max-running of its messages at once, at most --per-key of one concurrency key
    (apply_async(..., pgskip_concurrency_key=...)), and starts at most --rate of them (a
    bucket of --burst tokens, by default the rate per second rounded up). A message runs from
    its fetch to its ack: give the queue's tasks acks_late=True. Replaces the queue's limits:
    a limit not given is not set. Kept in the database: workers started later honour it too
    (docs/limits.md)."""
    if max_running is None and per_key is None and rate is None:
        raise click.UsageError("give --max-running, --per-key or --rate (or see unlimit)", ctx)
    do_limit(_target(ctx, url, schema), queue, max_running, per_key, rate, burst)


@pgskip.command(name="unlimit")
@click.argument("queues", nargs=-1)
@click.option("--all", "unlimit_all", is_flag=True, help="Remove every queue's limits.")
@_owner_url_option
@_schema_option
@click.pass_context
def unlimit_cmd(
    ctx: click.Context,
    queues: tuple[str, ...],
    unlimit_all: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """Remove the limits of queues.

    As the schema's owner; their workers fetch at once."""
    if bool(queues) == unlimit_all:
        raise click.UsageError("name the queues to unlimit, or pass --all", ctx)
    do_unlimit(_target(ctx, url, schema), queues, unlimit_all)


@pgskip.command(name="beat-sync", cls=AppCommand)
@click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")
@click.option(
    "--no-cron",
    is_flag=True,
    help="Only store the schedule (fire it with `pgskip tick` from elsewhere).",
)
@click.option("--no-maintenance", is_flag=True, help="Do not install the maintenance jobs.")
@click.option(
    "--missed",
    type=click.Choice(["latest", "all", "skip"]),
    default=None,
    help="Policy for slots missed while the database was down (default: "
    "app.conf.pgskip_beat_missed or 'latest').",
)
@click.option(
    "--grace",
    type=float,
    default=None,
    help="Seconds a slot may be late and still run, once, at once (default 120).",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=90.0,
    show_default=True,
    help="Seconds to wait for pg_cron's first run of the jobs, to check that it can run them "
    "(0: judge by their past runs only).",
)
@_maintenance_options
@_cron_database_option
@_url_option
@_schema_option
@click.pass_context
def beat_sync_cmd(
    ctx: click.Context,
    /,
    dry_run: bool,
    no_cron: bool,
    no_maintenance: bool,
    missed: str | None,
    grace: float | None,
    wait: float,
    cron_database: str | None,
    url: str | None,
    schema: str | None,
    **maintenance: Any,
) -> None:
    """Store app.conf.beat_schedule and install its pg_cron jobs.

    Stores the schedule in the database, installs the pg_cron job that fires it and the
    maintenance jobs, and prints the diff. Then checks in cron.job_run_details that pg_cron
    can run them, waiting for their first run if need be (--wait); exits 1, saying what to
    change, when it cannot. Needs the Celery app."""
    from .periodic import beat_sync, default_policy

    app = _app(ctx)
    target = _target(ctx, url, schema)
    config = _maintenance_config(app, maintenance)
    try:
        result = beat_sync(
            app,
            target.url,
            target.schema,
            dry_run=dry_run,
            use_cron=not no_cron,
            policy=default_policy(app, missed=missed, grace=grace),
            cron_database=cron_database,
        )
        maintenance_changes: list[str] = []
        if not no_cron and not no_maintenance and not dry_run:
            from .maintenance import install

            maintenance_changes = install(
                target.url, target.schema, config, cron_database=cron_database
            )
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    for change in result.changes:
        click.echo(str(change))
    if not result.changes:
        click.echo("(beat_schedule is empty)")
    for line in [*result.cron_changes, *maintenance_changes]:
        click.echo(line)
    changed = result.changed or bool(maintenance_changes)
    if dry_run:
        if result.cron_problem:
            click.echo(
                "pg_cron cannot be used; without --dry-run, beat-sync would stop here: "
                + result.cron_problem
            )
        click.echo("dry run: nothing was changed")
    elif not changed:
        click.echo("no changes")
    if result.server is not None and result.run_mark is not None:
        _check_cron_runs(target, result.server, result.run_mark, wait)


def _check_cron_runs(target: Target, server: Any, mark: int, wait: float) -> None:
    """Whether pg_cron can run the schema's jobs (after ``beat-sync``); exits 1 if not."""
    from . import cron

    try:
        check = cron.check_runs(
            target.url,
            server,
            cron.job_prefix(server.app_database, target.schema),
            mark=mark,
            wait=wait,
            announce=lambda text: click.echo(text, err=True),
        )
    except exceptions.PgSkipError as exc:
        _fail(exc)
        return
    if check.ok is False:
        _fail(cron.PgCronError(check.message))
    elif check.message:
        click.echo(check.message)


@pgskip.command(name="beat-list")
@_json_option
@_cron_database_option
@_url_option
@_schema_option
@click.pass_context
def beat_list_cmd(
    ctx: click.Context,
    as_json: bool,
    cron_database: str | None,
    url: str | None,
    schema: str | None,
) -> None:
    """Stored periodic tasks and their pg_cron jobs.

    Per entry: schedule, next run, last run, last message id; then the schema's pg_cron jobs.

    \b
    --json prints:
    {"schema": "pgskip",
     "entries": [{"name": "report", "task": "proj.report", "schedule": "...",
                  "timezone": "UTC", "missed": "latest", "queues": ["default"],
                  "next_run": "2026-01-31T12:00:00+00:00", "last_run": null,
                  "last_task_id": null, "last_fired_at": null}],
     "pg_cron": {"available": true, "version": "1.6", "database": "postgres",
                 "jobs": [{"name": "...", "schedule": "* * * * *", "database": "app",
                           "active": true, "last_run": null, "last_status": null,
                           "last_message": null}]}}
    Without a usable pg_cron: "pg_cron": {"available": false, "error": "..."}.
    """
    do_beat_list(_target(ctx, url, schema), cron_database, as_json)


@pgskip.command(name="tick")
@_tick_options
@_url_option
@_schema_option
@click.pass_context
def tick_cmd(
    ctx: click.Context, /, url: str | None, schema: str | None, **maintenance: Any
) -> None:
    """Fire due periodic tasks and run maintenance once.

    The fallback without pg_cron: store the schedule with `celery -A proj pgskip beat-sync
    --no-cron`, then run this every minute. Sweeping and pruning settings: the options, over
    app.conf.pgskip_maintenance under Celery."""
    target = _target(ctx, url, schema)
    do_tick(target, _maintenance_config(_app_or_none(ctx), maintenance))


@pgskip.command(name="maintenance")
@click.option("--remove", is_flag=True, help="Unschedule the maintenance jobs.")
@_maintenance_options
@_cron_database_option
@_url_option
@_schema_option
@click.pass_context
def maintenance_cmd(
    ctx: click.Context,
    /,
    remove: bool,
    cron_database: str | None,
    url: str | None,
    schema: str | None,
    **maintenance: Any,
) -> None:
    """Install or update the pg_cron maintenance jobs.

    The sweeper and the pruning jobs. Their settings: the options, over
    app.conf.pgskip_maintenance under Celery."""
    target = _target(ctx, url, schema)
    config = _maintenance_config(_app_or_none(ctx), maintenance)
    do_maintenance(target, config, remove, cron_database)


@pgskip.command(name="cron-remove")
@_cron_database_option
@_url_option
@_schema_option
@click.pass_context
def cron_remove_cmd(
    ctx: click.Context, cron_database: str | None, url: str | None, schema: str | None
) -> None:
    """Unschedule every pg_cron job of this database and schema.

    Stored periodic entries stay."""
    do_cron_remove(_target(ctx, url, schema), cron_database)


@pgskip.command(name="failed")
@_failed_filters
@click.option("--full", is_flag=True, help="Print whole error texts.")
@_json_option
@_url_option
@_schema_option
@click.pass_context
def failed_cmd(
    ctx: click.Context,
    queue: str | None,
    task: str | None,
    older_than: str | None,
    limit: int | None,
    full: bool,
    as_json: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """List failed messages (dead letters) with their errors.

    At most --limit (default 100), oldest failure first.

    \b
    --json prints (whole error texts, as with --full):
    {"messages": [{"id": 42, "queue": "default", "task": "proj.charge",
                   "task_id": "...", "attempts": 20,
                   "failed_at": "2026-01-31T12:00:00+00:00", "error": "Traceback ..."}]}
    """
    target = _target(ctx, url, schema)
    do_failed(target, _failed_filter(queue, task, older_than, limit or 100), full, as_json)


@pgskip.command(name="unique-keys")
@click.option("--queue", default=None, help="Only this queue's keys.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@_json_option
@_url_option
@_schema_option
@click.pass_context
def unique_keys_cmd(
    ctx: click.Context,
    queue: str | None,
    limit: int,
    as_json: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """List the unique keys held, by queue.

    A key is held by a message published with `pgskip_unique` while it is pending, scheduled
    or running; a publish with a held key writes nothing (docs/unique.md).

    \b
    --json prints:
    {"keys": [{"queue": "default", "key": "sync:7", "status": "running",
               "task": "proj.sync_account", "task_id": "...",
               "created_at": "2026-01-31T12:00:00+00:00"}]}
    """
    do_unique_keys(_target(ctx, url, schema), queue, limit, as_json)


@pgskip.command(name="revoke")
@click.argument("task_ids", nargs=-1, required=True)
@_url_option
@_schema_option
@click.pass_context
def revoke_cmd(
    ctx: click.Context, task_ids: tuple[str, ...], url: str | None, schema: str | None
) -> None:
    """Revoke tasks for good, in the database.

    Whatever workers run or start later: their messages still waiting in the database
    (pending, or scheduled for a later ETA) are marked failed and never delivered (`pgskip
    failed` lists them, `retry-failed` brings them back). Under `celery -A proj` the result
    backend stores REVOKED for them and the workers running now are told, as by `celery
    control revoke`, which also lasts on this broker while a worker runs."""
    do_revoke(_target(ctx, url, schema), task_ids, _app_or_none(ctx))


@pgskip.command(name="retry-failed")
@_failed_filters
@click.option(
    "--dry-run", is_flag=True, help="List the messages that would be retried; change nothing."
)
@_url_option
@_schema_option
@click.pass_context
def retry_failed_cmd(
    ctx: click.Context,
    queue: str | None,
    task: str | None,
    older_than: str | None,
    limit: int | None,
    dry_run: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """Return failed messages to their queues.

    With a fresh attempt count; workers are woken."""
    do_retry_failed(
        _target(ctx, url, schema), _failed_filter(queue, task, older_than, limit), dry_run
    )


@pgskip.command(name="purge-failed")
@_failed_filters
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@_url_option
@_schema_option
@click.pass_context
def purge_failed_cmd(
    ctx: click.Context,
    queue: str | None,
    task: str | None,
    older_than: str | None,
    limit: int | None,
    yes: bool,
    url: str | None,
    schema: str | None,
) -> None:
    """Delete failed messages."""
    target = _target(ctx, url, schema)
    if not yes:
        click.confirm("Delete the matching failed messages?", abort=True)
    do_purge_failed(target, _failed_filter(queue, task, older_than, limit))


@pgskip.command(name="metrics")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve /metrics on this port (required; 0: a free one, printed).",
)
@click.option(
    "--addr",
    default="0.0.0.0",
    show_default=True,
    help="Address to listen on (127.0.0.1: this host only).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds each statement of a scrape may run (statement_timeout); past it the scrape "
    "reports pgskip_up 0.",
)
@_cron_database_option
@_url_option
@_schema_option
@click.pass_context
def metrics_cmd(
    ctx: click.Context,
    port: int | None,
    addr: str,
    timeout: float,
    cron_database: str | None,
    url: str | None,
    schema: str | None,
) -> None:
    """Serve Prometheus metrics on http://ADDR:PORT/metrics.

    Per queue: pending, scheduled, running, failed and redelivered messages, the oldest pending
    message's age, live consumers; consumers alive and with an expired lease, the xmin
    horizon's age, the jobs table's size and dead tuples, the last run of each pg_cron job
    (docs/metrics.md). Runs until interrupted. Needs pip install "kombu-pgskip[metrics]"."""
    target = _target(ctx, url, schema)
    if port is None:
        raise click.UsageError("Missing option '--port': the port to serve /metrics on", ctx)
    do_metrics(target, port, addr, timeout, cron_database)
