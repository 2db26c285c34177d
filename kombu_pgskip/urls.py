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
_SCHEME_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:/{0,2}")
# key=value conninfo (password=secret, password='a b') and URL query (?password=secret)
_PASSWORD_PARAM = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]*)", re.IGNORECASE)
_SECRET_PIECES = re.compile(r"[@:/?#]")

Connection = psycopg.Connection[TupleRow]


def _split_secret(url: str) -> tuple[str, str, str] | None:
    """(prefix up to the password, the password, the rest from the last ``@``), if any.

    The password is taken to run from the first ``:`` of the user info to the *last* ``@``:
    a password with an unencoded ``@`` (a common mistake) is then still masked whole.
    """
    match = _SCHEME_PREFIX.match(url)
    prefix = match.group(0) if match else ""
    rest = url[len(prefix) :]
    at = rest.rfind("@")
    if at < 0:
        return None
    user, sep, secret = rest[:at].partition(":")
    if not sep:
        return None
    return f"{prefix}{user}:", secret, rest[at:]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``: safe to log and to put in errors."""
    parts = _split_secret(url)
    masked = url if parts is None else f"{parts[0]}***{parts[2]}"
    return _PASSWORD_PARAM.sub(r"\1***", masked)


def scrub(text: str, url: str) -> str:
    """``text`` (a driver's error message about ``url``) without ``url``'s password in it.

    libpq echoes malformed URIs, and parts of one, in its messages.
    """
    text = text.replace(url, mask_url(url))
    parts = _split_secret(url)
    if parts is not None and parts[1]:
        secret = parts[1]
        for piece in sorted({secret, *_SECRET_PIECES.split(secret)}, key=len, reverse=True):
            if len(piece) >= 4 or piece == secret:
                text = text.replace(piece, "***")
    return _PASSWORD_PARAM.sub(r"\1***", text)


_ENCODE_HINT = (
    "percent-encode reserved characters in the user and password (@ as %40, : as %3A, "
    "/ as %2F, ? as %3F, # as %23, % as %25)"
)


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
        detail = scrub(scrub(" ".join(str(exc).split()), libpq), url)
        raise exceptions.InvalidURL(
            f"malformed broker URL {mask_url(url)!r}: {detail}; "
            f"expected pgskip://user:password@host:5432/dbname?libpq_option=value; {_ENCODE_HINT}"
        ) from None
    port = params.get("port")
    if port is not None:
        for p in str(port).split(","):
            if p and (not p.isdigit() or not 0 < int(p) < 65536):
                # Not the port itself: with an unencoded "@" in the password, it holds part of it.
                raise exceptions.InvalidURL(
                    f"malformed broker URL {mask_url(url)!r}: invalid port (a number from 1 "
                    f"to 65535); {_ENCODE_HINT}"
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
        detail = scrub(scrub(str(exc).strip(), conninfo), url)
        raise exceptions.ConnectionFailed(
            f"cannot connect to PostgreSQL at {mask_url(url)}: {detail} "
            f"({exceptions.connect_hint(exc)})"
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
