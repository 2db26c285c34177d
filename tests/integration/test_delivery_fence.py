"""Every delivery of a message carries a fencing token that no other delivery of it carries: an
ack (requeue, fail) still waiting in a worker for an earlier delivery changes nothing, even when
the same consumer holds the message again with the same attempt number."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from kombu_pgskip.maintenance import FailedFilter, retry_failed
from kombu_pgskip.store import FetchedRow, NewMessage, Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _publish(store: Store, queue: str) -> int:
    return store.publish(NewMessage(queue, 0, "pending", None, '{"n": 1}', None, None, None))


def _row(db_url: str, row_id: int) -> tuple[str, int, uuid.UUID | None]:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT status::text, attempts, locked_by FROM pgskip.jobs WHERE id = %s", (row_id,)
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def _register(store: Store, consumer: uuid.UUID, queue: str, lease: float = 30) -> None:
    store.register_consumer(consumer, hostname="test", queues=[queue], lease=lease)


# What the version before migration 0013 did to take a message (its fetch, for one message)
# and to ack it (fenced by attempts): its workers run against this schema while a deploy rolls,
# and must settle their own deliveries.
PREVIOUS_FETCH = """
UPDATE pgskip.jobs AS jobs
   SET status = 'running', locked_by = %(consumer)s, locked_at = now(),
       attempts = jobs.attempts + 1
 WHERE jobs.id = (SELECT id FROM pgskip.jobs
                   WHERE queue = %(queue)s AND status = 'pending' AND run_at <= now()
                   ORDER BY priority DESC, run_at, id
                   LIMIT 1
                     FOR UPDATE SKIP LOCKED)
RETURNING jobs.id, jobs.attempts
"""
PREVIOUS_ACK = """
UPDATE pgskip.jobs AS jobs
   SET status = 'completed', finished_at = now(), locked_by = NULL
 WHERE jobs.id = ANY (%(ids)s::bigint[])
   AND jobs.attempts = (%(attempts)s::integer[])[array_position(%(ids)s::bigint[], jobs.id)]
   AND jobs.locked_by = %(consumer)s AND jobs.status = 'running'
RETURNING jobs.id
"""


def _attempts_alone_would_match(db_url: str, stale: FetchedRow, consumer: uuid.UUID) -> bool:
    """Whether the fence of the previous version (locked_by, attempts) would let the ack of
    ``stale`` complete the message as it runs now (tried in a transaction rolled back)."""
    with psycopg.connect(db_url) as conn:
        params = {"ids": [stale.id], "attempts": [stale.attempts], "consumer": consumer}
        matched = conn.execute(PREVIOUS_ACK, params).fetchall()
        conn.rollback()
    return matched == [(stale.id,)]


def _assert_stale_tag_changes_nothing(
    store: Store, db_url: str, stale: FetchedRow, current: FetchedRow, consumer: uuid.UUID
) -> None:
    """Every fenced transition given the earlier delivery's tag leaves the row running."""
    assert stale.id == current.id and stale.delivery != current.delivery
    assert store.ack([stale.tag], consumer) == 0
    assert store.ack_fetch([stale.tag], [current.queue], 0, consumer) == (0, [])
    assert store.requeue([stale.tag], consumer, max_attempts=20) == (0, 0)
    assert store.fail([stale.tag], consumer, "stale") == 0
    assert _row(db_url, current.id) == ("running", current.attempts, consumer)


