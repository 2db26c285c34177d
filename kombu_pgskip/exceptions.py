"""One exception root, typed subclasses, and the one place psycopg errors are translated.

Every error a user can meet derives from :class:`PgSkipError`; each subclass's docstring is its
default message and says what to do next. Where an error is also a kind of driver error (the
server went away), it also subclasses psycopg's class so that existing ``except`` clauses and
kombu's ``connection_errors`` keep catching it.
"""

from __future__ import annotations

from typing import Any

import psycopg
from kombu.exceptions import ChannelError
from psycopg import errors as pg_errors


class PgSkipError(Exception):
    """kombu-pgskip error."""

    def __init__(self, message: str | None = None, **context: Any) -> None:
        self.context = context
        super().__init__(message or self.default_message())

    @classmethod
    def default_message(cls) -> str:
        """The class docstring, on one line."""
        return " ".join((cls.__doc__ or "").split())


class ConfigurationError(PgSkipError, ValueError):
    """Invalid kombu-pgskip configuration."""


class InvalidURL(ConfigurationError):
    """Malformed broker URL: expected pgskip://user:password@host:5432/dbname."""


class InvalidQueueName(ConfigurationError):
    """Invalid queue name: a queue name is 1 to 255 bytes of UTF-8 without NUL characters."""


class MessageTooLarge(ConfigurationError):
    """Message too large for this broker (see the max_message_size transport option)."""


class SchemaError(PgSkipError):
    """The pgskip schema is missing or out of date."""


class SchemaNotInstalled(SchemaError):
    """Schema not installed: run `celery -A proj pgskip migrate`
    (or `python -m kombu_pgskip migrate --url ...`)."""


class SchemaOutdated(SchemaError):
    """Schema out of date: run `celery -A proj pgskip migrate`
    (or `python -m kombu_pgskip migrate --url ...`)."""


class SchemaTooNew(SchemaError):
    """The database schema is newer than this kombu-pgskip: upgrade the kombu-pgskip package."""


class ConnectionFailed(PgSkipError, psycopg.OperationalError):
    """Cannot connect to PostgreSQL: check host, port and that the server is running."""


class AuthenticationFailed(PgSkipError):
    """PostgreSQL refused the credentials: check the user and password in the broker URL."""


class ReadOnlyDatabase(PgSkipError):
    """The database is read-only (a standby or default_transaction_read_only):
    point the broker URL at the primary, e.g. with target_session_attrs=read-write."""

    @classmethod
    def because(
        cls, *, standby: bool, source: str | None, user: str, database: str, where: str
    ) -> ReadOnlyDatabase:
        """The error naming why this session cannot write, and the statement that fixes it."""
        if standby:
            return cls(
                f"the PostgreSQL server at {where} is a read-only standby (pg_is_in_recovery()): "
                "point the broker URL at the primary, or list every server and add "
                "?target_session_attrs=read-write so that libpq picks the primary"
            )
        fixes = {
            "database": f'ALTER DATABASE "{database}" RESET default_transaction_read_only',
            "user": f'ALTER ROLE "{user}" RESET default_transaction_read_only',
            "database user": (
                f'ALTER ROLE "{user}" IN DATABASE "{database}" RESET default_transaction_read_only'
            ),
        }
        fix = fixes.get(source or "")
        how = (
            f"run `{fix};` as the owner or a superuser"
            if fix
            else "remove it from the connection options (PGOPTIONS, ?options=) or postgresql.conf"
        )
        return cls(
            f"database {database!r} at {where} is read-only for role {user!r}: "
            f"default_transaction_read_only is on (set by: {source or 'unknown'}); {how}, or use "
            "a role and database that may write"
        )


class PermissionDenied(PgSkipError):
    """The database role lacks a privilege kombu-pgskip needs: the schema's owner grants a
    worker or publisher role what it needs with `celery -A proj pgskip grant --worker ROLE
    --publisher ROLE` (docs/security.md); migrations run as the owner."""


class PreconditionFailed(PgSkipError, ChannelError):  # type: ignore[misc]
    """A queue or exchange exists with other settings than this declaration's (AMQP's
    PRECONDITION_FAILED): nothing was changed. Declare it as it was first declared, or have
    the schema's owner change a queue's arguments with `celery -A proj pgskip queue-args`."""


