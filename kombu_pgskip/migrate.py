"""Applies the numbered SQL files of ``migrations/`` under an advisory lock and records versions.

Guarantees:

* Forward only. Files are named ``NNNN_description.sql`` and applied in number order.
* All pending files are applied in one transaction: either the schema reaches the newest version
  or nothing changes (PostgreSQL DDL is transactional).
* Concurrent runners (several deploy jobs at once) serialise on an advisory lock; the second one
  finds nothing left to do.
* A dry run prints the SQL that would run and changes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from . import exceptions
from .urls import connect, mask_url

logger = logging.getLogger(__name__)

DEFAULT_SCHEMA = "pgskip"
_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


def _migration_files() -> Iterator[tuple[str, str]]:
    try:
        root = resources.files("kombu_pgskip.migrations")
        entries = [(e.name, e.read_text(encoding="utf-8")) for e in root.iterdir()]
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        entries = []
    if not any(name.endswith(".sql") for name, _ in entries):
        # A source checkout without an install: migrations/ beside the package.
        repo_dir = Path(__file__).resolve().parent.parent / "migrations"
        entries = [(p.name, p.read_text(encoding="utf-8")) for p in repo_dir.glob("*.sql")]
    yield from entries


def load_migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    found: list[Migration] = []
    for name, text in _migration_files():
        match = _FILE_RE.match(name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), text))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise exceptions.MigrationError(f"duplicate migration numbers: {versions}")
    return found


def latest_version() -> int:
    """The schema version this package needs."""
    migrations = load_migrations()
    return migrations[-1].version if migrations else 0


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(f"kombu-pgskip migrate {schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> dict[int, str]:
    """Versions recorded in ``<schema>.migrations`` (empty when the schema is not installed)."""
    qualified = sql.Identifier(schema, "migrations").as_string(conn)
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (qualified,)).fetchone()
    if not exists or not exists[0]:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT version, checksum FROM {}.migrations ORDER BY version").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    return {int(r[0]): str(r[1]) for r in rows}


def check_schema(conn: psycopg.Connection[Any], schema: str) -> int:
    """Raise the error that says what to do unless the schema is exactly at the needed version.

    Returns the installed version.
    """
    installed = applied_versions(conn, schema)
    return require_version(schema, max(installed) if installed else 0)


def require_version(schema: str, current: int, *, where: str = "") -> int:
    """``current`` (the schema's installed version, 0 for none) if it is the one this package
    needs, else the :class:`~kombu_pgskip.exceptions.SchemaError` that says what to do;
    ``where`` says whose database it is (" in the database of ...")."""
    needed = latest_version()
    how = "run `celery -A proj pgskip migrate` (or `python -m kombu_pgskip migrate --url ...`)"
    if current == 0:
        raise exceptions.SchemaNotInstalled(f"schema {schema!r} not installed{where}: {how}")
    if current < needed:
        raise exceptions.SchemaOutdated(
            f"schema {schema!r} is at version {current}, this kombu-pgskip needs {needed}: {how}"
        )
    if current > needed:
        raise exceptions.SchemaTooNew(
            f"schema {schema!r} is at version {current}, newer than this kombu-pgskip knows "
            f"({needed}): upgrade the kombu-pgskip package"
        )
    return current


def pending_migrations(conn: psycopg.Connection[Any], schema: str) -> list[Migration]:
    done = applied_versions(conn, schema)
    pending = []
    for m in load_migrations():
        if m.version in done:
            if done[m.version] != m.checksum:
                logger.warning(
                    "migration %s changed since it was applied; migrations are forward-only, "
                    "add a new file instead",
                    m.label,
                    extra={"action": "migrate_checksum_mismatch"},
                )
            continue
        pending.append(m)
    return pending


def migrate(url: str, *, schema: str = DEFAULT_SCHEMA, dry_run: bool = False) -> list[str]:
    """Bring ``schema`` to the newest version; return the labels of the migrations applied.

    With ``dry_run`` nothing is changed and the SQL that would run is logged and returned in
    the labels' place as ``label + "\\n" + sql``.
    """
    from .store import validate_schema_name

    validate_schema_name(schema)
    with connect(url, autocommit=False) as conn:
        try:
            return _migrate(conn, schema, dry_run=dry_run)
        except psycopg.Error as exc:
            conn.rollback()
            translated = exceptions.translate(exc, url_for_messages=mask_url(url))
            if translated is not exc:
                raise translated from exc
            raise exceptions.MigrationError(
                f"migration failed, nothing was applied: {exc}"
            ) from exc


def _migrate(conn: psycopg.Connection[Any], schema: str, *, dry_run: bool) -> list[str]:
    ident = sql.Identifier(schema)
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(schema),))
    pending = pending_migrations(conn, schema)
    if dry_run:
        conn.rollback()
        return [f"-- {m.label}\n{m.sql}" for m in pending]
    if not pending:
        conn.rollback()
        return []
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(ident)
    )
    # The schema first, then PostgreSQL's own objects; no schema that another role can create
    # objects in (public), so nothing a migration creates or calls resolves to one of theirs.
    # Functions created with SET search_path FROM CURRENT keep exactly this path.
    conn.execute(sql.SQL("SET LOCAL search_path TO {}, pg_catalog, pg_temp").format(ident))
    applied = []
    for m in pending:
        logger.info("applying migration %s", m.label, extra={"action": "migrate_apply"})
        conn.execute(m.sql.encode())
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.migrations (version, name, checksum) VALUES (%s, %s, %s)"
            ).format(ident),
            (m.version, m.name, m.checksum),
        )
        applied.append(m.label)
    conn.commit()
    return applied