def test_an_ack_of_the_delivery_before_retry_failed_changes_nothing(
    store: Store, db_url: str
) -> None:
    row_id = _publish(store, "fenced")
    consumer = uuid.uuid4()
    _register(store, consumer, "fenced")
    (first,) = store.fetch(["fenced"], 10, consumer)
    assert store.fail([first.tag], consumer, "boom") == 1
    assert retry_failed(db_url, "pgskip", FailedFilter(queue="fenced")) == 1
    (second,) = store.fetch(["fenced"], 10, consumer)
    # The same row, the same consumer, the same attempt number (retry-failed reset it): only
    # the token tells the two deliveries apart.
    assert second.id == first.id == row_id
    assert second.attempts == first.attempts == 1
    assert _attempts_alone_would_match(db_url, first, consumer)
    _assert_stale_tag_changes_nothing(store, db_url, first, second, consumer)
    assert store.ack([second.tag], consumer) == 1
    assert _row(db_url, row_id) == ("completed", 1, None)


@pytest.mark.parametrize("max_attempts", [20, 1], ids=["swept-to-pending", "swept-to-failed"])
def test_an_ack_of_the_delivery_before_the_consumer_registered_again_changes_nothing(
    store: Store, db_url: str, max_attempts: int
) -> None:
    row_id = _publish(store, "relost")
    consumer = uuid.uuid4()
    _register(store, consumer, "relost", lease=0.05)
    (first,) = store.fetch(["relost"], 10, consumer)
    time.sleep(0.1)  # the lease runs out; the sweeper takes the message back
    requeued, failed, forgotten = store.sweep(max_attempts=max_attempts)
    assert (requeued, failed, forgotten) == ((1, 0, 1) if max_attempts > 1 else (0, 1, 1))
    if max_attempts == 1:
        # Failed after its one delivery, then retried by an operator: attempts start over.
        assert retry_failed(db_url, "pgskip", FailedFilter(queue="relost")) == 1
    _register(store, consumer, "relost")  # the same id, as a channel whose lease ran out
    (second,) = store.fetch(["relost"], 10, consumer)
    assert second.id == first.id == row_id
    assert second.attempts == (2 if max_attempts > 1 else first.attempts)
    assert _attempts_alone_would_match(db_url, first, consumer) == (max_attempts == 1)
    _assert_stale_tag_changes_nothing(store, db_url, first, second, consumer)
    assert store.ack([second.tag], consumer) == 1
    assert _row(db_url, row_id)[0] == "completed"


def test_tokens_differ_between_fetches_and_are_shared_within_one(store: Store) -> None:
    for _ in range(3):
        _publish(store, "tokens")
    consumer = uuid.uuid4()
    _register(store, consumer, "tokens")
    together = store.fetch(["tokens"], 2, consumer)
    (alone,) = store.fetch(["tokens"], 2, consumer)
    assert len({row.delivery for row in together}) == 1
    assert alone.delivery > together[0].delivery > 0
    assert store.ack([row.tag for row in [*together, alone]], consumer) == 3


def test_a_worker_of_the_previous_version_settles_its_own_deliveries(
    store: Store, db_url: str
) -> None:
    new_worker, old_worker = uuid.uuid4(), uuid.uuid4()
    _register(store, new_worker, "mixed")
    _register(store, old_worker, "mixed")
    first = _publish(store, "mixed")
    (mine,) = store.fetch(["mixed"], 1, new_worker)
    assert mine.id == first
    assert store.requeue([mine.tag], new_worker, max_attempts=20) == (1, 0)
    with psycopg.connect(db_url, autocommit=True) as conn:
        taken = conn.execute(PREVIOUS_FETCH, {"consumer": old_worker, "queue": "mixed"}).fetchone()
        assert taken == (first, 2)
        # The row keeps the token of the new worker's delivery; that worker's tag is stale.
        assert store.ack([mine.tag], new_worker) == 0
        acked = conn.execute(
            PREVIOUS_ACK, {"ids": [first], "attempts": [1], "consumer": old_worker}
        ).fetchall()
        assert acked == []  # an earlier delivery, by attempts
        acked = conn.execute(
            PREVIOUS_ACK, {"ids": [first], "attempts": [2], "consumer": old_worker}
        ).fetchall()
        assert acked == [(first,)]
    assert _row(db_url, first) == ("completed", 2, None)
