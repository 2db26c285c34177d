"""One exception root, typed subclasses, and the one place psycopg errors are translated.

Every error a user can meet derives from :class:`PgSkipError`; each subclass's docstring is its
default message and says what to do next. Where an error is also a kind of driver error (the
server went away), it also subclasses psycopg's class so that existing ``except`` clauses and
kombu's ``connection_errors`` keep catching it.

A server error is classified by its SQLSTATE, here and nowhere else (:func:`classify`):

* the ones with a clearer meaning become the error that says what to do
  (:class:`SchemaNotInstalled`, :class:`PermissionDenied`, ...: :func:`translate`);
* the ones that pass (:data:`TRANSIENT_CLASSES`, :data:`TRANSIENT_SQLSTATES`, and a
  connection that went away) become a :class:`TransientDatabaseError`, an
  ``OperationalError``: kombu and Celery reconnect and retry;
* on the package's own connections, every other server error becomes a
  :class:`PersistentDatabaseError`, which is not an ``OperationalError``: retrying cannot
  help, so it fails loudly instead of being retried for ever.

Both keep psycopg's class for the SQLSTATE where they can (a
``TransientDatabaseError`` for 40P01 is also a ``psycopg.errors.DeadlockDetected``), so that
``except`` clauses written for psycopg still catch them.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

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
    psycopg classes kombu knows how to recover from (:func:`classify` goes on from there).
    """
    where = f" ({url_for_messages})" if url_for_messages else ""
    if isinstance(exc, PgSkipError):
        return exc
    sqlstate = getattr(exc, "sqlstate", None)
    code = f" (SQLSTATE {sqlstate})" if sqlstate else ""
    if isinstance(exc, (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)) or sqlstate in (
        "42P01",
        "3F000",
    ):
        return SchemaNotInstalled(f"{SchemaNotInstalled.default_message()}{where}{code}")
    if isinstance(exc, pg_errors.UndefinedFunction) or sqlstate == "42883":
        return SchemaOutdated(f"{SchemaOutdated.default_message()}{where}{code}")
    if isinstance(exc, pg_errors.ReadOnlySqlTransaction) or sqlstate == "25006":
        return ReadOnlyDatabase(f"{ReadOnlyDatabase.default_message()}{where}{code}")
    if isinstance(exc, pg_errors.InsufficientPrivilege) or sqlstate == "42501":
        return PermissionDenied(f"{PermissionDenied.default_message()}{where}{code}: {exc}")
    if sqlstate in _AUTH_SQLSTATES:
        return AuthenticationFailed(f"{AuthenticationFailed.default_message()}{where}{code}")
    return exc


# -- server errors, by SQLSTATE ------------------------------------------------------------------

#: SQLSTATE classes (the first two characters) whose errors pass: the same statement, on a new
#: session if need be, can succeed. What each class means, for messages.
TRANSIENT_CLASSES: dict[str, str] = {
    "08": "the connection to the server failed",
    "40": "the server rolled the transaction back",
    "53": "the server ran short of a resource",
    "57": "an operator or the server intervened",
}

#: SQLSTATEs whose errors pass, and what each means: those of the classes above that say more,
#: and those of classes whose other errors do not pass. 58000 and 58030 are the server's
#: system and I/O errors, which a storage problem that clears (as 53100, a full disk) raises;
#: the rest of class 58 (a file the server needs missing or duplicated) is an installation
#: problem. 26000: a prepared statement of the session is gone, which a new session prepares
#: again.
TRANSIENT_SQLSTATES: dict[str, str] = {
    "25P03": "the server ended a session left idle in a transaction "
    "(idle_in_transaction_session_timeout)",
    "25P04": "the server ended a transaction that ran too long (transaction_timeout)",
    "26000": "a prepared statement of the session is gone (DISCARD ALL, a pooler's reset)",
    "40001": "the server rolled the transaction back: serialization failure",
    "40003": "the server could not say whether the statement completed",
    "40P01": "the server rolled the transaction back: deadlock detected",
    "53100": "the server's disk is full",
    "53200": "the server is out of memory",
    "53300": "the server has no connection slot left (max_connections)",
    "55P03": "a lock was not granted in time (lock_timeout)",
    "57014": "the statement was canceled (statement_timeout, pg_cancel_backend() or a cancel "
    "request)",
    "57P01": "the server terminated the session (pg_terminate_backend() or a shutdown)",
    "57P02": "the server crashed and is restarting",
    "57P03": "the server cannot accept connections now (starting up or shutting down)",
    "57P05": "the server ended an idle session (idle_session_timeout)",
    "58000": "the server hit a system error",
    "58030": "the server hit an I/O error",
    "72000": "snapshot too old (old_snapshot_threshold)",
}

