"""Applies the numbered SQL files of ``migrations/`` and records versions; says which code runs
against which schema.

Files are named ``NNNN_description.sql`` and applied in number order, forward only. A file
carries directives, comment lines that start with ``-- pgskip:``:

``-- pgskip: compatible-with NNNN``
    Once, in the header of every file: what the file changes keeps code built for schema NNNN
    (the newest migration that code ships is NNNN) or later working. It adds what that code
    does not use (a nullable column, a function, an index, a grant) and removes or changes
    nothing it uses. A file that breaks every older release says its own version; so does a
    file without the line.

``-- pgskip: concurrently``
    Directly before a ``CREATE [UNIQUE] INDEX name ON table ...`` statement: the runner builds
    it with ``CREATE INDEX CONCURRENTLY`` outside a transaction, so that reads and writes of the
    table go on while it builds (an index of that name that is valid already is kept). A file
    with such statements holds nothing else, and its version is recorded once every index is
    built.

Directive lines are not part of a file's checksum: adding or correcting one does not make an
applied migration look changed.

The window: code built for schema N runs against a database at version V >= N when every
migration in (N, V] is compatible with N (its ``compatible-with`` is N or older). The runner
records each file's ``compatible-with`` in ``<schema>.migrations``, where code finds it for the
migrations newer than itself; the package knows its own files' from the files it ships.
Code refuses an older schema (``SchemaOutdated``) and one outside its window
(``SchemaTooNew``, naming the migration that broke compatibility).

The runner:

* applies each file in a transaction of its own with ``lock_timeout`` set, so that no file holds
  its locks while later files run and no lock request waits long in the queue behind a long
  transaction (every other session's request on that table would wait behind it); a file whose
  lock is not granted is rolled back and tried again after a growing pause, a bounded number of
  times; the files before it stay applied;
* builds an index marked ``concurrently`` without ``lock_timeout``: neither its lock nor its
  waits for the transactions open on the table hold up reads or writes, and a timeout would
  throw the build away;
* drops an INVALID index left by an interrupted ``CREATE INDEX CONCURRENTLY`` before building an
  index of that name (``IF NOT EXISTS`` would keep it);
* serialises concurrent runners (several deploy jobs at once) on an advisory lock; the second
  one finds nothing left to do;
* changes nothing in a dry run (the SQL that would run) or a plan (the locks each statement
  takes, and whether running code stays compatible).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import random
import re
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.rows import tuple_row

from . import exceptions
from .sql import quote_ident
from .urls import SAFE_SEARCH_PATH, connect, mask_url

logger = logging.getLogger(__name__)

DEFAULT_SCHEMA = "pgskip"
#: Seconds a migration's statement waits for a lock before the file is rolled back and retried.
DEFAULT_LOCK_TIMEOUT = 3.0
#: Retries of a file whose lock was not granted, after the first attempt.
DEFAULT_RETRIES = 5
#: The first pause before a retry, in seconds; it doubles with each retry, up to MAX_BACKOFF.
DEFAULT_BACKOFF = 1.0
MAX_BACKOFF = 30.0

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_DIRECTIVE_RE = re.compile(r"^-- pgskip:(.*)$", re.MULTILINE)
_DIRECTIVE_LINE_RE = re.compile(r"^-- pgskip:.*(?:\n|\Z)", re.MULTILINE)
_HOW_TO_MIGRATE = (
    "run `celery -A proj pgskip migrate` (or `python -m kombu_pgskip migrate --url ...`)"
)

PathLike = str | os.PathLike[str]


class MigrationLockTimeout(exceptions.MigrationError):
    """A migration's locks were not granted within lock_timeout, however often it was tried:
    it was not applied; the migrations before it were."""


# -- files and directives -------------------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    """One statement of a migration file."""

    text: str  # as written, from its first word to its semicolon (excluded)
    code: str  # the same with comments blanked and whitespace collapsed
    marked: bool  # preceded by ``-- pgskip: concurrently``
    line: int  # where it starts in the file, from 1

    @property
    def index(self) -> tuple[str, str] | None:
        """(index name, table) of a ``CREATE [UNIQUE] INDEX name ON table``; else None."""
        match = _CREATE_INDEX_RE.match(self.code)
        if not match or not match.group("name"):
            return None
        return _unquote(match.group("name")), _short_name(match.group("table"))

    @property
    def concurrent_sql(self) -> str:
        """The marked ``CREATE INDEX`` as ``CREATE INDEX CONCURRENTLY``."""
        match = re.match(r"\s*CREATE\s+(?:UNIQUE\s+)?INDEX\b", self.text, re.IGNORECASE)
        assert match is not None
        rest = self.text[match.end() :]
        if re.match(r"\s+CONCURRENTLY\b", rest, re.IGNORECASE):
            return self.text
        return f"{self.text[: match.end()]} CONCURRENTLY{rest}"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """Of the SQL without its directive lines."""
        return hashlib.sha256(_DIRECTIVE_LINE_RE.sub("", self.sql).encode()).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @functools.cached_property
    def _directives(self) -> tuple[int | None, bool]:
        compatible: int | None = None
        concurrently = False
        for match in _DIRECTIVE_RE.finditer(self.sql):
            words = match.group(1).split()
            if len(words) == 2 and words[0] == "compatible-with" and words[1].isdigit():
                if compatible is not None:
                    raise exceptions.MigrationError(
                        f"migration {self.label}: more than one `-- pgskip: compatible-with`"
                    )
                compatible = int(words[1])
                if not 1 <= compatible <= self.version:
                    raise exceptions.MigrationError(
                        f"migration {self.label}: compatible-with {words[1]} must name a "
                        f"version from 0001 to its own ({self.version:04d})"
                    )
            elif words == ["concurrently"]:
                concurrently = True
            else:
                raise exceptions.MigrationError(
                    f"migration {self.label}: unknown directive {match.group(0)!r} (known: "
                    "`-- pgskip: compatible-with NNNN`, `-- pgskip: concurrently`)"
                )
        return compatible, concurrently

    @property
    def declared(self) -> bool:
        """Whether the file says which code it is compatible with."""
        return self._directives[0] is not None

    @property
    def compatible_with(self) -> int:
        """The oldest schema version whose code keeps working against this migration's."""
        declared = self._directives[0]
        return self.version if declared is None else declared

    @property
    def concurrent(self) -> bool:
        """Whether the file's statements are index builds run outside a transaction."""
        return self._directives[1]

    @functools.cached_property
    def statements(self) -> tuple[Statement, ...]:
        return tuple(split_statements(self.sql))

    def validate(self) -> None:
        """Raise MigrationError unless the directives are well formed and a file with
        ``concurrently`` statements holds only marked, named ``CREATE INDEX`` statements."""
        _ = self._directives
        if not self.concurrent:
            return
        for stmt in self.statements:
            if not stmt.marked or stmt.index is None:
                raise exceptions.MigrationError(
                    f"migration {self.label}, line {stmt.line}: a file with "
                    "`-- pgskip: concurrently` statements holds only `CREATE [UNIQUE] INDEX "
                    "name ON table ...` statements, each marked: put the others in a file of "
                    "their own"
                )


def _migration_files(directory: PathLike | None) -> Iterator[tuple[str, str]]:
    if directory is not None:
        yield from ((p.name, p.read_text(encoding="utf-8")) for p in Path(directory).glob("*.sql"))
        return
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


