"""The ring of ``jobs``' slots (migration 0027): new messages go to the current slot; once it
has given out ``slot_rows`` ids the ring moves on; a slot whose messages are all finished, past
the retention of completed ones, is emptied with TRUNCATE; a slot the ring comes back to while
it still holds messages to keep has them moved to ``jobs_kept`` first, with their ids, so that
every consumer settles, fetches and lists them as before.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from kombu_pgskip.health import HorizonMonitor, read_holders, read_ring_block
from kombu_pgskip.store import NewMessage, Store
from tests.helpers import FakeClock, finished_slot_behind
from tests.safety_support import worker_role


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _ring(db_url: str, *, slot_rows: int, slots: int = 8, retention: str = "0 s") -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs_rotation SET slot_rows = %s, slots = %s,"
            " completed_retention = %s::interval",
            (slot_rows, slots, retention),
        )


def _publish(store: Store, n: int, queue: str = "q") -> list[int]:
    return store.publish_many([NewMessage(queue, 0, "pending", None, "{}", None, None, None)] * n)


def _slots(db_url: str) -> dict[int, int]:
    """Messages per slot."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT slot, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


def _size(db_url: str, table: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT pg_relation_size(%s::regclass)", (f"pgskip.{table}",))
        return int(row.fetchone()[0])  # type: ignore[index]


def _consumer(store: Store) -> uuid.UUID:
    me = uuid.uuid4()
    store.register_consumer(me, hostname="h", queues=["q"], lease=60)
    return me


def test_the_ring_moves_on_once_the_current_slot_gave_out_its_ids(
    store: Store, db_url: str
) -> None:
    _ring(db_url, slot_rows=10)
    _publish(store, 9)
    assert store.rotate() == (0, 0, 1)  # 9 of 10 ids: the slot is still current
    _publish(store, 3)
    assert store.rotate() == (0, 0, 2)
    _publish(store, 1)
    assert _slots(db_url) == {1: 12, 2: 1}


def test_a_slot_whose_messages_all_finished_is_emptied_and_its_space_returned(
    store: Store, db_url: str
) -> None:
    _ring(db_url, slot_rows=100)
    me = _consumer(store)
    _publish(store, 100)
    assert store.rotate()[2] == 2
    _publish(store, 50)
    rows = store.fetch(["q"], 150, me)
    assert store.ack([r.tag for r in rows], me) == 150
    assert _size(db_url, "jobs_1") > 0
    emptied, moved, current = store.rotate()
    assert (emptied, moved, current) == (1, 0, 2)
    assert _size(db_url, "jobs_1") == 0
    # The current slot is never emptied, finished or not.
    assert _slots(db_url) == {2: 50}


@pytest.mark.parametrize("kept", ["pending", "scheduled", "running", "failed"])
def test_a_slot_holding_a_message_to_keep_is_not_emptied(
    store: Store, db_url: str, kept: str
) -> None:
    """Its completed messages move to jobs_kept, the one it keeps stays in the slot."""
    _ring(db_url, slot_rows=10, retention="1 hour")
    me = _consumer(store)
    _publish(store, 10)
    rows = store.fetch(["q"], 10, me)
    store.ack([r.tag for r in rows[1:]], me)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs SET status = %s::pgskip.job_status, finished_at = now()"
            " WHERE id = %s",
            (kept, rows[0].id),
        )
    assert store.rotate() == (0, 0, 2)
    assert store.rotate() == (0, 9, 2)
    assert store.rotate() == (0, 0, 2)
    assert _slots(db_url) == {0: 9, 1: 1}


