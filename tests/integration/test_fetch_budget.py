"""One fetch takes messages while the payloads taken before each total less than
``fetch_max_bytes``: a worker's result set stays bounded whatever the messages' sizes, a message
larger than the budget still comes (alone), and the rest follow at once while prefetch credit
remains."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from kombu_pgskip.store import NewMessage, Store, fetch_filled, scan_params
from tests.helpers import seq_scanned_rows

MIB = 1024 * 1024
#: Raw body bytes whose base64 (the transport's body encoding) is 3 MiB.
BODY_3_MIB = 3 * MIB * 3 // 4


def _body(size: int, compressible: bool) -> bytes:
    # Random bytes are stored uncompressed (their base64 does not compress by a quarter);
    # repeated ones compress about a hundredfold, so only measuring the raw length (not the
    # stored one) keeps the budget.
    return b"a" * size if compressible else os.urandom(size)


def _statuses(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
    return {status: count for status, count in rows}


def _payload_sizes(db_url: str) -> list[tuple[int, str | None]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT octet_length(payload::text), pg_column_compression(payload)"
            " FROM pgskip.jobs ORDER BY id"
        ).fetchall()
    return [(int(r[0]), r[1]) for r in rows]


def _publish(conn: Connection, queue: Queue, bodies: list[bytes]) -> None:
    producer = Producer(conn.channel())
    for n, body in enumerate(bodies):
        producer.publish(
            body,
            exchange=queue.exchange,
            routing_key=queue.routing_key,
            headers={"n": n},
            declare=[queue],
        )


@pytest.fixture
def consumer_options() -> dict[str, Any]:
    # No poll within any test's time: a message left behind is fetched because the transport
    # knows the budget stopped the fetch, or not at all.
    return {"fetch_max_bytes": 8 * MIB, "polling_interval": 60.0}


@pytest.mark.parametrize("async_fetch", [True, False], ids=["async-fetch", "consumer-conn"])
@pytest.mark.parametrize("compressible", [False, True], ids=["random", "compressible"])
def test_one_fetch_stops_at_the_byte_budget_and_every_message_comes_once(
    connections: Any,
    db_url: str,
    consumer_options: dict[str, Any],
    async_fetch: bool,
    compressible: bool,
) -> None:
    queue = Queue("budget", Exchange("budget"), "budget")
    _publish(connections(), queue, [_body(BODY_3_MIB, compressible) for _ in range(10)])
    sizes = _payload_sizes(db_url)
    assert all(3 * MIB < size < 3 * MIB + 4096 for size, _ in sizes), sizes
    assert all((method is not None) == compressible for _, method in sizes), sizes

    conn = connections(**consumer_options, async_fetch=async_fetch)
    received: list[Any] = []
    batches: list[int] = []
    with Consumer(conn.channel(), [queue], on_message=received.append, prefetch_count=100):
        conn.drain_events(timeout=5)
        # 3 + 3 MiB taken are below the budget, 3 + 3 + 3 MiB are not: the fourth stays.
        assert len(received) == 3
        assert _statuses(db_url) == {"running": 3, "pending": 7}
        batches.append(len(received))
        while len(received) < 10:
            before = len(received)
            # No ack to carry and no notification: the transport fetches again because
            # the budget, not the credit, stopped the last fetch.
            conn.drain_events(timeout=5)
            batches.append(len(received) - before)
        for message in received:
            message.ack()
    assert batches == [3, 3, 3, 1]
    assert sorted(m.headers["n"] for m in received) == list(range(10))  # each exactly once
    assert _statuses(db_url) == {"completed": 10}


def test_prefetch_credit_left_by_the_budget_is_used_and_never_exceeded(
    connections: Any, db_url: str, consumer_options: dict[str, Any]
) -> None:
    queue = Queue("budget_credit", Exchange("budget_credit"), "budget_credit")
    _publish(connections(), queue, [_body(BODY_3_MIB, False) for _ in range(10)])
    conn = connections(**consumer_options)
    received: list[Any] = []
    with Consumer(conn.channel(), [queue], on_message=received.append, prefetch_count=5):
        conn.drain_events(timeout=5)
        assert len(received) == 3  # the budget
        conn.drain_events(timeout=5)
        assert len(received) == 5  # the credit left: 2
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)  # no credit left
        assert _statuses(db_url) == {"running": 5, "pending": 5}
        for message in received:
            message.ack()
        while len(received) < 10:
            conn.drain_events(timeout=5)
        for message in received[5:]:
            message.ack()
    assert sorted(m.headers["n"] for m in received) == list(range(10))
    assert _statuses(db_url) == {"completed": 10}


def test_a_message_larger_than_the_budget_comes_alone(
    connections: Any, db_url: str, consumer_options: dict[str, Any]
) -> None:
    queue = Queue("budget_big", Exchange("budget_big"), "budget_big")
    producer_conn = connections()
    _publish(producer_conn, queue, [os.urandom(12 * MIB)] + [b"small"] * 3)
    conn = connections(**consumer_options)
    received: list[tuple[int, int]] = []

    def on_message(message: Any) -> None:
        received.append((message.headers["n"], len(message.body)))
        message.ack()

    with Consumer(conn.channel(), [queue], on_message=on_message, prefetch_count=100):
        conn.drain_events(timeout=5)
        assert received == [(0, 12 * MIB)]
        conn.drain_events(timeout=5)
        assert received[1:] == [(1, 5), (2, 5), (3, 5)]  # together, in one fetch
    assert _statuses(db_url) == {"completed": 4}


def test_an_event_loop_consumer_fetches_past_the_budget_without_waiting_for_a_poll(
    connections: Any, db_url: str, consumer_options: dict[str, Any]
) -> None:
    queue = Queue("budget_loop", Exchange("budget_loop"), "budget_loop")
    _publish(connections(), queue, [_body(BODY_3_MIB, False) for _ in range(10)])
    conn = connections(**consumer_options)
    received: list[Any] = []
    hub = Hub()
    try:
        with Consumer(conn.channel(), [queue], on_message=received.append, prefetch_count=100):
            conn.transport.register_with_event_loop(conn.connection, hub)
            deadline = time.monotonic() + 20
            while len(received) < 10 and time.monotonic() < deadline:
                hub.run_once()
            assert len(received) == 10  # without an ack or a notification to wake the loop
            for message in received:
                message.ack()
            while _statuses(db_url) != {"completed": 10} and time.monotonic() < deadline:
                hub.run_once()
    finally:
        conn.transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
    assert sorted(m.headers["n"] for m in received) == list(range(10))
    assert _statuses(db_url) == {"completed": 10}


# -- the statement, through the store -----------------------------------------------------------


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _message(queue: str, size: int, *, compressible: bool = True) -> NewMessage:
    """A message whose payload is ``size`` bytes of JSON text."""
    filler = "a" * (size - 8) if compressible else os.urandom(size).hex()[: size - 8]
    return NewMessage(queue, 0, "pending", None, f'{{"b": "{filler}"}}', None, None, None)


@pytest.mark.parametrize("compressible", [False, True], ids=["random", "compressible"])
@pytest.mark.parametrize(
    ("sizes", "budget", "taken"),
    [
        ([3 * MIB] * 4, 8 * MIB, 3),  # 6 MiB before the third: taken; 9 before the fourth
        ([3 * MIB] * 4, 6 * MIB, 2),  # the budget reached exactly: the third stays
        ([3 * MIB] * 4, 1, 1),  # at least one, however small the budget
        ([10 * MIB, 10, 10], 1 * MIB, 1),  # a message larger than the budget comes alone
        ([10, 10, 10 * MIB, 10], 1 * MIB, 3),  # ... or last
        ([1000] * 5, 16 * MIB, 5),  # within the budget: the limit decides
    ],
)
def test_the_fetch_takes_messages_while_those_before_total_less_than_the_budget(
    store: Store, sizes: list[int], budget: int, taken: int, compressible: bool
) -> None:
    for size in sizes:
        store.publish(_message("rule", size, compressible=compressible))
    consumer = uuid.uuid4()
    store.register_consumer(consumer, hostname="test", queues=["rule"], lease=30)
    rows = store.fetch(["rule"], 5, consumer, max_bytes=budget)
    assert len(rows) == taken
    left_behind = taken < len(sizes)
    assert [row.budget_full for row in rows] == [False] * (taken - 1) + [left_behind]
    assert fetch_filled(rows, 5) == (left_behind or taken == 5)
    rest = store.fetch(["rule"], 5, consumer, max_bytes=sum(sizes))
    assert len(rest) == len(sizes) - taken
    assert not any(row.budget_full for row in rest)


def test_ack_fetch_and_no_ack_fetches_keep_the_budget(store: Store) -> None:
    for _ in range(3):
        store.publish(_message("acked", 2 * MIB))
        store.publish(_message("noack", 2 * MIB))
    consumer = uuid.uuid4()
    store.register_consumer(consumer, hostname="test", queues=["acked", "noack"], lease=30)
    done, rows = store.ack_fetch([], ["acked"], 10, consumer, max_bytes=3 * MIB)
    assert (done, len(rows), rows[-1].budget_full) == (0, 2, True)
    done, more = store.ack_fetch([row.tag for row in rows], ["acked"], 10, consumer)
    assert (done, len(more), more[-1].budget_full) == (2, 1, False)
    taken = store.fetch(["noack"], 10, consumer, no_ack=True, max_bytes=1)
    assert (len(taken), taken[0].delivery, taken[0].budget_full) == (1, 0, True)
    assert store.size("noack") == 2


def test_fetch_plan_stops_measuring_at_the_budget(store: Store, db_url: str) -> None:
    """The running total of payload bytes is cut by a run condition, which stops the window
    at the first message past the budget: compressed payloads are measured only as far as
    the fetch goes, not for every message the fetch locked. The cut is not a filter, so the
    rows picked are still estimated at the limit, and the take joins them to jobs in one pass
    (a few picked rows estimated make it probe jobs once per picked row)."""
    for _ in range(50):
        store.publish(_message("plan", 100))
    with psycopg.connect(db_url, autocommit=True) as conn:
        # A realistic table: mostly finished messages waiting to be pruned.
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
            " SELECT 'plan', 'completed', '{}', now() FROM generate_series(1, 20000)"
        )
        conn.execute("ANALYZE pgskip.jobs")
        for name in ("fetch", "ack_fetch"):
            params = {
                "queues": ["plan"],
                "limit": 10,
                "max_bytes": 2**24,
                "consumer": uuid.uuid4(),
                "ids": [],
                "deliveries": [],
                "urgent": [],
                **scan_params(["plan"], None),
            }
            plan = "\n".join(
                r[0] for r in conn.execute(psycopg.sql.SQL("EXPLAIN ") + store.q[name], params)
            )
            assert "Run Condition: (count(*) FILTER (WHERE (" in plan, plan
            assert re.search(r"Subquery Scan on b\s+\(cost=\S+ rows=10 ", plan), plan
            assert "jobs_dequeue" in plan and not seq_scanned_rows(conn, plan), plan
