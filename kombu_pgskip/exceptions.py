"""One exception root, typed subclasses, and the one place psycopg errors are translated.

Every error a user can meet derives from :class:`PgSkipError`; each subclass's docstring is its
default message and says what to do next. Where an error is also a kind of driver error (the
server went away), it also subclasses psycopg's class so that existing ``except`` clauses and
kombu's ``connection_errors`` keep catching it.
"""

from __future__ import annotations

from typing import Any

import psycopg
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


class PermissionDenied(PgSkipError):
    """The database role lacks a privilege kombu-pgskip needs: see the README's
    least-privilege setup for the GRANTs."""


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