def test_a_rotation_moves_at_most_a_slots_worth_oldest_slot_first(
    store: Store, db_url: str
) -> None:
    """Two slots behind the current one, both of completed messages: one call moves slot_rows
    of them, from the slot the ring takes next first, and empties that slot, now holding
    nothing to keep, in the same call."""
    _ring(db_url, slot_rows=5, slots=4, retention="1 hour")
    me = _consumer(store)
    first = _publish(store, 5)
    assert store.rotate() == (0, 0, 2)
    second = _publish(store, 5)
    assert store.rotate() == (0, 0, 3)
    rows = store.fetch(["q"], 10, me)
    assert store.ack([r.tag for r in rows], me) == 10
    # Slot 4 is empty; then slot 1 (the oldest), then slot 2.
    assert store.rotate() == (1, 5, 3)
    assert _where(db_url, first) == {0: 5}
    assert _where(db_url, second) == {2: 5}
    assert _size(db_url, "jobs_1") == 0
    assert store.rotate() == (1, 5, 3)
    assert _where(db_url, second) == {0: 5}
    assert store.rotate() == (0, 0, 3)
    assert _slots(db_url) == {0: 10}


def test_the_ring_coming_back_to_a_slot_moves_what_it_must_keep_to_jobs_kept(
    store: Store, db_url: str
) -> None:
    """A slot the ring needs again is emptied whatever it holds: the messages to keep go to
    jobs_kept with their ids and deliveries, the rest goes with the slot."""
    _ring(db_url, slot_rows=5, slots=2, retention="1 hour")
    me = _consumer(store)
    ids = _publish(store, 5)
    rows = {r.id: r for r in store.fetch(["q"], 4, me)}
    running, failed, completed, old = ids[0], ids[1], ids[2], ids[3]
    pending = ids[4]
    assert store.fail([rows[failed].tag], me, "boom") == 1
    assert store.ack([rows[completed].tag, rows[old].tag], me) == 2
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs SET finished_at = now() - interval '2 hours' WHERE id = %s", (old,)
        )
    assert store.rotate() == (0, 0, 2)
    _publish(store, 5)
    emptied, moved, current = store.rotate()  # back to slot 1
    assert (emptied, moved, current) == (1, 4, 1)
    with psycopg.connect(db_url) as conn:
        where = dict(
            conn.execute("SELECT id, slot FROM pgskip.jobs WHERE id = ANY(%s)", (ids,)).fetchall()
        )
    assert where == {running: 0, failed: 0, completed: 0, pending: 0}
    # The consumer settles the message it holds as before; the waiting one is delivered.
    assert store.ack([rows[running].tag], me) == 1
    (again,) = store.fetch(["q"], 1, me)
    assert again.id == pending
    assert store.ack([again.tag], me) == 1


