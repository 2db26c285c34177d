"""Every store operation against a real PostgreSQL, through the named SQL."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import psycopg
import pytest

from kombu_pgskip.envelope import to_row
from kombu_pgskip.store import Position, Store, scan_params
from tests.helpers import seq_scanned_rows


def _publish(
    store: Store, queue: str, n: int = 1, *, priority: int = 0, **headers: Any
) -> list[int]:
    ids = []
    for i in range(n):
        message = {
            "body": json.dumps({"i": i}),
            "headers": {"task": "t", "id": f"{queue}-{i}", **headers},
            "properties": {"priority": priority, "delivery_info": {}},
        }
        ids.append(store.publish(to_row(queue, message, eta_threshold=2, max_message_size=10**6)))
    return ids


@pytest.fixture
def store(db_url: str) -> Any:
    s = Store(db_url)
    yield s
    s.close()


def _status(db_url: str) -> dict[int, str]:
    with psycopg.connect(db_url) as conn:
        return {r[0]: r[1] for r in conn.execute("SELECT id, status::text FROM pgskip.jobs")}


def _consumer(store: Store, queues: list[str], lease: float = 30) -> uuid.UUID:
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="test", queues=queues, lease=lease)
    return cid


def test_fetch_marks_rows_running_and_ack_completes_them(store: Store, db_url: str) -> None:
    ids = _publish(store, "q", 3)
    c = _consumer(store, ["q"])
    rows = store.fetch(["q"], 10, c)
    assert [r.id for r in rows] == ids
    assert all(r.attempts == 1 and not r.redelivered for r in rows)
    assert set(_status(db_url).values()) == {"running"}
    assert store.ack([r.tag for r in rows], c) == 3
    assert set(_status(db_url).values()) == {"completed"}


def test_fetch_takes_no_more_than_the_limit(store: Store) -> None:
    _publish(store, "q", 5)
    c = _consumer(store, ["q"])
    assert len(store.fetch(["q"], 2, c)) == 2
    assert store.size("q") == 3


def test_higher_priority_first_then_fifo(store: Store) -> None:
    low = _publish(store, "q", 2, priority=0)
    high = _publish(store, "q", 2, priority=9)
    mid = _publish(store, "q", 1, priority=5)
    c = _consumer(store, ["q"])
    assert [r.id for r in store.fetch(["q"], 10, c)] == high + mid + low


def test_priority_is_clamped_to_queue_max_priority(store: Store, db_url: str) -> None:
    store.declare_queue("capped", arguments={"x-max-priority": 3})
    (row_id,) = _publish(store, "capped", priority=9)
    with psycopg.connect(db_url) as conn:
        assert conn.execute(
            "SELECT priority FROM pgskip.jobs WHERE id = %s", (row_id,)
        ).fetchone() == (3,)


def test_fetch_across_queues_is_round_robin(store: Store) -> None:
    a = _publish(store, "a", 3)
    b = _publish(store, "b", 3)
    c = _consumer(store, ["a", "b"])
    got = [r.queue for r in store.fetch(["a", "b"], 4, c)]
    assert sorted(got) == ["a", "a", "b", "b"]
    assert len(a) == len(b) == 3


def test_ack_from_a_consumer_that_lost_the_lease_changes_nothing(store: Store, db_url: str) -> None:
    _publish(store, "q")
    old = _consumer(store, ["q"])
    (row,) = store.fetch(["q"], 1, old)
    # old's lease is taken away; the row goes back and a new consumer takes it.
    store.unregister_consumer(old)
    new = _consumer(store, ["q"])
    (again,) = store.fetch(["q"], 1, new)
    assert again.id == row.id and again.redelivered and again.attempts == 2
    assert store.ack([row.tag], old) == 0
    assert _status(db_url)[row.id] == "running"
    assert store.ack([again.tag], new) == 1


def test_requeue_returns_to_pending_with_redelivered_set(store: Store) -> None:
    _publish(store, "q")
    c = _consumer(store, ["q"])
    (row,) = store.fetch(["q"], 1, c)
    assert store.requeue([row.tag], c, max_attempts=5) == (1, 0)
    (again,) = store.fetch(["q"], 1, c)
    assert again.redelivered and again.attempts == 2


def test_requeue_past_max_attempts_goes_to_failed_with_reason(store: Store, db_url: str) -> None:
    _publish(store, "q")
    c = _consumer(store, ["q"])
    for _ in range(2):
        (row,) = store.fetch(["q"], 1, c)
        store.requeue([row.tag], c, max_attempts=2)
    assert _status(db_url)[row.id] == "failed"
    with psycopg.connect(db_url) as conn:
        (error,) = conn.execute("SELECT last_error FROM pgskip.jobs").fetchone()  # type: ignore[misc]
    assert "max_attempts" in error


def test_reject_without_requeue_is_a_dead_letter(store: Store, db_url: str) -> None:
    _publish(store, "q")
    c = _consumer(store, ["q"])
    (row,) = store.fetch(["q"], 1, c)
    assert store.fail([row.tag], c, "bad message") == 1
    assert _status(db_url)[row.id] == "failed"
    assert store.size("q") == 0


def test_sweep_returns_rows_of_consumers_whose_lease_ran_out(store: Store, db_url: str) -> None:
    _publish(store, "q", 2)
    dead = _consumer(store, ["q"])
    live = _consumer(store, ["q"])
    store.fetch(["q"], 1, dead)
    store.fetch(["q"], 1, live)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.consumers SET lease_until = now() - interval '1 s' WHERE id = %s",
            (dead,),
        )
    requeued, failed, forgotten = store.sweep(max_attempts=10)
    assert (requeued, failed, forgotten) == (1, 0, 1)
    assert sorted(_status(db_url).values()) == ["pending", "running"]
    assert store.renew_consumers([dead, live], 30) == {live}


def test_scheduled_messages_are_promoted_when_due(store: Store, db_url: str) -> None:
    from datetime import datetime, timedelta, timezone

    eta = datetime.now(timezone.utc) + timedelta(minutes=10)
    (row_id,) = _publish(store, "q", eta=eta.isoformat())
    assert _status(db_url)[row_id] == "scheduled"
    promoted, next_in = store.promote_scheduled()
    assert promoted == 0 and next_in is not None and 590 < next_in <= 600
    c = _consumer(store, ["q"])
    assert store.fetch(["q"], 1, c) == []
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET run_at = now() - interval '1 s'")
    assert store.promote_scheduled()[0] == 1
    assert [r.id for r in store.fetch(["q"], 1, c)] == [row_id]


def test_a_promoted_message_comes_before_those_published_after_it(
    store: Store, db_url: str
) -> None:
    """Its place in the queue is its publish, as with RabbitMQ, where a worker receives an ETA
    message in publish order and holds it until due: behind a backlog, a countdown does not
    wait for the messages published after it."""
    from datetime import datetime, timedelta, timezone

    eta = datetime.now(timezone.utc) + timedelta(minutes=10)
    (early,) = _publish(store, "q", eta=eta.isoformat())
    later = _publish(store, "q", 3)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs SET run_at = now() WHERE id = %s", (early,))
    assert store.promote_scheduled()[0] == 1
    c = _consumer(store, ["q"])
    assert [r.id for r in store.fetch(["q"], 4, c)] == [early, *later]


def test_purge_removes_exactly_the_waiting_messages(store: Store) -> None:
    _publish(store, "q", 7)
    _publish(store, "other", 2)
    c = _consumer(store, ["q"])
    store.fetch(["q"], 2, c)
    assert store.purge("q") == 5
    assert store.purge("q") == 0
    assert store.size("other") == 2


def test_message_ttl_expired_messages_are_not_delivered(store: Store) -> None:
    store.declare_queue("ttl", arguments={"x-message-ttl": 1})
    _publish(store, "ttl")
    import time

    time.sleep(0.05)
    c = _consumer(store, ["ttl"])
    assert store.fetch(["ttl"], 1, c) == []


def test_no_ack_fetch_deletes_the_rows(store: Store, db_url: str) -> None:
    _publish(store, "q", 2)
    c = _consumer(store, ["q"])
    assert len(store.fetch(["q"], 5, c, no_ack=True)) == 2
    assert _status(db_url) == {}


def test_concurrent_fetchers_never_receive_the_same_message(db_url: str) -> None:
    setup = Store(db_url)
    _publish(setup, "q", 600)
    seen: list[list[int]] = [[] for _ in range(4)]

    def consume(slot: int) -> None:
        s = Store(db_url)
        c = _consumer(s, ["q"])
        while rows := s.fetch(["q"], 7, c):
            seen[slot] += [r.id for r in rows]
            s.ack([r.tag for r in rows], c)
        s.close()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ids = [i for ids in seen for i in ids]
    assert len(all_ids) == 600 == len(set(all_ids))
    assert sum(1 for ids in seen if ids) >= 2
    setup.close()


def test_fetch_plan_uses_the_partial_dequeue_index(store: Store, db_url: str) -> None:
    _publish(store, "q", 200)
    _publish(store, "other", 200)
    with psycopg.connect(db_url, autocommit=True) as conn:
        # A realistic table: mostly finished messages waiting to be pruned.
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, status, payload, finished_at)"
            " SELECT 'q', 'completed', '{}', now() FROM generate_series(1, 20000)"
        )
        conn.execute("ANALYZE pgskip.jobs")
        query = store.q["fetch"]
        params = {"queues": ["q"], "limit": 10, "max_bytes": 2**24, "consumer": uuid.uuid4()}
        after = [Position(0, "2026-01-01 00:00:00+00", 1)]
        for starts in (None, after):
            plan = "\n".join(
                r[0]
                for r in conn.execute(
                    psycopg.sql.SQL("EXPLAIN ") + query, params | scan_params(["q"], starts)
                )
            )
            # Both branches (the position's own priority level, the lower ones) walk the
            # index, the first from just after the position.
            # (the rows are in the current slot, jobs_1)
            assert plan.count("Index Scan using jobs_dequeue_1 ") == 2, plan
            assert not seq_scanned_rows(conn, plan), plan
            assert "ROW(run_at, id) > ROW(q.after_run_at, q.after_id)" in plan, plan


def test_expired_messages_are_dropped_by_the_sweeper(store: Store, db_url: str) -> None:
    store.declare_queue("ttl", arguments={"x-message-ttl": 1})
    _publish(store, "ttl", 2)
    _publish(store, "q", 1)
    import time

    time.sleep(0.05)
    assert store.drop_expired() == 2
    assert list(_status(db_url).values()) == ["pending"]
