"""Broker URLs: ``pgskip://`` to libpq conninfo, password masking, and connecting with clear errors.

Accepted forms (libpq options go in the query string, several hosts are comma-separated)::

    pgskip://user:password@host:5432/dbname?sslmode=require
    pgskip+postgresql://user:password@host1:5432,host2:5432/dbname?target_session_attrs=read-write
    postgresql://user:password@host/dbname          (deploy scripts, ``--url``)
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote, unquote

import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg import pq
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

#: libpq connection parameters whose values are secrets, masked wherever a URL or conninfo is
#: shown together with those the loaded libpq marks as passwords (:func:`_libpq_secrets`).
_KNOWN_SECRETS = frozenset(
    {
        "password",
        "sslpassword",  # the passphrase of the client key (sslkey)
        "oauth_client_secret",  # PostgreSQL 18
        # PostgreSQL 18's keys for pass-through SCRAM authentication: libpq lists them as debug
        # options (display character "D"), not as passwords, but either one logs in as the user.
        "scram_client_key",
        "scram_server_key",
    }
)


def _libpq_secrets() -> frozenset[str]:
    """The parameters the loaded libpq displays as passwords (display character ``*``).

    :data:`_KNOWN_SECRETS` covers those of libpq versions newer than the loaded one: a URL may
    name one, and the error that says it is unknown shows the URL.
    """
    try:
        options = pq.Conninfo.get_defaults()
    except (MemoryError, psycopg.Error):
        # libpq gives no defaults when it cannot work them out (PGSERVICE naming a service that
        # pg_service.conf lacks); the known names are masked all the same.
        return frozenset()
    return frozenset(o.keyword.decode() for o in options if o.dispchar == b"*")


#: Every libpq connection parameter whose value :func:`mask_url` and :func:`scrub` hide.
SECRET_PARAMETERS = _KNOWN_SECRETS | _libpq_secrets()

# A key=value pair: of a conninfo string (password=secret, sslpassword='a b') or of a URL query
# (?password=secret), where libpq percent-decodes the key too (pass%77ord is password).
_PARAM = re.compile(r"(?<![\w%])((?:\w|%[0-9A-Fa-f]{2})+)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]*)")
# Where libpq may cut a secret when it echoes part of a malformed URL or conninfo.
_SECRET_PIECES = re.compile(r"[@:/?#=&\s'\\]")

Connection = psycopg.Connection[TupleRow]


def _split_secret(url: str) -> tuple[str, str, str] | None:
    """(prefix up to the password, the password, the rest from the last ``@``), if any.

    The password is taken to run from the first ``:`` of the user info to the *last* ``@``:
    a password with an unencoded ``@`` (a common mistake) is then still masked whole. An ``@``
    in a query value (``?application_name=me@host``) is taken for the end of the password too:
    more is masked than needed, never less.
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


def _is_secret(key: str) -> bool:
    # Case-insensitive: libpq refuses Password=..., and the error that says so shows the URL.
    return unquote(key).lower() in SECRET_PARAMETERS


def _mask_param(match: re.Match[str]) -> str:
    key, equals, _ = match.groups()
    return f"{key}{equals}***" if _is_secret(key) else match.group(0)


def _mask_params(text: str) -> str:
    """``text`` with the value of every secret key=value pair (:data:`SECRET_PARAMETERS`)
    replaced by ``***``."""
    return _PARAM.sub(_mask_param, text)


def mask_url(url: str) -> str:
    """The URL (or conninfo string) with its secrets replaced by ``***``: the password of the
    user info and the value of every parameter in :data:`SECRET_PARAMETERS` (``password=``,
    ``sslpassword=``, ...). Safe to log and to put in errors."""
    parts = _split_secret(url)
    masked = url if parts is None else f"{parts[0]}***{parts[2]}"
    return _mask_params(masked)


def _secrets(url: str) -> set[str]:
    """The secrets ``url`` holds, as written and as libpq decodes them."""
    found = []
    parts = _split_secret(url)
    if parts is not None:
        found.append(parts[1])
    for match in _PARAM.finditer(url):
        key, _, value = match.groups()
        if _is_secret(key):
            if len(value) >= 2 and value[0] == value[-1] == "'":
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            found.append(value)
    return {form for secret in found if secret for form in (secret, unquote(secret))}


def scrub(text: str, url: str) -> str:
    """``text`` (a driver's error message about ``url``) without ``url``'s secrets in it.

    libpq echoes malformed URIs, and parts of one, in its messages: each secret is replaced
    whole, and so is each piece of it of 4 characters or more between the characters libpq
    splits a URL or conninfo at.
    """
    text = text.replace(url, mask_url(url))
    pieces = set()
    for secret in _secrets(url):
        pieces.add(secret)
        pieces.update(p for p in _SECRET_PIECES.split(secret) if len(p) >= 4)
    for piece in sorted(pieces, key=len, reverse=True):
        text = text.replace(piece, "***")
    return _mask_params(text)


