"""Fixtures shared by the integration tests that speak kombu's API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection

import kombu_pgskip  # noqa: F401  (registers pgskip://)


@pytest.fixture
def broker(db_url: str) -> str:
    return db_url.replace("postgresql://", "pgskip://", 1)


@pytest.fixture
def connections(broker: str) -> Iterator[Any]:
    """``connections(**transport_options)`` opens a kombu Connection of its own, as a separate
    process would have (its own transport and in-memory state); all are released at the end."""
    opened: list[Connection] = []

    def connect(**options: Any) -> Connection:
        conn = Connection(broker, transport_options=options)
        conn.connect()
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.release()