def test_a_held_snapshot_does_not_stop_a_slot_being_emptied(store: Store, db_url: str) -> None:
    """A transaction that holds a snapshot (a report, a shell left open) without having read
    jobs stops vacuum, not the emptying of a slot."""
    _ring(db_url, slot_rows=10)
    me = _consumer(store)
    with psycopg.connect(db_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgskip.queues")
        _publish(store, 10)
        rows = store.fetch(["q"], 10, me)
        store.ack([r.tag for r in rows], me)
        assert store.rotate() == (0, 0, 2)
        assert store.rotate() == (1, 0, 2)
        holder.rollback()
    assert _size(db_url, "jobs_1") == 0


def test_a_transaction_that_read_the_slot_delays_its_emptying_without_failing(
    store: Store, db_url: str
) -> None:
    finished_slot_behind(store, db_url)
    with psycopg.connect(db_url) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM pgskip.jobs")  # holds a lock on every slot
        started = time.monotonic()
        assert store.rotate() == (0, 0, 2)
        assert time.monotonic() - started < 2.0  # it waited its lock_timeout, then went on
        reader.rollback()
    assert store.rotate() == (1, 0, 2)


def test_a_session_holding_every_slot_costs_a_rotation_one_lock_wait(
    store: Store, db_url: str
) -> None:
    """A pg_dump, or a report that read jobs, holds a lock of every slot, and every fetch
    waits behind each try to lock one: rotate() tries one and leaves the others for the next
    call."""
    _ring(db_url, slot_rows=2)
    me = _consumer(store)
    for current in range(2, 8):
        _publish(store, 2)
        assert store.rotate() == (0, 0, current)
    rows = store.fetch(["q"], 20, me)
    assert store.ack([r.tag for r in rows], me) == 12  # slots 1 to 6 finished
    with psycopg.connect(db_url) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM pgskip.jobs")
        took = []
        for _ in range(3):
            started = time.monotonic()
            assert store.rotate() == (0, 0, 7)
            took.append(time.monotonic() - started)
        # One lock_timeout (20 ms), not one per finished slot (120 ms).
        assert min(took) < 0.1, took
        reader.rollback()
    assert store.rotate() == (6, 0, 7)


def test_a_publish_left_open_does_not_delay_emptying_another_slot(
    store: Store, db_url: str
) -> None:
    finished_slot_behind(store, db_url)
    with psycopg.connect(db_url) as business:
        business.execute(  # as the publish statement writes it, in the caller's transaction
            "INSERT INTO pgskip.jobs (queue, payload, slot)"
            " VALUES ('q', '{}', (SELECT slot FROM pgskip.jobs_rotation))"
        )
        assert store.rotate() == (1, 0, 2)  # the open transaction holds only slot 2
        business.commit()
    assert _slots(db_url) == {2: 1}


def test_a_publish_reading_the_slot_before_the_ring_moved_on_is_kept(
    store: Store, db_url: str
) -> None:
    """A message written to a slot just left behind is looked at again under the slot's lock,
    so the slot is not emptied under it."""
    _ring(db_url, slot_rows=10)
    _publish(store, 10)
    with psycopg.connect(db_url) as late:
        late.execute(
            "INSERT INTO pgskip.jobs (queue, payload, slot) VALUES ('q', '{}', 1)"
        )  # as a publish that read slot 1 as current
        assert store.rotate() == (0, 0, 2)
        late.commit()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs SET status = 'completed', finished_at = now() - interval '1 s'"
            " WHERE id IN (SELECT id FROM pgskip.jobs ORDER BY id LIMIT 10)"
        )
    assert store.rotate() == (0, 0, 2)
    assert _slots(db_url) == {1: 11}


def test_one_session_rotates_at_a_time(store: Store, db_url: str) -> None:
    _ring(db_url, slot_rows=10)
    _publish(store, 10)
    with psycopg.connect(db_url) as other:
        other.execute("SELECT * FROM pgskip.jobs_rotation FOR UPDATE")
        result: list[tuple[int, int, int]] = []
        t = threading.Thread(target=lambda: result.append(store.rotate()))
        t.start()
        t.join(5)
        assert result == [(0, 0, 1)]  # returned at once, nothing done
        other.rollback()
    assert store.rotate() == (0, 0, 2)


def test_a_message_moved_to_jobs_kept_keeps_its_unique_key(store: Store, db_url: str) -> None:
    """A keyed message that waits when the ring needs its slot again moves with its claim:
    its key stays held while it waits, and is free once it ran."""
    _ring(db_url, slot_rows=2, slots=2)
    me = _consumer(store)
    keyed = NewMessage("q", 0, "pending", None, "{}", "t", "k1", None, unique_key="sync:7")
    first = store.publish(keyed)
    assert first is not None
    _publish(store, 1)
    assert store.rotate()[2] == 2
    _publish(store, 2)
    assert store.rotate() == (1, 2, 1)  # back to slot 1: its two waiting messages move
    assert store.publish(keyed) is None, "the key is still held"
    (row,) = [r for r in store.fetch(["q"], 10, me) if r.id == first]
    assert store.ack([row.tag], me) == 1
    assert store.publish(keyed) is not None


def _overfilled_slot_1(store: Store, db_url: str, *, slots: int, finished: bool) -> list[int]:
    """Slot 1 holding 11 messages to keep, more than twice its slot_rows of 5 (as when the ring
    stayed on it while a session held a lock of every slot): waiting, or completed within the
    retention if ``finished``; the ring then on slot 2. Returns their ids."""
    _ring(db_url, slot_rows=5, slots=slots, retention="1 hour")
    ids = _publish(store, 11)
    if finished:
        me = _consumer(store)
        rows = store.fetch(["q"], 11, me)
        assert store.ack([r.tag for r in rows], me) == 11
    assert store.rotate() == (0, 0, 2)
    return ids