#: SQLSTATEs of the classes above whose errors do not pass.
_NOT_TRANSIENT = frozenset({"40002", "57P04"})

#: What a server error that does not pass means, by SQLSTATE or class; the fallback is
#: :data:`_PERSISTENT_DEFAULT`.
_PERSISTENT_HINTS: dict[str, str] = {
    "0A": "a feature the server does not support",
    "22": "the server refused a value",
    "23": "an integrity constraint was violated",
    "40002": "a constraint checked at commit was violated",
    "42": "the statement does not fit the database: check the schema with "
    "`celery -A proj pgskip doctor`; `celery -A proj pgskip migrate` installs or upgrades it",
    "54": "a limit of the server was exceeded",
    "55": "an object is not in the state the statement needs",
    "57P04": "the database was dropped",
    "58": "a file the server needs is missing or duplicated: an installation problem",
    "F0": "the server's configuration file is invalid",
    "XX": "the server hit an internal error (possibly corrupted data): see its log",
}
_PERSISTENT_DEFAULT = "see the server's log"

_RETRY = "transient: the same statement can succeed on a new connection"
_NO_RETRY = (
    "retrying would fail the same way, so it is not retried: fix the cause (the server's log "
    "has the statement; `celery -A proj pgskip doctor` checks the schema and the grants)"
)


class _ServerError(PgSkipError):
    """An error of the database server, classified: :attr:`sqlstate` is its SQLSTATE (``None``
    when the connection went away, which libpq reports without one), the psycopg error it
    stands for is its ``__cause__``."""

    sqlstate: str | None

    def __reduce__(self) -> tuple[Any, ...]:
        # Built for the psycopg class of the SQLSTATE (_combined): not importable by name.
        kind = "transient" if isinstance(self, TransientDatabaseError) else "persistent"
        return (_rebuild, (kind, self.sqlstate, str(self)))


class TransientDatabaseError(_ServerError, psycopg.OperationalError):
    """PostgreSQL ended the statement or the session for a reason that passes (a timeout, a
    cancel, a deadlock, a restart, a resource running short): kombu and Celery reconnect and
    retry."""


class PersistentDatabaseError(_ServerError, psycopg.DatabaseError):
    """PostgreSQL refused a statement, and would refuse it again: it is not retried; the
    message names the SQLSTATE and what to do."""


def transient_reason(sqlstate: str) -> str | None:
    """What an error of SQLSTATE ``sqlstate`` means if it passes; ``None`` if it does not."""
    if sqlstate in _NOT_TRANSIENT:
        return None
    return TRANSIENT_SQLSTATES.get(sqlstate) or TRANSIENT_CLASSES.get(sqlstate[:2])


