"""Broker URLs: ``pgskip://`` to libpq conninfo, password masking, and connecting with clear errors.

Accepted forms (libpq options go in the query string, several hosts are comma-separated)::

    pgskip://user:password@host:5432/dbname?sslmode=require
    pgskip+postgresql://user:password@host1:5432,host2:5432/dbname?target_session_attrs=read-write
    postgresql://user:password@host/dbname          (deploy scripts, ``--url``)
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg.rows import TupleRow

from . import exceptions

_SCHEMES = (
    "pgskip+postgresql://",
    "pgskip+postgres://",
    "pgskip://",
    "postgresql://",
    "postgres://",
)
_PASSWORD_IN_NETLOC = re.compile(r"(://[^/@:?#]*:)([^@/?#]*)(@)")
_PASSWORD_IN_QUERY = re.compile(r"([?&]password=)([^&]*)", re.IGNORECASE)

Connection = psycopg.Connection[TupleRow]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``: safe to log and to put in errors."""
    masked = _PASSWORD_IN_NETLOC.sub(r"\1***\3", url)
    return _PASSWORD_IN_QUERY.sub(r"\1***", masked)


def to_conninfo(url: str) -> str:
    """Translate a broker URL to a libpq connection URL, or raise :class:`InvalidURL`."""
    if not isinstance(url, str) or not url:
        raise exceptions.InvalidURL(
            f"empty broker URL: expected pgskip://user:password@host:5432/dbname, got {url!r}"
        )
    for scheme in _SCHEMES:
        if url.startswith(scheme):
            libpq = "postgresql://" + url[len(scheme) :]
            break
    else:
        raise exceptions.InvalidURL(
            f"not a PostgreSQL broker URL: {mask_url(url)!r}; "
            "expected pgskip://user:password@host:5432/dbname"
        )
    try:
        params = pg_conninfo.conninfo_to_dict(libpq)
    except psycopg.ProgrammingError as exc:
        raise exceptions.InvalidURL(
            f"malformed broker URL {mask_url(url)!r}: {exc}; "
            "expected pgskip://user:password@host:5432/dbname?libpq_option=value"
        ) from None
    port = params.get("port")
    if port is not None:
        for p in str(port).split(","):
            if p and (not p.isdigit() or not 0 < int(p) < 65536):
                raise exceptions.InvalidURL(
                    f"malformed broker URL {mask_url(url)!r}: invalid port {p!r}"
                )
    return libpq


def with_dbname(url: str, dbname: str) -> str:
    """``url`` pointing at another database on the same server (tests, templates)."""
    params = pg_conninfo.conninfo_to_dict(to_conninfo(url))
    params["dbname"] = dbname
    return pg_conninfo.make_conninfo("", **params)


def connect(url: str, *, autocommit: bool = True, **kwargs: Any) -> Connection:
    """Open a psycopg connection for ``url``; connection failures name the (masked) URL.

    Failures raise :class:`ConnectionFailed`, a subclass of ``psycopg.OperationalError``, so
    kombu and Celery treat them as recoverable and retry with backoff while logging the reason.
    """
    conninfo = to_conninfo(url)
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", "kombu-pgskip")
    try:
        return psycopg.connect(conninfo, autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as exc:
        raise exceptions.ConnectionFailed(
            f"cannot connect to PostgreSQL at {mask_url(url)}: {exc}"
        ) from None


def build_url(
    *,
    hostname: str | None,
    port: int | None = None,
    userid: str | None = None,
    password: str | None = None,
    virtual_host: str | None = None,
) -> str:
    """A ``postgresql://`` URL from kombu's split connection parameters."""
    auth = ""
    if userid:
        auth = quote(userid, safe="")
        if password:
            auth += ":" + quote(password, safe="")
        auth += "@"
    host = hostname or "localhost"
    if port:
        host += f":{port}"
    db = "" if not virtual_host or virtual_host == "/" else "/" + quote(virtual_host, safe="")
    return f"postgresql://{auth}{host}{db}"
