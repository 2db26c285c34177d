"""An idle worker's fetch reads the slot of ``jobs`` new messages go to first, and every slot
when nothing is there (``fetcher.py``): a message anywhere in the ring is still taken by the
same fetch. Its acks can go alone, without a fetch."""

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


def _publish(store: Store, i: int) -> None:
    store.publish(NewMessage("slots", 0, "pending", None, f'{{"i": {i}}}', None, None, None))


def _fetch(
    fetcher: AsyncFetcher, tags: list[tuple[int, int]], me: uuid.UUID
) -> tuple[int, list[FetchedRow]]:
    fetcher.send(tags, ["slots"], 4, me)
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


def _current_slot(db_url: str) -> int:
    """The slot new messages go to."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT pgskip.current_slot()").fetchone()
        assert row is not None
        return int(row[0])


def _idle(fetcher: AsyncFetcher, store: Store, me: uuid.UUID) -> None:
    """A message taken and acked, then a fetch that finds nothing (two runs of the statement
    on every slot): the fetcher is idle."""
    _publish(store, 0)
    _, rows = _fetch(fetcher, [], me)
    assert len(rows) == 1
    acked, rows2 = _fetch(fetcher, [r.tag for r in rows], me)
    assert (acked, rows2) == (1, [])


def test_an_idle_fetch_reads_the_slot_new_messages_go_to_alone(store: Store, db_url: str) -> None:
    """The fetch after one that left nothing behind (here an empty one), with no acks to write,
    runs the statement on one slot: its
    plan reads that partition of jobs and no other, and it takes the new message in one round
    trip. The fetch after it, which carries the ack, reads every slot again."""
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    me = uuid.uuid4()
    try:
        _idle(fetcher, store, me)
        slot = _current_slot(db_url)
        _publish(store, 1)
        _, rows = _fetch(fetcher, [], me)
        assert [r.payload for r in rows] == [{"i": 1}]
        one_slot = f"pgskip_ack_fetch_slot_{slot}"
        assert _executions(fetcher) == {"pgskip_ack_fetch": 2, one_slot: 1}

        acked, more = _fetch(fetcher, [r.tag for r in rows], me)
        assert (acked, more) == (1, [])
        assert _executions(fetcher) == {"pgskip_ack_fetch": 3, one_slot: 1}
        assert fetcher._conn is not None
        params = [p.decode() for p in fetcher.params([], ["slots"], 4, me)]
        cur = psycopg.ClientCursor(fetcher._conn)
        cur.execute(f"EXPLAIN EXECUTE {one_slot}({', '.join(['%s'] * len(params))})", params)
        plan = "\n".join(row[0] for row in cur.fetchall())
        assert set(re.findall(r"\bon (jobs_\w+)", plan)) == {f"jobs_{slot}"}, plan
    finally:
        fetcher.close()


@pytest.fixture(
    params=[(True, True, False), (False, True, False), (True, False, False), (True, True, True)],
    ids=["prepared", "statement-text", "acks-delete", "worker-role"],
)
def each_fetcher(
    request: pytest.FixtureRequest, db_url: str, pg_server_dsn: str
) -> Iterator[AsyncFetcher]:
    """A fetcher with prepared statements or statement text (PgBouncer), acks that mark
    completed or delete, and as the role `pgskip grant --worker` makes: the statements on one
    slot and the acks alone need no privilege the fetch does not."""
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


def test_a_message_in_another_slot_is_taken_by_the_same_fetch(
    store: Store, db_url: str, each_fetcher: AsyncFetcher
) -> None:
    """The ring moved on while the worker was idle: the slot it looks in first holds nothing
    due, so the statement on every slot follows at once and takes the message; the next idle
    fetch looks in the new slot. A message due in an older slot (returned to its queue, a
    countdown) is taken the same way."""
    _ring_moved_on(each_fetcher, store, db_url, prepared=each_fetcher._prepared)


def _ring_moved_on(fetcher: AsyncFetcher, store: Store, db_url: str, *, prepared: bool) -> None:
    me = uuid.uuid4()
    name = fetcher._statement.decode()
    _idle(fetcher, store, me)
    old = _current_slot(db_url)
    new = old % 8 + 1
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs_rotation SET slot = %s", (new,))
    _publish(store, 1)
    _, rows = _fetch(fetcher, [], me)
    assert [r.payload for r in rows] == [{"i": 1}]
    if prepared:
        assert _executions(fetcher) == {name: 3, f"{name}_slot_{old}": 1}
    assert _fetch(fetcher, [r.tag for r in rows], me) == (1, [])

    _publish(store, 2)
    _, rows = _fetch(fetcher, [], me)
    assert [r.payload for r in rows] == [{"i": 2}]
    if prepared:
        assert _executions(fetcher) == {
            name: 4,
            f"{name}_slot_{old}": 1,
            f"{name}_slot_{new}": 1,
        }
    assert _fetch(fetcher, [r.tag for r in rows], me) == (1, [])

    # Due in the slot the ring left: the fetch on the new slot finds nothing, then takes it.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, payload, slot) VALUES ('slots', '{\"i\": 3}', %s)",
            (old,),
        )
    _, rows = _fetch(fetcher, [], me)
    assert [r.payload for r in rows] == [{"i": 3}]
    if prepared:
        assert _executions(fetcher)[f"{name}_slot_{new}"] == 2
    assert _fetch(fetcher, [r.tag for r in rows], me) == (1, [])
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT count(*) FROM pgskip.jobs WHERE status <> 'completed'")
        assert left.fetchone() == (0,)  # every message taken once and acked


def test_a_fetcher_that_lost_the_race_reads_every_slot_until_it_takes_a_message(
    store: Store, db_url: str
) -> None:
    """Several idle workers on a queue are all woken by a publish and one takes the message.
    One that looked in the slot and found it taken reads every slot from then on (one
    statement a notification, as without the look) until it takes a message again."""
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    me, other = uuid.uuid4(), uuid.uuid4()
    try:
        _idle(fetcher, store, me)
        slot = f"pgskip_ack_fetch_slot_{_current_slot(db_url)}"
        _publish(store, 1)
        assert len(store.fetch(["slots"], 4, other)) == 1  # another worker was quicker
        assert _fetch(fetcher, [], me) == (0, [])
        assert _executions(fetcher) == {"pgskip_ack_fetch": 3, slot: 1}
        _publish(store, 2)
        assert len(store.fetch(["slots"], 4, other)) == 1
        assert _fetch(fetcher, [], me) == (0, [])
        assert _executions(fetcher) == {"pgskip_ack_fetch": 4, slot: 1}

        _publish(store, 3)  # this one it takes, reading every slot
        _, rows = _fetch(fetcher, [], me)
        assert [r.payload for r in rows] == [{"i": 3}]
        assert _executions(fetcher) == {"pgskip_ack_fetch": 5, slot: 1}
        assert _fetch(fetcher, [r.tag for r in rows], me) == (1, [])
        _publish(store, 4)  # and the next one, idle again, in the slot
        _, rows = _fetch(fetcher, [], me)
        assert [r.payload for r in rows] == [{"i": 4}]
        assert _executions(fetcher) == {"pgskip_ack_fetch": 6, slot: 2}
    finally:
        fetcher.close()


def test_acks_alone_are_written_fenced_and_the_next_fetch_still_looks_in_one_slot(
    store: Store, db_url: str, each_fetcher: AsyncFetcher
) -> None:
    """``send_acks`` writes the acks with the ``ack`` statement and fetches nothing; an ack of
    a delivery no longer this consumer's changes nothing. The fetch that took the message took
    less than it asked for, so the next one, with no acks to carry, looks in one slot."""
    fetcher, me = each_fetcher, uuid.uuid4()
    keep_completed = fetcher._ack_statement == b"pgskip_ack"
    _publish(store, 0)
    _, rows = _fetch(fetcher, [], me)
    assert len(rows) == 1
    tag = rows[0].tag
    fetcher.send_acks([tag, (tag[0], tag[1] + 1)], me)  # the second: a stale delivery
    assert fetcher.wait() == (1, [], 0)
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT status::text FROM pgskip.jobs WHERE id = %s", (tag[0],))
        assert left.fetchall() == ([("completed",)] if keep_completed else [])
    fetcher.send_acks([tag], me)  # written already
    assert fetcher.wait() == (0, [], 0)

    slot = _current_slot(db_url)
    _publish(store, 1)
    _, rows = _fetch(fetcher, [], me)
    assert [r.payload for r in rows] == [{"i": 1}]
    if fetcher._prepared:
        name, ack = fetcher._statement.decode(), fetcher._ack_statement.decode()
        assert _executions(fetcher) == {name: 1, ack: 2, f"{name}_slot_{slot}": 1}


def test_a_new_connection_reads_every_slot_first(store: Store, db_url: str) -> None:
    """The statements on one slot are prepared on the connection that runs them: after the
    connection is lost, the next fetch reads every slot (and prepares again what it needs)."""
    fetcher = AsyncFetcher(db_url, schema="pgskip", asynchronous_commit=False, connect_timeout=5)
    me = uuid.uuid4()
    try:
        _idle(fetcher, store, me)
        assert fetcher._conn is not None
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (fetcher._conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            _fetch(fetcher, [], me)
        _publish(store, 1)
        _, rows = _fetch(fetcher, [], me)
        assert [r.payload for r in rows] == [{"i": 1}]
        assert _executions(fetcher) == {"pgskip_ack_fetch": 1}
    finally:
        fetcher.close()
