"""An idle fetcher given the message a notification named takes it by its id, with a statement
on that message's slot alone (``fetcher.py``); otherwise it fetches as always. Its acks can go
alone, without a fetch."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from kombu_pgskip.fetcher import AsyncFetcher
from kombu_pgskip.store import FetchedRow, NewMessage, Store
from tests.safety_support import worker_role


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    store = Store(db_url)
    yield store
    store.close()


@pytest.fixture
def fetcher(db_url: str) -> Iterator[AsyncFetcher]:
    """A fetcher as the event loop's, with prepared statements."""
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    yield fetcher
    fetcher.close()


def _publish(store: Store, i: int, queue: str = "slots") -> tuple[int, int]:
    """Publish message ``i``: its (id, slot), as its notification names it."""
    row_id = store.publish(NewMessage(queue, 0, "pending", None, f'{{"i": {i}}}', None, None, None))
    assert row_id is not None
    row = store.conn.execute("SELECT slot FROM pgskip.jobs WHERE id = %s", (row_id,)).fetchone()
    assert row is not None
    return row_id, int(row[0])


def _fetch(
    fetcher: AsyncFetcher,
    tags: list[tuple[int, int]],
    me: uuid.UUID,
    named: tuple[int, int] | None = None,
    queues: tuple[str, ...] = ("slots",),
) -> tuple[int, list[FetchedRow]]:
    fetcher.send(tags, list(queues), 4, me, named=named)
    result = fetcher.wait()
    assert result is not None
    return result[0], result[1]


def _executions(fetcher: AsyncFetcher) -> dict[str, int]:
    """How often each statement prepared on the fetcher's connection ran."""
    assert fetcher._conn is not None
    rows = fetcher._conn.execute(
        "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
    ).fetchall()
    return {name: n for name, n in rows}


def _idle(fetcher: AsyncFetcher, store: Store, me: uuid.UUID) -> None:
    """A message taken and acked, then a fetch that finds nothing (two runs of the statement
    on every slot): the fetcher is idle."""
    _publish(store, 0)
    _, rows = _fetch(fetcher, [], me)
    assert len(rows) == 1
    acked, rows2 = _fetch(fetcher, [r.tag for r in rows], me)
    assert (acked, rows2) == (1, [])