def load_migrations(directory: PathLike | None = None) -> list[Migration]:
    """Every migration shipped with this package (or in ``directory``), in version order."""
    if directory is None:
        return list(_package_migrations())
    return _load(_migration_files(directory))


@functools.cache
def _package_migrations() -> tuple[Migration, ...]:
    return tuple(_load(_migration_files(None)))


def _load(files: Iterable[tuple[str, str]]) -> list[Migration]:
    found: list[Migration] = []
    for name, text in files:
        match = _FILE_RE.match(name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), text))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise exceptions.MigrationError(f"duplicate migration numbers: {versions}")
    for m in found:
        m.validate()
    return found


def latest_version(directory: PathLike | None = None) -> int:
    """The schema version this package (or ``directory``) is built for."""
    migrations = load_migrations(directory)
    return migrations[-1].version if migrations else 0


# -- the window -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """A row of ``<schema>.migrations``."""

    version: int
    name: str
    checksum: str
    compatible_with: int | None  # None: recorded by a runner older than the window

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


def window_floor(version: int, claims: Mapping[int, int | None]) -> int:
    """The oldest schema version whose code runs against a database at ``version``, given each
    migration's ``compatible-with`` (None: compatible with nothing older)."""
    if not version:
        return 0
    versions = sorted((v for v in claims if v <= version), reverse=True)
    floor, newest_claim = version, 0
    for i, v in enumerate(versions):
        claim = claims[v]
        newest_claim = max(newest_claim, v if claim is None else claim)
        # Code built for N in [lower, v - 1] faces the migrations from v up: it runs when N is
        # at least the newest of their claims.
        lower = versions[i + 1] if i + 1 < len(versions) else 0
        if newest_claim > v - 1:
            break
        floor = max(newest_claim, lower)
        if floor > lower:
            break
    return max(floor, 1)


def compatible_range(
    version: int | None = None, directory: PathLike | None = None
) -> tuple[int, int]:
    """(oldest, newest) schema version whose code runs against this package's schema at
    ``version`` (default: the newest), from the files' headers alone."""
    migrations = load_migrations(directory)
    top = version if version is not None else (migrations[-1].version if migrations else 0)
    return window_floor(top, {m.version: m.compatible_with for m in migrations}), top


def _breaking(code: int, applied: Iterable[Applied]) -> Applied | None:
    """The first applied migration newer than ``code`` that does not keep it working."""
    for row in sorted(applied, key=lambda a: a.version):
        if row.version > code and (row.compatible_with is None or row.compatible_with > code):
            return row
    return None


def require_version(
    schema: str,
    current: int,
    *,
    where: str = "",
    applied: Iterable[Applied] | None = None,
    directory: PathLike | None = None,
) -> int:
    """``current`` (the schema's installed version, 0 for none) if this package's code runs
    against it, else the :class:`~kombu_pgskip.exceptions.SchemaError` that says what to do.

    The code runs against its own version, and against a newer one when every migration in
    between, as ``applied`` (the rows of ``<schema>.migrations``) records, is compatible with
    it; without ``applied`` a newer schema is refused. ``where`` says whose database it is
    (" in the database of ...")."""
    migrations = load_migrations(directory)
    needed = migrations[-1].version if migrations else 0
    if current == 0:
        raise exceptions.SchemaNotInstalled(
            f"schema {schema!r} not installed{where}: {_HOW_TO_MIGRATE}"
        )
    if current < needed:
        raise exceptions.SchemaOutdated(
            f"schema {schema!r} is at version {current}{where}, this kombu-pgskip needs "
            f"{needed}: {_HOW_TO_MIGRATE}{_rollout_advice(migrations, current)}"
        )
    if current == needed:
        return current
    if applied is None:
        raise exceptions.SchemaTooNew(
            f"schema {schema!r} is at version {current}{where}, newer than this kombu-pgskip "
            f"knows ({needed}): upgrade the kombu-pgskip package"
        )
    rows = [a for a in applied if a.version <= current]
    breaking = _breaking(needed, rows)
    if breaking is None:
        return current
    floor = window_floor(current, {a.version: a.compatible_with for a in rows})
    why = (
        f"migration {breaking.label} was recorded without its compatibility (by an older "
        "runner), so it is taken to need code built for it"
        if breaking.compatible_with is None
        else f"migration {breaking.label} needs code built for schema "
        f"{breaking.compatible_with:04d} or later"
    )
    raise exceptions.SchemaTooNew(
        f"schema {schema!r} is at version {current}{where}, newer than this kombu-pgskip knows "
        f"({needed}), and {why}: upgrade the kombu-pgskip package to a release built for "
        f"schema {floor:04d} or later",
        migration=breaking.label,
        needs=floor,
    )


