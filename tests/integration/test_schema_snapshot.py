"""``migrations/schema.sql`` is the schema the migrations build, as pg_dump writes it: the whole
picture a new migration is reviewed against (procrastinate's way). The test fails when a
migration changes the schema and the snapshot was not regenerated."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kombu_pgskip.migrate import migrate
from kombu_pgskip.testing.embedded import find_bindir
from tests.conftest import PgServer
from tests.helpers import REPO_ROOT

SCHEMA_SQL = REPO_ROOT / "migrations" / "schema.sql"
HEADER = """\
-- The pgskip schema that migrations/NNNN_*.sql build, in order, as pg_dump --schema-only
-- writes it (without its session settings): a snapshot to review a new migration against.
-- `pgskip migrate` never runs this file. tests/integration/test_schema_snapshot.py checks it;
-- after a new migration, regenerate it and review the diff:
--   PGSKIP_WRITE_SCHEMA=1 bash scripts/test.sh tests/integration/test_schema_snapshot.py
"""
#: pg_dump lines that describe the dump, not the schema (and a random key per dump).
_NOISE = ("SET ", "SELECT pg_catalog.set_config(", "\\restrict ", "\\unrestrict ", "-- Dumped ")


def _bindir(server: PgServer) -> Path:
    return Path(server.embedded.bindir) if server.embedded is not None else find_bindir()


def schema_dump(server: PgServer, url: str) -> str:
    """The pgskip schema of ``url`` as pg_dump writes it, less what varies between dumps."""
    done = subprocess.run(
        [str(_bindir(server) / "pg_dump"), "--schema-only", "--schema=pgskip", "--no-owner", url],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if not line.startswith(_NOISE)]
    text = "\n".join(lines).replace("--\n-- PostgreSQL database dump\n--\n", "")
    text = text.replace("--\n-- PostgreSQL database dump complete\n--\n", "")
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip() + "\n"


def test_the_migrations_build_exactly_schema_sql(pg_server: PgServer, empty_db_url: str) -> None:
    migrate(empty_db_url)
    built = HEADER + "\n" + schema_dump(pg_server, empty_db_url)
    if os.environ.get("PGSKIP_WRITE_SCHEMA"):
        SCHEMA_SQL.write_text(built)
    assert SCHEMA_SQL.read_text() == built, (
        "migrations/schema.sql is not what the migrations build: regenerate it with "
        "PGSKIP_WRITE_SCHEMA=1 bash scripts/test.sh tests/integration/test_schema_snapshot.py "
        "and review the diff"
    )