class MigrationError(PgSkipError):
    """A migration failed; nothing of it was applied."""


# SQLSTATE classes: https://www.postgresql.org/docs/current/errcodes-appendix.html
_AUTH_SQLSTATES = frozenset({"28000", "28P01"})


def translate(exc: BaseException, *, url_for_messages: str | None = None) -> BaseException:
    """Map a psycopg error to the kombu-pgskip error that says what to do, by class or SQLSTATE.

    Errors with no better meaning are returned unchanged, so that connection errors stay the
    psycopg classes kombu knows how to recover from.
    """
    where = f" ({url_for_messages})" if url_for_messages else ""
    if isinstance(exc, PgSkipError):
        return exc
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(exc, (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)) or sqlstate in (
        "42P01",
        "3F000",
    ):
        return SchemaNotInstalled(f"{SchemaNotInstalled.default_message()}{where}")
    if isinstance(exc, pg_errors.UndefinedFunction) or sqlstate == "42883":
        return SchemaOutdated(f"{SchemaOutdated.default_message()}{where}")
    if isinstance(exc, pg_errors.ReadOnlySqlTransaction) or sqlstate == "25006":
        return ReadOnlyDatabase(f"{ReadOnlyDatabase.default_message()}{where}")
    if isinstance(exc, pg_errors.InsufficientPrivilege) or sqlstate == "42501":
        return PermissionDenied(f"{PermissionDenied.default_message()}{where}: {exc}")
    if sqlstate in _AUTH_SQLSTATES:
        return AuthenticationFailed(f"{AuthenticationFailed.default_message()}{where}")
    return exc


def connect_hint(exc: BaseException) -> str:
    """What to do about a failed connection attempt, by SQLSTATE (libpq's own errors have none)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    if sqlstate in _AUTH_SQLSTATES:
        return "check the user and password in the broker URL, and pg_hba.conf"
    if sqlstate == "3D000":
        return "the database does not exist: create it or fix its name in the broker URL"
    if sqlstate.startswith("53"):
        return (
            "the server is out of connections or memory: lower the workers' concurrency or "
            "raise max_connections"
        )
    # libpq's own failures (refused, timed out, authentication, not PostgreSQL) carry no
    # SQLSTATE in psycopg, and their texts are not to be matched: name every cause.
    return (
        "check that host and port are those of a running PostgreSQL server (not another "
        "service on that port) that accepts connections from here, and check the user and "
        "password in the broker URL"
    )


# -- apply_async_in / send_task_in ----------------------------------------------------------------


class TransactionalEnqueueError(PgSkipError):
    """The job cannot be written in this transaction; nothing was written."""


class NotAConnection(TransactionalEnqueueError, TypeError):
    """apply_async_in needs an open database connection: a psycopg 3 connection or cursor, a
    psycopg2 connection or cursor, a SQLAlchemy Connection or Session, or Django's connection."""


class ConnectionInAutocommit(TransactionalEnqueueError):
    """The connection is in autocommit mode, so the job would be committed on its own, whatever
    your transaction does. Open a transaction first (psycopg: `with conn.transaction():`;
    SQLAlchemy: `with engine.begin() as conn:`; Django: `with transaction.atomic():`)."""


class TransactionAborted(TransactionalEnqueueError):
    """The transaction is aborted (an earlier statement in it failed): roll it back, or back to a
    savepoint, before enqueuing."""


class ConnectionClosed(TransactionalEnqueueError):
    """The connection is closed or broken: open a new connection and a new transaction."""


class UnsupportedCanvas(TransactionalEnqueueError):
    """A chord cannot be enqueued in a transaction: Celery publishes a chord's header through the
    app's own broker connection, outside your transaction. Enqueue a task that starts the chord,
    or start the chord after commit."""


class translating:  # used as a function: ``with translating(...):``
    """Re-raise the psycopg errors that have a clearer meaning as :func:`translate` maps them.

    A class rather than a ``@contextmanager`` generator: it wraps every publish, where the
    generator's set-up costs several microseconds.
    """

    __slots__ = ("url_for_messages",)

    def __init__(self, *, url_for_messages: str) -> None:
        self.url_for_messages = url_for_messages

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, psycopg.Error) and not isinstance(exc, PgSkipError):
            translated = translate(exc, url_for_messages=self.url_for_messages)
            if translated is not exc:
                raise translated from exc