def _rollout_advice(migrations: Sequence[Migration], current: int) -> str:
    """Whether code built for ``current`` keeps working once this package's migrations ran."""
    newer = [m for m in migrations if m.version > current]
    breaking = next((m for m in newer if m.compatible_with > current), None)
    if breaking is None:
        return (
            f"; code built for schema {current:04d} keeps working against the migrated "
            "schema, so migrate first, then roll the new code out"
        )
    return (
        f"; migration {breaking.label} stops code built for schema {current:04d}: stop those "
        "processes, migrate, then start the new code"
    )


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(f"kombu-pgskip migrate {schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# -- the connection a run works on ----------------------------------------------------------------

Rows = list[tuple[Any, ...]]
#: a statement of the runner: text with ``%s`` placeholders, or a migration file's bytes
_Text = str | bytes

_IDLE = int(pq.TransactionStatus.IDLE)


class _Session(ABC):
    """The server session a run works on, whichever driver holds it: psycopg 3 or psycopg2
    (Django's connection is one of the two). Every statement of the runner is text with ``%s``
    placeholders, which both drivers take, and its identifiers are quoted in by
    :func:`~kombu_pgskip.sql.quote_ident`; a driver's errors reach the runner as psycopg 3's,
    so that one runner serves both.

    The runner keeps the session in autocommit mode and opens its own transactions
    (:meth:`transaction`): one per migration file, none around an index built concurrently."""

    driver: str

    @abstractmethod
    def rows(self, query: _Text, params: Sequence[Any] | None = None) -> Rows:
        """Run a statement (a file's several statements when it has no ``params``); the
        first result's rows."""

    @abstractmethod
    def usable(self) -> bool:
        """Whether the connection is open and not broken."""

    @abstractmethod
    def status(self) -> int:
        """libpq's transaction status (psycopg2's constants have the same values)."""

    @abstractmethod
    def get_autocommit(self) -> bool: ...

    @abstractmethod
    def set_autocommit(self, value: bool) -> None: ...

    def one(self, query: _Text, params: Sequence[Any] | None = None) -> tuple[Any, ...]:
        found = self.rows(query, params)
        assert found, "the statement returns one row"
        return found[0]

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT; ROLLBACK when the block raises."""
        self.rows("BEGIN")
        try:
            yield
        except BaseException:
            if self.usable():
                with contextlib.suppress(psycopg.Error):  # the error on its way out matters
                    self.rows("ROLLBACK")
            raise
        self.rows("COMMIT")


class _PsycopgSession(_Session):
    driver = "psycopg"

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def rows(self, query: _Text, params: Sequence[Any] | None = None) -> Rows:
        # Without parameters psycopg sends the text as it is (a file's several statements in
        # one round trip); a cursor of the connection's own class (Django's is client-side
        # binding), with tuples for rows whatever the connection's row factory.
        with self.conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description is not None else []

    def usable(self) -> bool:
        return not self.conn.closed and not self.conn.broken

    def status(self) -> int:
        return int(self.conn.info.transaction_status)

    def get_autocommit(self) -> bool:
        return self.conn.autocommit

    def set_autocommit(self, value: bool) -> None:
        self.conn.autocommit = value


class _Psycopg2Session(_Session):
    """A psycopg2 connection; its errors are raised as psycopg 3's class for their SQLSTATE
    (:func:`~kombu_pgskip.exceptions.psycopg_class`), the original as their cause."""

    driver = "psycopg2"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def rows(self, query: _Text, params: Sequence[Any] | None = None) -> Rows:
        psycopg2 = sys.modules["psycopg2"]
        try:
            # psycopg2's own cursor class: a connection may default to DictCursor and the like.
            with self.conn.cursor(cursor_factory=psycopg2.extensions.cursor) as cur:
                cur.execute(query, params)
                return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []
        except psycopg2.Error as exc:
            raise _psycopg_error(exc, psycopg2) from exc

    def usable(self) -> bool:
        return not self.conn.closed

    def status(self) -> int:
        return int(self.conn.get_transaction_status())

    def get_autocommit(self) -> bool:
        return bool(self.conn.autocommit)

    def set_autocommit(self, value: bool) -> None:
        self.conn.autocommit = value


def _psycopg_error(exc: Any, psycopg2: Any) -> psycopg.Error:
    """psycopg 3's error for a psycopg2 error: by SQLSTATE, else by class (libpq's own
    failures, a closed connection, carry none)."""
    code = getattr(exc, "pgcode", None)
    if isinstance(code, str) and code:
        cls = exceptions.psycopg_class(code)
    elif isinstance(exc, psycopg2.OperationalError):
        cls = psycopg.OperationalError
    elif isinstance(exc, psycopg2.InterfaceError):
        cls = psycopg.InterfaceError
    else:
        cls = psycopg.DatabaseError
    return cls(str(exc).strip())


def _as_session(conn: psycopg.Connection[Any] | _Session) -> _Session:
    return conn if isinstance(conn, _Session) else _PsycopgSession(conn)


_TARGETS = (
    "a URL, a psycopg 3 connection, a psycopg2 connection or Django's connection "
    "(django.db.connection, connections[alias])"
)


def _is_django_connection(obj: object) -> bool:
    # Duck-typed as apply_async_in does it (adapters.py): django.db.connection is a proxy that
    # forwards attribute access to the default alias's connection.
    return (
        callable(getattr(obj, "ensure_connection", None))
        and hasattr(obj, "in_atomic_block")
        and hasattr(obj, "vendor")
        and hasattr(obj, "alias")
    )


def _driver_session(target: object) -> _Session:
    """The session of a caller's connection object, or the error that says what is wrong."""
    if isinstance(target, psycopg.Connection):
        return _PsycopgSession(target)
    ext = sys.modules.get("psycopg2.extensions")
    if ext is not None and isinstance(target, ext.connection):
        return _Psycopg2Session(target)
    if _is_django_connection(target):
        django: Any = target
        if django.vendor != "postgresql":
            raise exceptions.ConfigurationError(
                f"Django database {django.alias!r} uses the {django.vendor} backend: the pgskip "
                "schema lives in PostgreSQL"
            )
        if django.in_atomic_block:
            raise exceptions.MigrationError(
                f"migrate() cannot run inside transaction.atomic() (Django database "
                f"{django.alias!r}): it commits each migration on its own and builds indexes "
                "concurrently, outside any transaction. Call it outside atomic(); in a Django "
                "migration, set `atomic = False` on the Migration class"
            )
        django.ensure_connection()
        raw = django.connection
        if isinstance(raw, psycopg.Connection) or (
            ext is not None and isinstance(raw, ext.connection)
        ):
            return _driver_session(raw)
        raise exceptions.ConfigurationError(
            f"Django database {django.alias!r} runs on {type(raw).__module__}, not psycopg or "
            "psycopg2"
        )
    if isinstance(target, psycopg.AsyncConnection):
        raise TypeError("migrate() takes a sync psycopg connection, not an AsyncConnection")
    kind = type(target)
    raise TypeError(f"migrate() takes {_TARGETS}; got {kind.__module__}.{kind.__qualname__}")


@contextlib.contextmanager
def _session_for(target: object) -> Iterator[tuple[_Session, str | None]]:
    """(the session to run on, the masked URL for messages or None): a connection of our own
    for a URL, closed afterwards; else the caller's connection, for the run in autocommit mode
    with ``search_path`` set as :func:`~kombu_pgskip.urls.connect` sets it for ours (nothing
    resolves through a schema that other roles can create objects in), and then as it was."""
    if isinstance(target, str):
        with connect(target, autocommit=True) as conn:
            yield _PsycopgSession(conn), mask_url(target)
        return
    session = _driver_session(target)
    if not session.usable():
        raise exceptions.MigrationError(
            f"the {session.driver} connection given to migrate() is closed: pass an open one"
        )
    if session.status() != _IDLE:
        raise exceptions.MigrationError(
            f"the {session.driver} connection given to migrate() is inside a transaction: "
            "commit or roll it back first (migrate() commits each migration on its own and "
            "builds indexes concurrently, outside any transaction)"
        )
    autocommit = session.get_autocommit()
    if not autocommit:
        session.set_autocommit(True)
    try:
        (path,) = session.one("SELECT pg_catalog.current_setting('search_path')")
        session.rows("SELECT pg_catalog.set_config('search_path', %s, false)", (SAFE_SEARCH_PATH,))
        try:
            yield session, None
        finally:
            if session.usable() and session.status() == _IDLE:
                with contextlib.suppress(psycopg.Error):  # only a broken connection fails here
                    session.rows("SELECT pg_catalog.set_config('search_path', %s, false)", (path,))
    finally:
        if not autocommit and session.usable() and session.status() == _IDLE:
            session.set_autocommit(False)


def _translated(exc: psycopg.Error, where: str | None) -> exceptions.PgSkipError:
    """The kombu-pgskip error for a database error of a run."""
    translated = exceptions.translate(exc, url_for_messages=where)
    if isinstance(translated, exceptions.PgSkipError):
        return translated
    return exceptions.MigrationError(f"migration failed: {exc}")


# -- reading the schema's state -------------------------------------------------------------------


def _migrations_table(conn: psycopg.Connection[Any] | _Session, schema: str) -> bool:
    qualified = f"{quote_ident(schema)}.{quote_ident('migrations')}"
    row = _as_session(conn).one("SELECT to_regclass(%s) IS NOT NULL", (qualified,))
    return bool(row[0])


def applied_migrations(conn: psycopg.Connection[Any] | _Session, schema: str) -> list[Applied]:
    """The rows of ``<schema>.migrations`` in version order (empty when not installed)."""
    session = _as_session(conn)
    if not _migrations_table(session, schema):
        return []
    # to_jsonb: a table made by a runner that predates compatible_with has no such column.
    rows = session.rows(
        "SELECT version, name, checksum, (to_jsonb(m) ->> 'compatible_with')::integer"
        f" FROM {quote_ident(schema)}.migrations AS m ORDER BY version"
    )
    return [Applied(int(r[0]), str(r[1]), str(r[2]), r[3]) for r in rows]