def transient(
    exc: BaseException, *, url_for_messages: str | None = None
) -> TransientDatabaseError | None:
    """``exc``, a psycopg error, as the :class:`TransientDatabaseError` it is if it passes (by
    SQLSTATE, or a connection that went away); ``None`` otherwise."""
    if isinstance(exc, PgSkipError) or not isinstance(exc, psycopg.Error):
        return None
    at = f" at {url_for_messages}" if url_for_messages else ""
    sqlstate = exc.sqlstate
    if sqlstate:
        reason = transient_reason(sqlstate)
        if reason is None:
            return None
        message = f"{reason} (SQLSTATE {sqlstate}){at}: {_detail(exc)}; {_RETRY}"
    elif isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc, pg_errors.PipelineAborted
    ):
        # libpq's own failures carry no SQLSTATE: the connection is gone or unusable.
        message = f"the connection to PostgreSQL was lost{at}: {_detail(exc)}; {_RETRY}"
    else:
        return None
    return _server_error(TransientDatabaseError, exc, sqlstate, message)


def classify(exc: BaseException, *, url_for_messages: str | None = None) -> BaseException:
    """The error to raise for ``exc``, raised on one of the package's own connections.

    A psycopg error becomes the error that says what to do (:func:`translate`), else a
    :class:`TransientDatabaseError` if it passes (:func:`transient`), else, if the server
    refused the statement (it has a SQLSTATE), a :class:`PersistentDatabaseError`; the
    original is the ``__cause__``. Anything else is returned unchanged. Not for errors raised
    in a caller's transaction: those are the caller's to handle, classes unchanged.
    """
    if isinstance(exc, PgSkipError) or not isinstance(exc, psycopg.Error):
        return exc
    out = translate(exc, url_for_messages=url_for_messages)
    if out is exc:
        out = transient(exc, url_for_messages=url_for_messages) or _persistent(
            exc, url_for_messages
        )
    if out is not exc and out.__cause__ is None:
        out.__cause__ = exc
        out.__suppress_context__ = True
    return out


def _persistent(exc: psycopg.Error, url_for_messages: str | None) -> BaseException:
    """A server error that does not pass as a :class:`PersistentDatabaseError` (``exc`` itself
    if it has no SQLSTATE)."""
    sqlstate = exc.sqlstate
    if not sqlstate or not isinstance(exc, psycopg.DatabaseError):
        return exc
    hint = (
        _PERSISTENT_HINTS.get(sqlstate)
        or _PERSISTENT_HINTS.get(sqlstate[:2])
        or _PERSISTENT_DEFAULT
    )
    at = f" at {url_for_messages}" if url_for_messages else ""
    message = (
        f"PostgreSQL refused a statement (SQLSTATE {sqlstate}: {hint}){at}: {_detail(exc)}; "
        f"{_NO_RETRY}"
    )
    return _server_error(PersistentDatabaseError, exc, sqlstate, message)


