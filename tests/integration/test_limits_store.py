"""Fleet-wide limits of a queue (migration 0025): the limited fetch takes no more than a
queue's limits allow, across connections racing for it; the normal fetch leaves a limited
queue alone; `limit`, `unlimit` and `status` say what they did. Real workers:
tests/acceptance/test_limits.py."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from kombu_pgskip import exceptions
from kombu_pgskip.__main__ import main
from kombu_pgskip.envelope import to_row
from kombu_pgskip.store import Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _publish(store: Store, queue: str, n: int = 1, key: str | None = None) -> list[int]:
    ids = []
    for i in range(n):
        message = {
            "body": json.dumps({"i": i}),
            "headers": {"task": "t", "id": str(uuid.uuid4())},
            "properties": {"priority": 0, "delivery_info": {}},
        }
        ids.append(store.publish(to_row(queue, message, eta_threshold=2, max_message_size=10**6)))
    if key is not None:
        with psycopg.connect(store.executor.url, autocommit=True) as conn:  # type: ignore[attr-defined]
            conn.execute(
                "UPDATE pgskip.jobs SET concurrency_key = %s WHERE id = ANY(%s)", (key, ids)
            )
    return ids


def _consumer(store: Store, queues: list[str]) -> uuid.UUID:
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="test", queues=queues, lease=30)
    return cid


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def test_smoke(store: Store) -> None:
    _publish(store, "q", 5)
    store.set_limit("q", max_running=2)
    c = _consumer(store, ["q"])
    assert store.fetch(["q"], 10, c) == []
    got = store.fetch_limited("q", 10, c)
    assert len(got.rows) == 2, got
    assert got.free == 0 and got.more and got.limited
    again = store.fetch_limited("q", 10, c)
    assert again.rows == [] and again.more
    done = store.fetch_limited("q", 10, c, acks=[got.rows[0].tag])
    assert done.acked == 1 and len(done.rows) == 1