def _where(db_url: str, ids: list[int]) -> dict[int, int]:
    """Messages per slot among ``ids``."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT slot, count(*) FROM pgskip.jobs WHERE id = ANY(%s) GROUP BY 1", (ids,)
        ).fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


def _blocked(db_url: str) -> bool:
    """Whether rotate() found a slot it had to lock held by another session, last time."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT blocked_since IS NOT NULL FROM pgskip.jobs_rotation").fetchone()
    assert row is not None
    return bool(row[0])


def _statuses(db_url: str, ids: list[int]) -> dict[str, int]:
    """Messages per status among ``ids``."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT status::text, count(*) FROM pgskip.jobs WHERE id = ANY(%s) GROUP BY 1", (ids,)
        ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def test_a_slot_with_more_to_keep_than_twice_its_ids_is_passed_over(
    store: Store, db_url: str
) -> None:
    """Moving more than 2 * slot_rows messages at once would hold up every fetch for as long as
    it took: the ring takes the next slot after it instead, and moves what that one keeps."""
    overfilled = _overfilled_slot_1(store, db_url, slots=3, finished=False)
    waiting = _publish(store, 5)  # slot 2
    assert store.rotate() == (0, 0, 3)
    waiting += _publish(store, 5)  # slot 3
    assert store.rotate() == (1, 5, 2)  # slot 1 passed over; slot 2's five waiting moved
    assert _slots(db_url) == {0: 5, 1: 11, 3: 5}
    me = _consumer(store)
    taken = store.fetch(["q"], 30, me)
    assert sorted(r.id for r in taken) == sorted(overfilled + waiting)


def test_the_ring_stays_on_its_slot_while_every_other_holds_too_much_to_move(
    store: Store, db_url: str
) -> None:
    """With no slot to take, the current one takes more than slot_rows ids, as one table
    would, and the ring moves on once the slot passed over can be taken: here its messages
    ran, a slot's worth of their completed rows moved to jobs_kept without its lock and the
    rest under it."""
    overfilled = _overfilled_slot_1(store, db_url, slots=2, finished=False)
    _publish(store, 12)
    assert store.rotate() == (0, 0, 2)
    assert store.rotate() == (0, 0, 2)
    assert _slots(db_url) == {1: 11, 2: 12}
    me = _consumer(store)
    rows = [r for r in store.fetch(["q"], 30, me) if r.id in overfilled]
    assert store.ack([r.tag for r in rows], me) == 11
    assert store.rotate() == (1, 11, 1)  # five completed moved, then six (<= 10) and taken
    assert _where(db_url, overfilled) == {0: 11}
    _publish(store, 1)
    assert _slots(db_url) == {0: 11, 1: 1, 2: 12}


def test_completed_messages_of_a_slot_passed_over_move_without_its_lock(
    store: Store, db_url: str
) -> None:
    """A slot passed over with a day of completed messages is not left for a day: each call
    moves slot_rows of them to jobs_kept without its lock; then the slot is emptied and taken
    with what is left. While a transaction reads the slot (and holds it against the lock
    rotate() needs to take it), the calls after the one it refused only try that lock: moves
    made meanwhile could not be emptied until it ends."""
    overfilled = _overfilled_slot_1(store, db_url, slots=2, finished=True)
    _publish(store, 5)
    with psycopg.connect(db_url) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM pgskip.jobs_1")
        assert store.rotate() == (0, 5, 2)  # six left to keep: taken, but not while it is read
        assert _blocked(db_url)
        assert store.rotate() == (0, 0, 2)
        assert store.rotate() == (0, 0, 2)
        assert _where(db_url, overfilled) == {0: 5, 1: 6}
        reader.rollback()
    assert store.rotate() == (1, 6, 1)  # five moved without the lock, the sixth under it
    assert not _blocked(db_url)
    assert _where(db_url, overfilled) == {0: 11}
    assert _statuses(db_url, overfilled) == {"completed": 11}


def test_while_every_slot_is_held_a_rotation_only_tries_one_lock(store: Store, db_url: str) -> None:
    """A session that read jobs (a pg_dump, a report) holds every slot: once a lock was
    refused, each call tries one lock, moves no completed message and checks no slot for what
    it keeps, and the ring moves on only to the next slot, if empty; once the session ends,
    the next call does what was left."""
    _ring(db_url, slot_rows=2, slots=3, retention="1 hour")
    me = _consumer(store)

    def ran() -> list[int]:
        ids = _publish(store, 2)
        rows = store.fetch(["q"], 2, me)
        assert store.ack([r.tag for r in rows], me) == 2
        return ids

    ran()
    assert store.rotate() == (0, 0, 2)
    ran()
    assert store.rotate() == (1, 2, 3)  # slot 1's two moved to jobs_kept, slot 1 emptied
    with psycopg.connect(db_url) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM pgskip.jobs")
        assert store.rotate() == (0, 2, 3)  # slot 2's two moved; its lock refused
        assert _blocked(db_url)
        behind = ran()
        assert store.rotate() == (0, 0, 1)  # slot 1 is empty: taken
        ran()
        assert store.rotate() == (0, 0, 1)  # no empty slot: the ring stays
        assert _where(db_url, behind) == {3: 2}  # not moved while the locks are refused
        reader.rollback()
    assert store.rotate() == (2, 2, 2)  # slot 3's two moved; slots 2 and 3 emptied
    assert not _blocked(db_url)
    assert _where(db_url, behind) == {0: 2}


def test_completed_messages_about_to_pass_the_retention_stay_for_pruning(
    store: Store, db_url: str
) -> None:
    """Only completed messages more than a minute within the retention move without the
    slot's lock: prune() may be deleting the others."""
    overfilled = _overfilled_slot_1(store, db_url, slots=2, finished=True)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs SET finished_at = now() - interval '59 minutes 30 seconds'"
            " WHERE id = ANY(%s)",
            (overfilled,),
        )
    _publish(store, 5)
    assert store.rotate() == (0, 0, 2)
    assert store.rotate() == (0, 0, 2)
    assert _where(db_url, overfilled) == {1: 11}