_ENCODE_HINT = (
    "percent-encode reserved characters in the user and password (@ as %40, : as %3A, "
    "/ as %2F, ? as %3F, # as %23, % as %25)"
)


def _user_info_problem(rest: str) -> str | None:
    """Why the user info of ``rest`` (a URL after its ``//``) cannot be read one way only.

    libpq ends the user info at the first ``@`` (unless a ``/`` comes first: then there is
    none) and the user name at its first ``:``. So an unencoded ``@`` in the password gives
    libpq a host, port or query string made of the rest of the password, while the URL as
    written is a valid one to its author (and to :func:`mask_url`, which masks up to the last
    ``@``). Refused:

    * an ``@`` after the first one and before any ``?`` (in the host list or the path): part
      of the user name or password;
    * an ``@`` in the query string when no path comes before it (``...@host?k=v@x``), or in a
      query parameter's name: ``u:p@h?k=v@x`` is as likely the password ``p@h?k=v``. An ``@``
      in the value of a query parameter after the path (``/db?application_name=me@host``)
      is accepted;
    * a ``:`` in the password: libpq would read the password as everything after the first
      ``:``, but a user name cannot hold one unencoded either, so which of them is the
      separator cannot be told.

    The text names the character, never the user info.
    """
    at = rest.find("@")
    slash = rest.find("/")
    if at < 0 or 0 <= slash < at:
        return None
    head, _, query = rest[at + 1 :].partition("?")
    if "@" in head:
        return (
            'unencoded "@" in the user name or password (libpq ends them at the first "@" '
            "and would read the rest as the host)"
        )
    if "@" in query and (
        "/" not in head or any("@" in p.partition("=")[0] for p in query.split("&"))
    ):
        return (
            'unencoded "@" after "?" that may be part of the password (in a query value, '
            "write it as %40, or name the database before the query: /dbname?...)"
        )
    if ":" in rest[:at].partition(":")[2]:
        return (
            'unencoded ":" in the user name or password (only the ":" between them may be '
            "left unencoded)"
        )
    return None


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
    problem = _user_info_problem(libpq[len("postgresql://") :])
    if problem is not None:
        # Before libpq parses it: its errors would show the part of the password it misread.
        raise exceptions.InvalidURL(
            f"malformed broker URL {mask_url(url)!r}: {problem}; {_ENCODE_HINT}"
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
                # Not the port itself: with an unencoded "/" in the password, libpq reads no
                # user info and takes the start of the password for the port.
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


#: The search path of every session kombu-pgskip opens (see :func:`connect`).
SAFE_SEARCH_PATH = "pg_catalog, pg_temp"


def connect(
    url: str, *, autocommit: bool = True, pin_search_path: bool = True, **kwargs: Any
) -> Connection:
    """Open a psycopg connection for ``url``; connection failures name the (masked) URL.

    Failures raise :class:`ConnectionFailed`, a subclass of ``psycopg.OperationalError``, so
    kombu and Celery treat them as recoverable and retry with backoff while logging the reason.

    ``pin_search_path``: the session's ``search_path`` becomes :data:`SAFE_SEARCH_PATH`
    before anything else runs on it. Every statement of ours names its tables with their
    schema, but functions and operators (``now()``, ``unnest``, ``=`` on a status) are found
    through the search path, and a role that can create objects in a schema on it (``public``,
    for the app role that runs Django migrations) could otherwise define a closer match that
    runs with this session's privileges (CVE-2018-1058). Off only where a session is not ours
    alone: PgBouncer in transaction pooling hands the server session on to other clients
    (docs/security.md). With it, ``jit`` is turned off: none of our statements runs long
    enough to pay for compiling its expressions, and a generic plan over ``jobs``' partitions
    can be estimated past ``jit_above_cost`` and compile at every execution (migration 0029).
    And so are sequential scans, unless nothing else can read a table: every statement of ours
    reaches the rows it reads through an index, and a generic plan made while a slot of the
    ring was empty (rotate() empties one with a TRUNCATE, after which the planner takes it for
    a table of 10 pages) would otherwise read the whole slot on each execution once it has
    filled, until something invalidates the plan (docs/performance.md, "A worker draining a
    backlog").
    """
    conninfo = to_conninfo(url)
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", "kombu-pgskip")
    try:
        conn = psycopg.connect(conninfo, autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as exc:
        detail = scrub(scrub(str(exc).strip(), conninfo), url)
        raise exceptions.ConnectionFailed(
            f"cannot connect to PostgreSQL at {mask_url(url)}: {detail} "
            f"({exceptions.connect_hint(exc)})"
        ) from None
    if pin_search_path:
        try:
            conn.execute(
                f"SET search_path TO {SAFE_SEARCH_PATH}; SET jit TO off; SET enable_seqscan TO off"
            )
            if not autocommit:
                conn.commit()  # a SET in a transaction that rolls back would be undone
        except BaseException:
            conn.close()
            raise
    return conn


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
