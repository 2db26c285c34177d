"""Loads ``queries.sql``: every runtime statement by name, with the schema substituted."""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

_BLOCK = re.compile(r"^-- ([a-z_]+): (.*)$", re.MULTILINE)


@functools.cache
def raw_queries() -> dict[str, str]:
    """name -> SQL text with the ``{schema}`` placeholder."""
    text = resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    matches = list(_BLOCK.finditer(text))
    queries: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip().rstrip(";").strip()
        queries[match.group(1)] = body
    return queries


@functools.cache
def queries_for(schema: str) -> dict[str, sql.Composed]:
    """name -> statement with ``{schema}`` bound to the quoted identifier."""
    ident = sql.Identifier(schema)
    return {
        name: sql.SQL(body).format(schema=ident)  # type: ignore[arg-type,unused-ignore]
        for name, body in raw_queries().items()
    }


@functools.cache
def raw_queries_in(filename: str) -> dict[str, str]:
    """name -> SQL text of another file of named blocks in this package (e.g. ``periodic.sql``)."""
    text = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    matches = list(_BLOCK.finditer(text))
    queries: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        queries[match.group(1)] = text[match.end() : end].strip().rstrip(";").strip()
    return queries


@functools.cache
def queries_in(filename: str, schema: str) -> dict[str, sql.Composed]:
    """name -> statement of ``filename`` with ``{schema}`` bound to the quoted identifier."""
    ident = sql.Identifier(schema)
    return {
        name: sql.SQL(body).format(schema=ident)
        for name, body in raw_queries_in(filename).items()
    }