def test_the_slot_after_the_current_one_has_its_completed_messages_moved_before_the_wrap(
    store: Store, db_url: str
) -> None:
    """With a retention longer than a turn of the ring, the slot the ring takes next holds a
    slot's worth of completed messages: they move to jobs_kept ahead of need, without the
    slot's lock, so that at the wrap only a message still waiting moves under it."""
    _ring(db_url, slot_rows=5, slots=2, retention="1 hour")
    me = _consumer(store)
    ids = _publish(store, 5)
    rows = store.fetch(["q"], 4, me)
    assert store.ack([r.tag for r in rows], me) == 4
    assert store.rotate() == (0, 0, 2)
    _publish(store, 2)  # slot 2 has ids left: no wrap yet
    assert store.rotate() == (0, 4, 2)
    assert store.rotate() == (0, 0, 2)  # slot 1 still keeps its waiting message
    assert _where(db_url, ids) == {0: 4, 1: 1}
    _publish(store, 3)
    assert store.rotate() == (1, 1, 1)  # the waiting one moved under the lock
    assert _where(db_url, ids) == {0: 5}
    (last,) = store.fetch(["q"], 1, me)
    assert last.id == ids[4]
    assert _statuses(db_url, ids) == {"completed": 4, "running": 1}


@pytest.mark.parametrize("slots", [2, 8])
def test_a_slot_behind_the_current_one_is_emptied_once_its_messages_have_run(
    store: Store, db_url: str, slots: int
) -> None:
    """Every slot behind the current one, not only the one the ring takes next, has its
    completed messages moved and is emptied once they have, instead of keeping the dead
    entries of every message consumed from it for the retention; the ring then moves on to an
    empty slot."""
    _ring(db_url, slot_rows=5, slots=slots, retention="1 hour")
    me = _consumer(store)
    ids = _publish(store, 5)
    rows = store.fetch(["q"], 5, me)
    assert store.ack([r.tag for r in rows], me) == 5
    assert store.rotate() == (0, 0, 2)
    assert store.rotate() == (1, 5, 2)  # moved, then emptied in the same call
    assert _size(db_url, "jobs_1") == 0
    _publish(store, 5)
    assert store.rotate() == (0, 0, 2 % slots + 1)
    assert _where(db_url, ids) == {0: 5}