def applied_versions(conn: psycopg.Connection[Any] | _Session, schema: str) -> dict[int, str]:
    """Versions recorded in ``<schema>.migrations`` with their checksums (empty when the schema
    is not installed)."""
    return {a.version: a.checksum for a in applied_migrations(conn, schema)}


def check_schema(
    conn: psycopg.Connection[Any] | _Session, schema: str, *, directory: PathLike | None = None
) -> int:
    """Raise the error that says what to do unless this package's code runs against the schema
    (its version, or a newer one inside the window).

    Returns the installed version.
    """
    applied = applied_migrations(conn, schema)
    current = applied[-1].version if applied else 0
    return require_version(schema, current, applied=applied, directory=directory)


def _claims(applied: Iterable[Applied], migrations: Iterable[Migration]) -> dict[int, int | None]:
    """Each applied version's compatible-with: as recorded, else as this package's file says."""
    known = {m.version: m.compatible_with for m in migrations}
    return {
        a.version: a.compatible_with if a.compatible_with is not None else known.get(a.version)
        for a in applied
    }


def pending_migrations(
    conn: psycopg.Connection[Any], schema: str, *, directory: PathLike | None = None
) -> list[Migration]:
    return _pending(load_migrations(directory), applied_versions(conn, schema))


def _pending(migrations: Iterable[Migration], done: Mapping[int, str]) -> list[Migration]:
    pending = []
    for m in migrations:
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


# -- running them ---------------------------------------------------------------------------------


def migrate(
    target: object,
    *,
    schema: str = DEFAULT_SCHEMA,
    dry_run: bool = False,
    directory: PathLike | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
    backoff: float = DEFAULT_BACKOFF,
) -> list[str]:
    """Bring ``schema`` to the newest version; return the labels of the migrations applied.

    ``target`` is a ``pgskip://`` or ``postgresql://`` URL (or a libpq conninfo string) of a
    role that may create the schema, usually its owner; what ``celery -A proj pgskip migrate``
    runs. Idempotent: an up-to-date schema returns ``[]``. Concurrent runs (several deploy jobs)
    wait for each other on an advisory lock, and the later ones find nothing left to do.

    .. code-block:: python

        import kombu_pgskip

        kombu_pgskip.migrate("postgresql://owner@db.internal:5432/app")  # ['0001_initial', ...]

    ``target`` may also be an open connection of the caller's: a psycopg 3 connection, a
    psycopg2 connection, or Django's ``connection`` (``connections[alias]``, on psycopg 3 or
    psycopg2), with no transaction open (Django: outside ``transaction.atomic()``), because
    each file commits on its own and an index is built concurrently outside any transaction.
    For the run the connection is switched to autocommit mode and its ``search_path`` to
    ``pg_catalog, pg_temp``; both are put back afterwards, and the connection stays open. The
    advisory lock is the session's and is released before returning.

    Each file runs in a transaction of its own in which a statement waits at most
    ``lock_timeout`` seconds for a lock; a file whose lock was not granted is rolled back and
    tried again up to ``retries`` times, after ``backoff`` seconds, then twice that, and so on
    (at most MAX_BACKOFF). If it still fails, :class:`MigrationLockTimeout` says so; the files
    before it stay applied. ``directory`` replaces the package's migrations (tests).

    With ``dry_run`` nothing is changed and the SQL that would run is returned in the labels'
    place as ``label + "\\n" + sql``.

    Raises :class:`~kombu_pgskip.exceptions.MigrationError` when a file fails (that file is
    rolled back, the ones before it stay applied) or the connection given is inside a
    transaction, and :class:`~kombu_pgskip.exceptions.PermissionDenied` or
    :class:`~kombu_pgskip.exceptions.ConnectionFailed` when the role may not, or cannot
    connect; :class:`TypeError` for an object that is neither a URL nor a connection.
    """
    from .store import validate_schema_name

    validate_schema_name(schema)
    if lock_timeout <= 0:
        raise exceptions.ConfigurationError("lock_timeout must be a positive number of seconds")
    if retries < 0:
        raise exceptions.ConfigurationError("retries must be 0 or more")
    migrations = load_migrations(directory)
    with _session_for(target) as (session, where):
        try:
            if dry_run:
                pending = _pending(migrations, applied_versions(session, schema))
                return [f"-- {m.label}\n{m.sql}" for m in pending]
            return _Runner(session, schema, migrations, lock_timeout, retries, backoff).run()
        except psycopg.Error as exc:
            raise _translated(exc, where) from exc


