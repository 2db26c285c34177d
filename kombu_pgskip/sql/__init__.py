"""Loads the named SQL files of this package: every runtime statement by name.

A file is a series of blocks, each headed ``-- name: one-line description``. ``{schema}`` in a
block stands for the quoted schema identifier; ``{@other}`` includes the text of block
``other`` (a fragment several statements share, e.g. the due-message pick).

The runtime statements are split by concern (:data:`RUNTIME_FILES`: publishing, consuming,
queues and routing, maintenance) and loaded as one namespace: a name is unique across those
files, and a block may include a fragment of any of them. The owner's commands and the
checks have files of their own (``health.sql``, ``doctor.sql``, ``admin.sql``,
``periodic.sql``), each its own namespace.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

from ..exceptions import ConfigurationError

_BLOCK = re.compile(r"^-- ([a-z_]+): (.*)$", re.MULTILINE)
_INCLUDE = re.compile(r"\{@([a-z_]+)\}")


#: The runtime statements' files, by concern.
RUNTIME_FILES = ("publish.sql", "consume.sql", "queues.sql", "maintenance.sql")


def _blocks(filename: str) -> dict[str, str]:
    """name -> SQL text as written (includes not expanded) of a file of named blocks."""
    text = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    matches = list(_BLOCK.finditer(text))
    blocks: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        blocks[match.group(1)] = text[match.end() : end].strip().rstrip(";").strip()
    return blocks


def _expanded(blocks: dict[str, str], where: str) -> dict[str, str]:
    def expand(name: str, seen: tuple[str, ...] = ()) -> str:
        if name in seen:
            raise ValueError(f"{where}: block {name!r} includes itself")
        if name not in blocks:
            raise ValueError(f"{where}: no block named {name!r} to include")
        return _INCLUDE.sub(lambda m: expand(m.group(1), (*seen, name)), blocks[name])

    return {name: expand(name) for name in blocks}


@functools.cache
def raw_queries_in(filename: str) -> dict[str, str]:
    """name -> SQL text (includes expanded, ``{schema}`` left in) of a file of named blocks."""
    return _expanded(_blocks(filename), filename)


@functools.cache
def raw_queries() -> dict[str, str]:
    """name -> SQL text of every runtime statement (:data:`RUNTIME_FILES`), ``{schema}`` left
    in."""
    blocks: dict[str, str] = {}
    for filename in RUNTIME_FILES:
        for name, body in _blocks(filename).items():
            if name in blocks:
                raise ValueError(f"{filename}: block {name!r} is defined in another file too")
            blocks[name] = body
    return _expanded(blocks, "runtime SQL")


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier, as PostgreSQL's ``quote_ident`` always-quoted form
    (and libpq's ``PQescapeIdentifier``) writes it: in double quotes, inner ones doubled. For
    the schema in statements rendered once, and for drivers other than psycopg 3 (which has
    :class:`psycopg.sql.Identifier`)."""
    if not name or "\x00" in name:
        raise ConfigurationError(f"invalid identifier {name!r}: empty, or with a NUL character")
    return '"' + name.replace('"', '""') + '"'


def _bound(raw: dict[str, str], schema: str) -> dict[str, sql.SQL]:
    """``raw``'s statements with ``{schema}`` bound to the quoted identifier. Rendered once
    here: a composed statement would be rendered again by psycopg on every execution, which
    costs several microseconds on the publish path."""
    ident = quote_ident(schema)
    return {name: sql.SQL(body.replace("{schema}", ident)) for name, body in raw.items()}


@functools.cache
def queries_in(filename: str, schema: str) -> dict[str, sql.SQL]:
    """name -> statement of ``filename`` with ``{schema}`` bound to the quoted identifier."""
    return _bound(raw_queries_in(filename), schema)


@functools.cache
def queries_for(schema: str) -> dict[str, sql.SQL]:
    """name -> every runtime statement with ``{schema}`` bound to the quoted identifier."""
    return _bound(raw_queries(), schema)