def _detail(exc: BaseException) -> str:
    """The server's message (its primary text), or the first line of libpq's."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    text = primary or (str(exc).strip().splitlines() or [""])[0]
    return text.strip() or type(exc).__name__


_Kind = TypeVar("_Kind", bound=_ServerError)


def _server_error(
    kind: type[_Kind], exc: psycopg.Error, sqlstate: str | None, message: str
) -> _Kind:
    """An error of ``kind`` standing for ``exc``: of its psycopg class as well where ``kind``
    allows (a :class:`PersistentDatabaseError` is never an ``OperationalError``, which kombu
    would retry), with its SQLSTATE and its diagnostics."""
    error = cast(_Kind, _combined(kind, type(exc))(message))
    error.sqlstate = sqlstate
    for attr in ("_info", "_encoding"):  # psycopg's Error.diag reads them
        if hasattr(exc, attr):
            setattr(error, attr, getattr(exc, attr))
    error.__cause__ = exc
    error.__suppress_context__ = True
    return error


#: The classes :func:`_combined` built, by (kind, psycopg class).
_COMBINED: dict[tuple[type[_ServerError], type[psycopg.Error]], type[_ServerError]] = {}


def _combined(kind: type[_ServerError], base: type[psycopg.Error]) -> type[_ServerError]:
    """``kind`` and psycopg's ``base`` in one class (``kind`` itself if it is one already, or if
    ``base`` is an ``OperationalError`` that a :class:`PersistentDatabaseError` must not be)."""
    known = _COMBINED.get((kind, base))
    if known is not None:
        return known
    if (
        issubclass(kind, base)
        or base.__module__ not in ("psycopg", "psycopg.errors")
        or (kind is PersistentDatabaseError and issubclass(base, psycopg.OperationalError))
    ):
        combined = kind
    else:
        namespace = {"__module__": __name__, "__qualname__": kind.__qualname__}
        combined = cast(type[_ServerError], type(kind.__name__, (kind, base), namespace))
        combined.__doc__ = kind.__doc__
    return _COMBINED.setdefault((kind, base), combined)


def psycopg_class(sqlstate: str) -> type[psycopg.Error]:
    """psycopg's exception class for ``sqlstate``: its own, else its class's (a SQLSTATE newer
    than this psycopg), else ``DatabaseError``."""
    for code in (sqlstate, sqlstate[:2] + "000"):
        try:
            return pg_errors.lookup(code)
        except KeyError:
            continue
    return psycopg.DatabaseError


def _rebuild(kind: str, sqlstate: str | None, message: str) -> _ServerError:
    """Unpickle a :class:`TransientDatabaseError` or :class:`PersistentDatabaseError`."""
    cls = TransientDatabaseError if kind == "transient" else PersistentDatabaseError
    base = psycopg_class(sqlstate) if sqlstate else psycopg.OperationalError
    error = _combined(cls, base)(message)
    error.sqlstate = sqlstate
    return error


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


class DeliveryLost(PgSkipError):
    """The message this task runs from is no longer this worker's delivery: its lease ran out
    and another worker took the message, or it was settled. kombu_pgskip.completing() rolls its
    transaction back, so that the work is done once, by the other delivery."""


class DuplicateTask(PgSkipError):
    """Nothing was published: another message of the queue holds the same unique key
    (pgskip_unique), pending, scheduled or running. Catch it where a duplicate is expected:
    the task the key stands for is already on its way."""

    def __init__(self, message: str, *, queue: str, key: str) -> None:
        super().__init__(message)
        #: The queue the message was published to.
        self.queue = queue
        #: The unique key another message of that queue holds.
        self.key = key


class _Reraising:
    """Re-raise a psycopg error leaving the block as :meth:`_map` maps it (our own errors
    pass unchanged). A class rather than a ``@contextmanager`` generator: it wraps every
    publish, where the generator's set-up costs several microseconds."""

    __slots__ = ("url_for_messages",)

    def __init__(self, *, url_for_messages: str | None = None) -> None:
        self.url_for_messages = url_for_messages

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, psycopg.Error) and not isinstance(exc, PgSkipError):
            mapped = self._map(exc)
            if mapped is not exc:
                raise mapped from exc

    def _map(self, exc: psycopg.Error) -> BaseException:
        raise NotImplementedError


class translating(_Reraising):  # used as a function: ``with translating(...):``
    """Re-raise the psycopg errors that have a clearer meaning as :func:`translate` maps them,
    and those that pass as :class:`TransientDatabaseError` (:func:`transient`), which keeps
    psycopg's class: on either executor, a caller's ``except`` clauses still match."""

    __slots__ = ()

    def _map(self, exc: psycopg.Error) -> BaseException:
        translated = translate(exc, url_for_messages=self.url_for_messages)
        if translated is exc:
            translated = transient(exc, url_for_messages=self.url_for_messages) or exc
        return translated


class classifying(_Reraising):  # used as a function: ``with classifying(...):``
    """Re-raise psycopg errors as :func:`classify` maps them: around the statements of the
    package's own connections. Stateless, so one instance serves every statement of a
    connection."""

    __slots__ = ()

    def _map(self, exc: psycopg.Error) -> BaseException:
        return classify(exc, url_for_messages=self.url_for_messages)