class _Runner:
    """One ``migrate`` run on a session in autocommit mode: each file in a transaction of its
    own (or, for index builds marked ``concurrently``, outside one)."""

    def __init__(
        self,
        db: _Session,
        schema: str,
        migrations: list[Migration],
        lock_timeout: float,
        retries: int,
        backoff: float,
    ) -> None:
        self.db = db
        self.schema = schema
        self.ident = quote_ident(schema)
        self.migrations = migrations
        self.lock_timeout = f"{max(1, round(lock_timeout * 1000))}ms"
        self.retries = retries
        self.backoff = backoff
        self.applied: list[str] = []

    def run(self) -> list[str]:
        self._take_runner_lock()
        try:
            done = applied_migrations(self.db, self.schema)
            self._correct_claims(done)
            pending = _pending(self.migrations, {a.version: a.checksum for a in done})
            for i, m in enumerate(pending):
                try:
                    self._apply_with_retries(m, pending[i + 1 :])
                except psycopg.Error as exc:
                    if exceptions.translate(exc) is not exc:
                        raise
                    raise exceptions.MigrationError(
                        self._failure(m, pending[i + 1 :], str(exc)), migration=m.label
                    ) from exc
                self.applied.append(m.label)
            return self.applied
        finally:
            if self.db.usable():
                with contextlib.suppress(psycopg.Error):  # closing the connection unlocks too
                    self.db.rows("SELECT pg_advisory_unlock(%s)", (_lock_key(self.schema),))

    def _take_runner_lock(self) -> None:
        """Wait for the advisory lock that serialises runners, by trying it again and again:
        a session blocked in ``pg_advisory_lock`` keeps a snapshot open, which a ``CREATE INDEX
        CONCURRENTLY`` of the runner holding the lock waits for (a deadlock PostgreSQL breaks
        by failing one of them)."""
        pause = 0.05
        while True:
            (locked,) = self.db.one("SELECT pg_try_advisory_lock(%s)", (_lock_key(self.schema),))
            if locked:
                return
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _failure(self, m: Migration, later: Sequence[Migration], why: str) -> str:
        rest = f"; {', '.join(n.label for n in later)} did not run" if later else ""
        if not self.applied:
            return f"migration {m.label} failed, nothing was applied{rest}: {why}"
        return (
            f"migration {m.label} failed and was not applied; {', '.join(self.applied)} "
            f"were applied (each in its own transaction){rest}: {why}"
        )

    def _apply_with_retries(self, m: Migration, later: Sequence[Migration]) -> None:
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            logger.info(
                "applying migration %s%s",
                m.label,
                "" if attempt == 1 else f" (attempt {attempt})",
                extra={"action": "migrate_apply"},
            )
            try:
                if m.concurrent:
                    self._apply_concurrently(m)
                else:
                    self._apply_in_transaction(m)
            except (pg_errors.LockNotAvailable, pg_errors.DeadlockDetected) as exc:
                if attempt > self.retries:
                    raise MigrationLockTimeout(
                        self._failure(
                            m,
                            later,
                            f"its locks were not granted within lock_timeout "
                            f"{self.lock_timeout} in {attempt} attempts{self._holders(m)}. "
                            "Rerun `pgskip migrate` when the long transactions have ended, or "
                            "with a longer --lock-timeout",
                        ),
                        migration=m.label,
                        attempts=attempt,
                    ) from exc
                pause = min(MAX_BACKOFF, self.backoff * 2 ** (attempt - 1))
                pause *= random.uniform(0.8, 1.2)
                logger.warning(
                    "migration %s: a lock was not granted within %s (%s); rolled back, "
                    "retry %d of %d in %.1fs",
                    m.label,
                    self.lock_timeout,
                    str(exc).strip().splitlines()[0],
                    attempt,
                    self.retries,
                    pause,
                    extra={"action": "migrate_lock_retry"},
                )
                time.sleep(pause)
                continue
            logger.info(
                "applied migration %s in %.1fs",
                m.label,
                time.monotonic() - started,
                extra={"action": "migrate_applied"},
            )
            return

    def _holders(self, m: Migration) -> str:
        """Who holds locks on the tables ``m`` locks, for the error message."""
        tables = sorted(
            {t for s in m.statements for t in _locked_tables(s, _index_tables(self.migrations))}
        )
        if not tables:
            return ""
        try:
            rows = self.db.rows(
                "SELECT DISTINCT a.pid, a.state, extract(epoch FROM now() - a.xact_start)::int"
                "  FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid"
                " WHERE l.granted AND l.pid <> pg_backend_pid() AND l.relation IN ("
                "       SELECT c.oid FROM pg_class AS c JOIN pg_namespace AS n"
                "           ON n.oid = c.relnamespace"
                "        WHERE n.nspname = %s AND c.relname = ANY(%s))"
                " ORDER BY 3 DESC NULLS LAST LIMIT 5",
                (self.schema, tables),
            )
        except psycopg.Error:
            return ""  # only a detail of the message
        if not rows:
            return ""
        who = ", ".join(
            f"pid {pid} ({state or 'unknown state'}, transaction open {age}s)"
            if age is not None
            else f"pid {pid} ({state or 'unknown state'})"
            for pid, state, age in rows
        )
        return f" (sessions holding locks on {', '.join(tables)}: {who})"

    # -- one file --

    def _settings(self, *, local: bool, lock_timeout: str | None = None) -> None:
        self.db.rows(
            "SELECT set_config('lock_timeout', %s, %s), set_config('search_path', %s, %s)",
            (lock_timeout or self.lock_timeout, local, f"{self.ident}, pg_catalog, pg_temp", local),
        )

    def _bookkeeping(self) -> None:
        """The schema and ``<schema>.migrations``, in the transaction of the file applied."""
        db = self.db
        if not db.rows("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,)):
            db.rows(f"CREATE SCHEMA {self.ident}")
        if not _migrations_table(db, self.schema):
            db.rows(
                f"CREATE TABLE {self.ident}.migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now(), compatible_with integer)"
            )
        elif not self._has_claims_column():
            db.rows(f"ALTER TABLE {self.ident}.migrations ADD COLUMN compatible_with integer")

    def _has_claims_column(self) -> bool:
        return bool(
            self.db.rows(
                "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass"
                " AND attname = 'compatible_with' AND NOT attisdropped",
                (f"{self.ident}.{quote_ident('migrations')}",),
            )
        )

    def _record(self, m: Migration) -> None:
        self.db.rows(
            f"INSERT INTO {self.ident}.migrations (version, name, checksum, compatible_with)"
            " VALUES (%s, %s, %s, %s)",
            (m.version, m.name, m.checksum, m.compatible_with),
        )

    def _apply_in_transaction(self, m: Migration) -> None:
        for stmt in m.statements:
            found = _CREATE_INDEX_RE.match(stmt.code)
            if found and found.group("concurrently"):
                raise exceptions.MigrationError(
                    f"migration {m.label}, line {stmt.line}: CREATE INDEX CONCURRENTLY cannot run "
                    "in the file's transaction: mark it with `-- pgskip: concurrently` on the "
                    "line before, in a file of its own",
                    migration=m.label,
                )
        with self.db.transaction():
            # The schema first, then PostgreSQL's own objects; no schema that another role can
            # create objects in (public), so nothing a migration creates or calls resolves to
            # one of theirs. Functions created with SET search_path FROM CURRENT keep this path.
            self._settings(local=True)
            self._bookkeeping()
            for name in self._invalid_indexes(m):
                self._drop_invalid(name, concurrently=False)
            self.db.rows(m.sql.encode())
            self._record(m)

    def _apply_concurrently(self, m: Migration) -> None:
        """Each index built with CREATE INDEX CONCURRENTLY, without lock_timeout: its lock
        (SHARE UPDATE EXCLUSIVE) lets reads and writes go on, queued or granted, and the build
        waits for the transactions open on the table, not in the table's lock queue; a timeout
        there would throw the build away, leaving an INVALID index to build again. The
        session's own lock_timeout and search_path are put back afterwards."""
        db = self.db
        saved = db.one(
            "SELECT pg_catalog.current_setting('lock_timeout'),"
            " pg_catalog.current_setting('search_path')"
        )
        self._settings(local=False, lock_timeout="0")
        try:
            for stmt in m.statements:
                index = stmt.index
                assert index is not None  # Migration.validate
                state = self._index_state(index[0])
                if state is True:
                    logger.info(
                        "migration %s: index %s exists, not built again",
                        m.label,
                        index[0],
                        extra={"action": "migrate_index_exists"},
                    )
                    continue
                if state is False:
                    self._drop_invalid(index[0], concurrently=True)
                logger.info(
                    "migration %s: building index %s concurrently (reads and writes go on; it "
                    "waits for the transactions open on %s)",
                    m.label,
                    index[0],
                    index[1],
                    extra={"action": "migrate_index_build"},
                )
                db.rows(stmt.concurrent_sql.encode())
            with db.transaction():
                self._settings(local=True)
                self._bookkeeping()
                self._record(m)
        finally:
            if db.usable() and db.status() == _IDLE:
                with contextlib.suppress(psycopg.Error):  # the error on its way out matters
                    db.rows(
                        "SELECT pg_catalog.set_config('lock_timeout', %s, false),"
                        " pg_catalog.set_config('search_path', %s, false)",
                        saved,
                    )

    def _index_state(self, name: str) -> bool | None:
        """True: a valid index of that name in the schema; False: an INVALID one; None: none."""
        rows = self.db.rows(
            "SELECT i.indisvalid FROM pg_class AS c"
            "  JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            "  JOIN pg_index AS i ON i.indexrelid = c.oid"
            " WHERE n.nspname = %s AND c.relname = %s",
            (self.schema, name),
        )
        return bool(rows[0][0]) if rows else None

    def _invalid_indexes(self, m: Migration) -> list[str]:
        names = [s.index[0] for s in m.statements if s.index is not None]
        return [n for n in names if self._index_state(n) is False]

    def _drop_invalid(self, name: str, *, concurrently: bool) -> None:
        logger.warning(
            "dropping the INVALID index %s.%s (left by an interrupted CREATE INDEX "
            "CONCURRENTLY) before building it again",
            self.schema,
            name,
            extra={"action": "migrate_drop_invalid_index"},
        )
        how = "DROP INDEX CONCURRENTLY" if concurrently else "DROP INDEX"
        self.db.rows(f"{how} IF EXISTS {self.ident}.{quote_ident(name)}")

    def _correct_claims(self, done: Sequence[Applied]) -> None:
        """Record this package's compatible-with for the applied versions it knows, when the
        package is at least as new as the database (a newer release may correct a claim; an
        older one must not undo that)."""
        if not done or not self.migrations or self.migrations[-1].version < done[-1].version:
            return
        known = {m.version: m.compatible_with for m in self.migrations}
        wrong = [
            (a.version, known[a.version])
            for a in done
            if a.version in known and a.compatible_with != known[a.version]
        ]
        if not wrong:
            return
        with self.db.transaction():
            self._settings(local=True)
            self._bookkeeping()
            for version, claim in wrong:
                self.db.rows(
                    f"UPDATE {self.ident}.migrations SET compatible_with = %s WHERE version = %s",
                    (claim, version),
                )


# -- statements -----------------------------------------------------------------------------------

_TOKEN_RE = re.compile(
    r"""
      (?P<line_comment>--[^\n]*)
    | (?P<block_comment>/\*.*?\*/)
    | (?P<estring>(?<![\w$])[eE]'(?:[^'\\]|\\.|'')*')
    | (?P<string>'(?:[^']|'')*')
    | (?P<ident>"(?:[^"]|"")*")
    | (?P<dollar0>(?<![\w$])\$\$.*?\$\$)
    | (?P<dollar>(?<![\w$])\$(?P<tag>[A-Za-z_][A-Za-z0-9_]*)\$.*?\$(?P=tag)\$)
    | (?P<semicolon>;)
    """,
    re.VERBOSE | re.DOTALL,
)


def split_statements(text: str) -> list[Statement]:
    """The statements of a SQL file, split at the semicolons outside strings, quoted names,
    dollar quotes and comments."""
    statements: list[Statement] = []
    start = 0
    blanks: list[tuple[int, int]] = []  # comment spans of the current statement
    for match in _TOKEN_RE.finditer(text):
        kind = match.lastgroup
        if kind in ("line_comment", "block_comment"):
            blanks.append(match.span())
        elif kind == "semicolon":
            _add_statement(statements, text, start, match.start(), blanks)
            start, blanks = match.end(), []
    _add_statement(statements, text, start, len(text), blanks)
    return statements


def _add_statement(
    out: list[Statement], text: str, start: int, end: int, blanks: list[tuple[int, int]]
) -> None:
    chunk = list(text[start:end])
    for a, b in blanks:
        chunk[a - start : b - start] = " " * (b - a)
    blanked = "".join(chunk)
    body_at = len(blanked) - len(blanked.lstrip())
    if body_at == len(blanked):
        return
    leading = text[start : start + body_at]
    marked = any(m.group(1).split() == ["concurrently"] for m in _DIRECTIVE_RE.finditer(leading))
    out.append(
        Statement(
            text=text[start + body_at : end].rstrip(),
            code=" ".join(blanked.split()),
            marked=marked,
            line=text.count("\n", 0, start + body_at) + 1,
        )
    )


# -- what a statement locks -----------------------------------------------------------------------

_NAME = r'(?:"(?:[^"]|"")+"|[A-Za-z_%][\w$%]*)'
_QNAME = rf"{_NAME}(?:\s*\.\s*{_NAME})*"
_CREATE_INDEX_RE = re.compile(
    rf"CREATE (?:UNIQUE )?INDEX (?P<concurrently>CONCURRENTLY )?(?:IF NOT EXISTS )?"
    rf"(?:(?P<name>{_NAME}) )?ON (?:ONLY )?(?P<table>{_QNAME})",
    re.IGNORECASE,
)

_EFFECT = {
    "ACCESS EXCLUSIVE": "blocks reads and writes",
    "EXCLUSIVE": "blocks writes",
    "SHARE ROW EXCLUSIVE": "blocks writes",
    "SHARE": "blocks writes",
    "SHARE UPDATE EXCLUSIVE": "reads and writes go on",
    "ROW EXCLUSIVE": "row locks only",
    "ROW SHARE": "row locks only",
    "ACCESS SHARE": "blocks only DDL",
}
_NO_TABLE_LOCK = re.compile(
    r"(?:CREATE (?:OR REPLACE )?(?:FUNCTION|PROCEDURE|AGGREGATE|TYPE|SEQUENCE|SCHEMA|DOMAIN"
    r"|EXTENSION|OPERATOR|CAST)"
    r"|DROP (?:FUNCTION|PROCEDURE|ROUTINE|AGGREGATE|TYPE|DOMAIN|OPERATOR|CAST)"
    r"|ALTER (?:FUNCTION|PROCEDURE|ROUTINE|TYPE|SCHEMA|DOMAIN|DEFAULT PRIVILEGES)"
    r"|GRANT|REVOKE|SET|RESET)\b"
    r"|SELECT (?:pg_catalog\s*\.\s*)?set_config\s*\(",
    re.IGNORECASE,
)
# PL/pgSQL around a command: BEGIN, IF ... THEN, FOR ... LOOP and the like.
_CONTROL_PREFIX = re.compile(
    r"(?:BEGIN|ELSE|LOOP|DECLARE|(?:IF|ELSIF|WHEN) .*? THEN|(?:FOR|FOREACH|WHILE) .*? LOOP)"
    r"(?: |$)",
    re.IGNORECASE,
)
_SQL_COMMANDS = {
    "ALTER", "CREATE", "DROP", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "LOCK", "GRANT",
    "REVOKE", "COMMENT", "REINDEX", "VACUUM", "CLUSTER", "REFRESH", "DO",
}  # fmt: skip


def _unquote(name: str) -> str:
    name = name.strip()
    if name.startswith('"'):
        return name[1:-1].replace('""', '"')
    return name.lower()


def _short_name(qualified: str) -> str:
    """A table's name without its schema; ``%I``-style placeholders when named at run time."""
    last = re.split(rf"\s*\.\s*(?={_NAME}\s*$)", qualified.strip())[-1]
    return "a table named at run time" if "%" in last else _unquote(last)


def _names(text: str) -> list[str]:
    return [_short_name(n) for n in re.findall(_QNAME, text) if n.upper() not in _KEYWORDS]


_KEYWORDS = {"IF", "EXISTS", "ONLY", "CASCADE", "RESTRICT", "TABLE", "CONCURRENTLY"}


@dataclass(frozen=True)
class Locks:
    """The table locks a statement takes, as far as its text tells."""

    taken: tuple[tuple[str, str], ...]  # (mode, table)
    known: bool
    note: str = ""

    def describe(self) -> str:
        if not self.known:
            return f"locks not derived from the text ({self.note}): read it"
        if not self.taken:
            return f"no table lock{f' ({self.note})' if self.note else ''}"
        parts = [f"{mode} on {table} ({_EFFECT.get(mode, '')})" for mode, table in self.taken]
        return "; ".join(parts) + (f"; {self.note}" if self.note else "")


def statement_locks(stmt: Statement, index_tables: Mapping[str, str] | None = None) -> Locks:
    """The locks ``stmt`` takes on tables, from its text: ``ALTER TABLE x`` takes ACCESS
    EXCLUSIVE on x, ``CREATE INDEX ... ON x`` SHARE (SHARE UPDATE EXCLUSIVE when built
    concurrently), ``CREATE OR REPLACE FUNCTION`` none, and so on."""
    return _locks_of(stmt.code, index_tables or {}, concurrently=stmt.marked, raw=stmt.text)


def _locks_of(
    code: str, index_tables: Mapping[str, str], *, concurrently: bool = False, raw: str = ""
) -> Locks:
    text = code.strip()
    upper = text.upper()
    match = _CREATE_INDEX_RE.match(text)
    if match:
        table = _short_name(match.group("table"))
        if concurrently or match.group("concurrently"):
            return Locks((("SHARE UPDATE EXCLUSIVE", table),), True, "built concurrently")
        return Locks((("SHARE", table),), True, "for as long as the build reads the table")
    match = re.match(
        rf"DROP INDEX (?P<c>CONCURRENTLY )?(?:IF EXISTS )?(?P<names>{_QNAME}(?:\s*,\s*{_QNAME})*)",
        text,
        re.IGNORECASE,
    )
    if match:
        mode = "SHARE UPDATE EXCLUSIVE" if match.group("c") else "ACCESS EXCLUSIVE"
        tables = [
            index_tables.get(n, f"the table of index {n}") for n in _names(match.group("names"))
        ]
        return Locks(tuple((mode, t) for t in tables), True)
    match = re.match(rf"ALTER TABLE (?:IF EXISTS )?(?:ONLY )?(?P<t>{_QNAME}) (?P<rest>.*)", text,
                     re.IGNORECASE | re.DOTALL)  # fmt: skip
    if match:
        table, rest = _short_name(match.group("t")), match.group("rest")
        if re.match(r"(?:VALIDATE CONSTRAINT|SET STATISTICS|SET \(|RESET \()", rest, re.I):
            return Locks((("SHARE UPDATE EXCLUSIVE", table),), True)
        taken = [("ACCESS EXCLUSIVE", table)]
        taken += [("SHARE ROW EXCLUSIVE", t) for t in _referenced(rest)]
        return Locks(tuple(taken), True)
    match = re.match(rf"ALTER (?:INDEX|SEQUENCE|VIEW|MATERIALIZED VIEW) (?:IF EXISTS )?"
                     rf"(?P<t>{_QNAME})", text, re.IGNORECASE)  # fmt: skip
    if match:
        return Locks((("ACCESS EXCLUSIVE", _short_name(match.group("t"))),), True)
    match = re.match(
        rf"CREATE (?:OR REPLACE )?(?:CONSTRAINT )?TRIGGER {_NAME} .*?\bON "
        rf"(?:ONLY )?(?P<t>{_QNAME})",
        text,
        re.IGNORECASE | re.DOTALL,
    )
    if match:
        return Locks((("SHARE ROW EXCLUSIVE", _short_name(match.group("t"))),), True)
    match = re.match(rf"DROP TRIGGER (?:IF EXISTS )?{_NAME} ON (?:ONLY )?(?P<t>{_QNAME})", text,
                     re.IGNORECASE)  # fmt: skip
    if match:
        return Locks((("ACCESS EXCLUSIVE", _short_name(match.group("t"))),), True)
    match = re.match(
        rf"(?:DROP (?:TABLE|SEQUENCE|VIEW|MATERIALIZED VIEW)|TRUNCATE(?: TABLE)?) "
        rf"(?:IF EXISTS )?(?:ONLY )?(?P<names>{_QNAME}(?:\s*,\s*{_QNAME})*)",
        text,
        re.IGNORECASE,
    )
    if match:
        return Locks(tuple(("ACCESS EXCLUSIVE", n) for n in _names(match.group("names"))), True)
    match = re.match(rf"CREATE (?:UNLOGGED |TEMP |TEMPORARY )?TABLE (?:IF NOT EXISTS )?{_QNAME}",
                     text, re.IGNORECASE)  # fmt: skip
    if match:
        refs = tuple(("SHARE ROW EXCLUSIVE", t) for t in _referenced(text[match.end() :]))
        return Locks(refs, True, "a new table")
    match = re.match(
        rf"(?:INSERT INTO|UPDATE(?: ONLY)?|DELETE FROM(?: ONLY)?) (?P<t>{_QNAME})",
        text,
        re.IGNORECASE,
    )
    if match:
        return Locks((("ROW EXCLUSIVE", _short_name(match.group("t"))),), True)
    match = re.match(
        rf"LOCK (?:TABLE )?(?:ONLY )?(?P<names>{_QNAME}(?:\s*,\s*{_QNAME})*)"
        r"(?: IN (?P<mode>[A-Z ]+?) MODE)?",
        text,
        re.IGNORECASE,
    )
    if match:
        mode = (match.group("mode") or "ACCESS EXCLUSIVE").upper()
        return Locks(tuple((mode, n) for n in _names(match.group("names"))), True)
    if re.match(r"COMMENT ON (?:TABLE|COLUMN)", text, re.IGNORECASE):
        match = re.match(rf"COMMENT ON (?:TABLE|COLUMN) (?P<t>{_QNAME})", text, re.IGNORECASE)
        assert match is not None
        name = match.group("t")
        table = name.rsplit(".", 1)[0] if "COLUMN" in upper[:18] else name
        return Locks((("SHARE UPDATE EXCLUSIVE", _short_name(table)),), True)
    if _NO_TABLE_LOCK.match(text):
        return Locks((), True)
    if re.match(r"DO\b", upper):
        return _do_block_locks(raw or text, index_tables)
    if upper.startswith(("SELECT", "WITH", "VALUES")):
        return Locks((), True, "reads: ACCESS SHARE on what it reads")
    return Locks((), False, f"{text.split(' ', 1)[0].upper()} is not analysed")


def _referenced(text: str) -> list[str]:
    return [_short_name(t) for t in re.findall(rf"\bREFERENCES ({_QNAME})", text, re.IGNORECASE)]


def _literal_text(token: str) -> str:
    if token.startswith("$"):
        return token[token.index("$", 1) + 1 : token.rindex("$", 0, len(token) - 1)]
    if token[:1] in "eE":
        token = token[1:]
    return token[1:-1].replace("''", "'")


def _do_block_locks(text: str, index_tables: Mapping[str, str]) -> Locks:
    """A DO block's locks: those of the commands it runs, as far as they are written out
    (``EXECUTE format('GRANT ...')`` is; ``EXECUTE some_variable`` is not)."""
    body = next(
        (
            m.group(0)
            for m in _TOKEN_RE.finditer(text)
            if m.lastgroup in ("dollar0", "dollar", "string", "estring")
        ),
        None,
    )
    if body is None:
        return Locks((), False, "a DO block without a body")
    taken: list[tuple[str, str]] = []
    commands: list[str] = []
    for stmt in split_statements(_literal_text(body)):
        command = stmt.code
        while prefix := _CONTROL_PREFIX.match(command):
            command = command[prefix.end() :]
        executed = re.match(
            r"EXECUTE\s+(?:(?:pg_catalog\s*\.\s*)?format\s*\(\s*)?", command, re.IGNORECASE
        )
        if executed:
            token = _TOKEN_RE.match(command, executed.end())
            if token is None or token.lastgroup not in ("dollar0", "dollar", "string", "estring"):
                return Locks((), False, "a DO block that runs a statement built at run time")
            command = " ".join(_literal_text(token.group(0)).split())
        first = command.split(" ", 1)[0].upper()
        if first not in _SQL_COMMANDS:
            continue  # PL/pgSQL: assignments, IF, RAISE, END, PERFORM, queries
        locks = _locks_of(command, index_tables)
        if not locks.known:
            return Locks((), False, f"a DO block that runs {first}")
        commands.append(_command_name(command))
        taken.extend(t for t in locks.taken if t not in taken)
    note = f"DO block: {', '.join(dict.fromkeys(commands))}" if commands else "DO block"
    return Locks(tuple(taken), True, note)


def _command_name(command: str) -> str:
    """``CREATE OR REPLACE FUNCTION``, ``GRANT SELECT``: the words that say what it does."""
    words = command.upper().replace(",", " ").split()
    size = 4 if words[1:3] == ["OR", "REPLACE"] else 2
    return " ".join(words[:size])


def _locked_tables(stmt: Statement, index_tables: Mapping[str, str]) -> list[str]:
    return [t for _, t in statement_locks(stmt, index_tables).taken if " " not in t]


def _index_tables(migrations: Iterable[Migration]) -> dict[str, str]:
    """Index name -> its table, from every ``CREATE INDEX`` of the migrations."""
    found: dict[str, str] = {}
    for m in migrations:
        for stmt in m.statements:
            if stmt.index is not None:
                found[stmt.index[0]] = stmt.index[1]
    return found


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedStatement:
    statement: Statement
    locks: Locks

    def line(self, width: int = 58) -> str:
        text = self.statement.code
        if self.statement.marked:
            text = " ".join(self.statement.concurrent_sql.split())
        text = text if len(text) <= width else text[: width - 3] + "..."
        return f"{text:<{width}}  {self.locks.describe()}"


@dataclass(frozen=True)
class PlannedStep:
    migration: Migration
    statements: tuple[PlannedStatement, ...]
    invalid_indexes: tuple[str, ...]  # INVALID leftovers dropped before the build
    keeps: int  # after this step, code built for this schema version or later keeps working


@dataclass(frozen=True)
class Plan:
    """What ``migrate`` would do, and to which code; built by :func:`plan`."""

    schema: str
    current: int  # the database's version (0: not installed)
    running_floor: int  # the oldest code that runs against it now
    code: int  # the version this package is built for
    steps: tuple[PlannedStep, ...]
    lock_timeout: float
    retries: int

    @property
    def final_floor(self) -> int:
        if not self.steps:
            return self.running_floor
        return max([self.running_floor, *(s.keeps for s in self.steps)])

    def lines(self) -> list[str]:
        out = [self._database_line()]
        if not self.steps:
            out.append("nothing to run: up to date")
            return out
        out.append(
            f"{len(self.steps)} migration(s) to run, each file on its own (lock_timeout "
            f"{self.lock_timeout:g}s, up to {self.retries} retries when a lock is not granted):"
        )
        keeps = self.running_floor
        for step in self.steps:
            m = step.migration
            how = (
                "outside a transaction, CREATE INDEX CONCURRENTLY without lock_timeout: it "
                "waits for the transactions open on the table"
                if m.concurrent
                else "one transaction"
            )
            out.append(f"{m.label}  ({how})")
            drop = "DROP INDEX CONCURRENTLY" if m.concurrent else "DROP INDEX"
            out.extend(
                f"    first {drop} {name}: an INVALID index left by an interrupted build"
                for name in step.invalid_indexes
            )
            out.extend(f"    {s.line()}" for s in step.statements)
            out.append(f"    {self._verdict(step, keeps)}")
            keeps = max(keeps, step.keeps)
        top = self.steps[-1].migration.version
        out.append(
            f"afterwards: schema at {top:04d}; code built for schema "
            f"{_span(self.final_floor, top)} runs against it"
        )
        return out

    def _database_line(self) -> str:
        mine = f"this kombu-pgskip is built for {self.code:04d}"
        if not self.current:
            return f"schema {self.schema!r} is not installed; {mine}"
        return (
            f"schema {self.schema!r} at {self.current:04d} (code built for schema "
            f"{_span(self.running_floor, self.current)} runs against it); {mine}"
        )

    def _verdict(self, step: PlannedStep, before: int) -> str:
        """What ``step`` does to the code running when it starts (built for ``before`` or
        later, up to the database's version)."""
        declared = (
            ""
            if step.migration.declared
            else " (the file has no `-- pgskip: compatible-with` line: taken as breaking)"
        )
        whom = f"compatible with code built for schema {step.keeps:04d} and later{declared}"
        if not self.current:
            return f"{whom}; no running code (a new install)"
        if before > self.current:
            return f"{whom}: (the running code was stopped for an earlier step)"
        after = max(before, step.keeps)
        if after == before:
            if before == self.running_floor:
                return f"{whom}: running code keeps working"
            return f"{whom}: breaks no more running code"
        if after > self.current:
            return (
                f"{whom}: BREAKS the running code (built for schema "
                f"{_span(before, self.current)}): stop it before this step"
            )
        return (
            f"{whom}: BREAKS running code built for schema {_span(before, after - 1)}: stop "
            "or upgrade it before this step"
        )


def _span(oldest: int, newest: int) -> str:
    return f"{oldest:04d}" if oldest >= newest else f"{oldest:04d} to {newest:04d}"


def plan(
    target: object,
    *,
    schema: str = DEFAULT_SCHEMA,
    directory: PathLike | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
) -> Plan:
    """What :func:`migrate` would run against ``target`` (a URL or a connection, as
    :func:`migrate` takes them): each pending file's statements with the locks they take, and
    whether the code running against the database now stays compatible. Changes nothing."""
    from .store import validate_schema_name

    validate_schema_name(schema)
    migrations = load_migrations(directory)
    index_tables = _index_tables(migrations)
    with _session_for(target) as (session, where):
        try:
            applied = applied_migrations(session, schema)
            pending = _pending(migrations, {a.version: a.checksum for a in applied})
            invalid = {
                str(r[0])
                for r in session.rows(
                    "SELECT c.relname FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
                    "  JOIN pg_namespace AS n ON n.oid = c.relnamespace"
                    " WHERE n.nspname = %s AND NOT i.indisvalid",
                    (schema,),
                )
            }
        except psycopg.Error as exc:
            raise exceptions.translate(exc, url_for_messages=where) from exc
    current = applied[-1].version if applied else 0
    claims = _claims(applied, migrations)
    steps: list[PlannedStep] = []
    keeps = 0
    for m in pending:
        keeps = max(keeps, m.compatible_with)
        statements = tuple(
            PlannedStatement(s, statement_locks(s, index_tables)) for s in m.statements
        )
        names = tuple(s.index[0] for s in m.statements if s.index and s.index[0] in invalid)
        steps.append(PlannedStep(m, statements, names, keeps))
    return Plan(
        schema=schema,
        current=current,
        running_floor=window_floor(current, claims),
        code=migrations[-1].version if migrations else 0,
        steps=tuple(steps),
        lock_timeout=lock_timeout,
        retries=retries,
    )


def schema_window(url: str, schema: str = DEFAULT_SCHEMA) -> tuple[int, int]:
    """(oldest, newest) schema version whose code runs against the database's schema now."""
    with connect(url, autocommit=True) as conn:
        applied = applied_migrations(conn, schema)
    current = applied[-1].version if applied else 0
    return window_floor(current, _claims(applied, load_migrations())), current