def test_a_transaction_holding_the_slots_is_named_by_the_worker_past_the_threshold(
    store: Store, db_url: str, pg_server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shell left in a READ COMMITTED transaction after reading jobs holds no snapshot (the
    xmin warning is silent) but holds every slot's lock, so no slot is emptied. The worker,
    as the role `pgskip grant` makes, names it once rotations have been refused for the
    threshold, repeats it at most once per threshold, and says nothing once it ended."""
    finished_slot_behind(store, db_url)
    with worker_role(pg_server_dsn, db_url) as worker_url:
        worker = Store(worker_url)
        clock = FakeClock()
        monitor = HorizonMonitor(worker, threshold=0.5, clock=clock)

        def ring_warnings() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.__dict__.get("action") == "ring_blocked"]

        try:
            with caplog.at_level(logging.WARNING):
                assert monitor.check_ring(clock.now) is None
                with psycopg.connect(db_url, application_name="django-shell") as shell:
                    shell.execute("SELECT count(*) FROM pgskip.jobs")
                    pid = shell.info.backend_pid
                    assert worker.rotate() == (0, 0, 2)  # slot 1's lock refused
                    assert str(pid) not in {h.who for h in read_holders(worker)}
                    assert monitor.check_ring(clock.now) is None  # refused for under 0.5 s
                    time.sleep(0.6)
                    clock.now += 1
                    monitor.maybe_check()
                    clock.now += 0.3  # warned less than a threshold ago
                    assert monitor.check_ring(clock.now) is None
                    clock.now += 0.3
                    block = monitor.check_ring(clock.now)
                    assert block is not None and block.seconds >= 0.5
                    assert [h.who for h in block.holders] == [str(pid)]
                assert worker.rotate() == (1, 0, 2)
                clock.now += 1
                assert monitor.check_ring(clock.now) is None
        finally:
            worker.close()
    first, second = ring_warnings()
    text = first.getMessage()
    for phrase in (
        "rotations of pgskip.jobs' slots have been refused a slot's lock for",
        f"held by backend pid {pid} (user=postgres, application_name='django-shell'",
        # The worker role may not see a superuser's session's state, query or start.
        "state=unknown (not visible to this role)",
        "no slot is emptied while it lasts",
        f"SELECT pg_terminate_backend({pid})",
    ):
        assert phrase in text, phrase
    assert first.__dict__["holder"] == str(pid) and first.__dict__["blocked_seconds"] >= 0.5
    assert second.getMessage().startswith("rotations of")


def test_a_reader_that_took_over_the_slots_is_named_as_their_holder(
    store: Store, db_url: str
) -> None:
    """Reports back to back: the second began after the first refusal, and holds the slots
    once the first has ended; the ring stays blocked, and the second is named."""
    finished_slot_behind(store, db_url)
    with psycopg.connect(db_url, application_name="first-report") as first:
        first.execute("SELECT count(*) FROM pgskip.jobs")
        assert store.rotate() == (0, 0, 2)  # refused: blocked from now on
        second = psycopg.connect(db_url, application_name="second-report")
        second.execute("SELECT count(*) FROM pgskip.jobs")
    try:
        assert store.rotate() == (0, 0, 2)  # the second holds the slots now
        time.sleep(1.1)
        block = read_ring_block(store)
        assert block is not None and block.seconds >= 1.0
        assert [h.application_name for h in block.holders] == ["second-report"]
    finally:
        second.close()
    assert store.rotate() == (1, 0, 2)
    assert read_ring_block(store) is None