def _statuses(db_url: str) -> list[tuple[int, str]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT id, status::text FROM pgskip.jobs ORDER BY id").fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


def test_an_idle_fetcher_takes_the_named_message_on_its_slot_alone(
    store: Store, fetcher: AsyncFetcher
) -> None:
    """The fetch after one that left nothing behind, with no acks to write and the message
    named, runs ``take_announced`` on the message's slot: its plan reads that partition of
    jobs and no other, and it takes the message in one round trip. The fetch after it, which
    carries the ack, is the statement on every slot."""
    me = uuid.uuid4()
    _idle(fetcher, store, me)
    named = _publish(store, 1)
    _, rows = _fetch(fetcher, [], me, named)
    assert [r.payload for r in rows] == [{"i": 1}]
    assert rows[0].id == named[0]
    take = f"pgskip_take_announced_slot_{named[1]}"
    assert _executions(fetcher) == {"pgskip_ack_fetch": 2, take: 1}

    acked, more = _fetch(fetcher, [r.tag for r in rows], me, _publish(store, 2))
    assert acked == 1 and [r.payload for r in more] == [{"i": 2}], "acks: every slot"
    assert _executions(fetcher) == {"pgskip_ack_fetch": 3, take: 1}
    assert fetcher._conn is not None
    params = [str(named[0]), "{slots}", str(me), "{}"]
    cur = psycopg.ClientCursor(fetcher._conn)
    cur.execute(f"EXPLAIN EXECUTE {take}(%s, %s, %s, %s)", params)
    plan = "\n".join(row[0] for row in cur.fetchall())
    assert set(re.findall(r"\bon (jobs_\w+)", plan)) == {f"jobs_{named[1]}"}, plan
    assert "Index Scan using jobs_" in plan and "_pkey" in plan, plan


@pytest.fixture(
    params=[(True, True, False), (False, True, False), (True, False, False), (True, True, True)],
    ids=["prepared", "statement-text", "acks-delete", "worker-role"],
)
def each_fetcher(
    request: pytest.FixtureRequest, db_url: str, pg_server_dsn: str
) -> Iterator[AsyncFetcher]:
    """A fetcher with prepared statements or statement text (PgBouncer), acks that mark
    completed or delete, and as the role `pgskip grant --worker` makes: the take by id and the
    acks alone need no privilege the fetch does not."""
    prepared, keep_completed, as_worker = request.param
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(worker_role(pg_server_dsn, db_url)) if as_worker else db_url
        fetcher = AsyncFetcher(
            url,
            schema="pgskip",
            asynchronous_commit=False,
            prepared=prepared,
            keep_completed=keep_completed,
            connect_timeout=5,
        )
        stack.callback(fetcher.close)
        yield fetcher


def test_a_named_message_is_taken_once_and_only_if_a_fetch_would_take_it(
    store: Store, db_url: str, each_fetcher: AsyncFetcher
) -> None:
    """Taken by id, as a fetch takes it (running under the consumer, a delivery token that
    fences its ack); once taken, by another consumer or this one, a take of the same id takes
    nothing and sends nothing more; a message of a queue the fetcher does not consume, or of a
    paused queue, is not taken."""
    fetcher, me, other = each_fetcher, uuid.uuid4(), uuid.uuid4()
    _idle(fetcher, store, me)
    first = _publish(store, 1)
    _, rows = _fetch(fetcher, [], me, first)
    assert [(r.id, r.attempts, r.redelivered) for r in rows] == [(first[0], 1, False)]
    assert fetcher.send_acks([rows[0].tag], me) is None
    assert fetcher.wait() == (1, [], 0)
    assert _fetch(fetcher, [], me, first) == (0, []), "taken already"

    taken_elsewhere = _publish(store, 2)
    assert len(store.fetch(["slots"], 4, other)) == 1  # another worker was quicker
    assert _fetch(fetcher, [], me, taken_elsewhere) == (0, [])
    assert not fetcher.in_flight, "nothing more was sent"

    elsewhere = _publish(store, 3, queue="not-mine")
    assert _fetch(fetcher, [], me, elsewhere) == (0, [])
    store.pause(["slots"])
    paused = _publish(store, 4)
    assert _fetch(fetcher, [], me, paused) == (0, [])
    store.resume(["slots"])
    _, rows = _fetch(fetcher, [], me, paused)
    assert [r.id for r in rows] == [paused[0]]
    statuses = dict(_statuses(db_url))
    assert statuses[elsewhere[0]] == "pending" and statuses[paused[0]] == "running"


def test_a_named_message_is_not_taken_alone_where_a_fetch_is_owed(
    store: Store, fetcher: AsyncFetcher
) -> None:
    """With acks to write, or on a connection whose last fetch may have left due messages
    behind (a new one, one whose fetch filled its limit), the fetch looks for every due
    message, in delivery order, whatever was named."""
    me = uuid.uuid4()
    older = _publish(store, 0)
    named = _publish(store, 1)
    _, rows = _fetch(fetcher, [], me, named)  # a new connection
    assert [r.id for r in rows] == [older[0], named[0]]
    for i in range(2, 8):
        _publish(store, i)
    _, rows = _fetch(fetcher, [r.tag for r in rows], me)  # filled its limit of 4
    assert [r.payload["i"] for r in rows] == [2, 3, 4, 5]
    named = _publish(store, 8)
    _, more = _fetch(fetcher, [], me, named)
    assert [r.payload["i"] for r in more] == [6, 7, 8]
    named = _publish(store, 9)
    acked, last = _fetch(fetcher, [r.tag for r in rows + more], me, named)  # acks to write
    assert acked == 7 and [r.payload["i"] for r in last] == [9]
    assert "pgskip_take_announced" not in " ".join(_executions(fetcher))


def test_a_new_connection_prepares_the_take_again(
    store: Store, db_url: str, fetcher: AsyncFetcher
) -> None:
    """The statements on one slot are prepared on the connection that runs them: after the
    connection is lost, the next fetch reads every slot, and the next take prepares its
    statement again."""
    me = uuid.uuid4()
    _idle(fetcher, store, me)
    named = _publish(store, 1)
    _, rows = _fetch(fetcher, [], me, named)
    assert [r.id for r in rows] == [named[0]]
    assert fetcher._conn is not None
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (fetcher._conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        _fetch(fetcher, [r.tag for r in rows], me)
    _, rows = _fetch(fetcher, [r.tag for r in rows], me, _publish(store, 2))
    assert [r.payload for r in rows] == [{"i": 2}]
    assert _executions(fetcher) == {"pgskip_ack_fetch": 1}
    _fetch(fetcher, [r.tag for r in rows], me)
    named = _publish(store, 3)
    _, rows = _fetch(fetcher, [], me, named)
    assert [r.id for r in rows] == [named[0]]
    assert _executions(fetcher) == {
        "pgskip_ack_fetch": 2,
        f"pgskip_take_announced_slot_{named[1]}": 1,
    }
