"""The sweep's read of every running message (migration 0030).

sweep() reads every running row of ``jobs`` for the rows of consumers no longer known (a
consumers row deleted by hand, or left by a sweep that reached its batch limit). While a session
holds an old snapshot that read walks every row version that became running since, so a
worker's sweep makes it only where no sweep of the database began one ``ORPHAN_SCAN_EVERY_S``
ago, or where the last one left rows behind; the rows of consumers a sweep takes for dead are
read at once, and ``sweep(max_attempts)`` (pg_cron's job, ``pgskip tick``, a person) reads
every time.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from kombu_pgskip.store import SWEEP_BATCH, NewMessage, Store
from kombu_pgskip.sweeper import ORPHAN_SCAN_EVERY_S
from tests.helpers import running_orphans


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    try:
        yield s
    finally:
        s.close()


def _sweep(store: Store) -> tuple[int, int, int]:
    """A worker's sweep."""
    return store.sweep(max_attempts=20, scan_every=ORPHAN_SCAN_EVERY_S)


def _statuses(db_url: str, ids: list[int]) -> set[str]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT status::text FROM pgskip.jobs WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    return {str(r[0]) for r in rows}


def _move_clock(db_url: str, by: str) -> None:
    """As if the last read had begun ``by`` earlier."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.sweep_scans SET scanned_at = scanned_at - %s::interval", (by,))


def test_a_worker_s_sweep_reads_every_running_message_once_a_minute(
    store: Store, db_url: str
) -> None:
    first = running_orphans(db_url, 2)
    assert _sweep(store) == (2, 0, 0)
    assert _statuses(db_url, first) == {"pending"}
    later = running_orphans(db_url, 1)
    assert _sweep(store) == (0, 0, 0)  # a read began less than a minute ago
    assert _statuses(db_url, later) == {"running"}
    _move_clock(db_url, f"{ORPHAN_SCAN_EVERY_S - 10} seconds")
    assert _sweep(store) == (0, 0, 0)
    _move_clock(db_url, "11 seconds")
    assert _sweep(store) == (1, 0, 0)
    assert _statuses(db_url, later) == {"pending"}


def test_sweep_with_max_attempts_alone_reads_every_time(store: Store, db_url: str) -> None:
    assert _sweep(store) == (0, 0, 0)  # a read just began
    orphans = running_orphans(db_url, 1)
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT * FROM pgskip.sweep(20)").fetchone() == (1, 0, 0, 0)
    assert _statuses(db_url, orphans) == {"pending"}
    running_orphans(db_url, 1)
    assert store.sweep(max_attempts=20) == (1, 0, 0)


def test_the_messages_of_a_consumer_taken_for_dead_go_back_at_once(
    store: Store, db_url: str
) -> None:
    assert _sweep(store) == (0, 0, 0)  # a read just began
    consumer = uuid.uuid4()
    store.register_consumer(consumer, hostname="w", queues=["q"], lease=30)
    store.publish(NewMessage("q", 0, "pending", None, "{}", "t", "1", None))
    (row,) = store.fetch(["q"], 1, consumer)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.consumers SET lease_until = now() - interval '1 second'")
    assert _sweep(store) == (1, 0, 1)
    assert _statuses(db_url, [row.id]) == {"pending"}


def test_a_read_that_reached_the_batch_limit_goes_on_at_the_next_sweep(
    store: Store, db_url: str
) -> None:
    orphans = running_orphans(db_url, SWEEP_BATCH + 5)
    assert _sweep(store) == (SWEEP_BATCH, 0, 0)
    assert _sweep(store) == (5, 0, 0)
    assert _statuses(db_url, orphans) == {"pending"}
    running_orphans(db_url, 1)
    assert _sweep(store) == (0, 0, 0)  # that read left nothing behind


def test_a_read_dated_ahead_of_the_server_clock_stops_no_read(store: Store, db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.sweep_scans SET scanned_at = 'infinity'")
    orphans = running_orphans(db_url, 1)
    assert _sweep(store) == (1, 0, 0)
    assert _statuses(db_url, orphans) == {"pending"}


def test_a_sweep_that_does_not_read_them_scans_no_index_of_running_messages(
    db_url: str,
) -> None:
    """The whole point: the read is skipped, not filtered row by row. The plan of sweep()'s
    statement (auto_explain, as PostgreSQL ran it): every scan of a slot's running rows is
    never executed."""
    running_orphans(db_url, 3)
    plans: list[str] = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT * FROM pgskip.sweep(20, '1 minute')").fetchone() == (
            3, 0, 0, 0,
        )  # fmt: skip
        for setting in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_analyze = on",
            "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_level = notice",
        ):
            conn.execute(setting)
        conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
        assert conn.execute("SELECT * FROM pgskip.sweep(20, '1 minute')").fetchone() == (
            0, 0, 0, 0,
        )  # fmt: skip
        reads = _reads_of_running_rows(plans)
        assert len(reads) >= 9, reads  # the eight slots and jobs_kept
        assert all(r.endswith("(never executed)") for r in reads), reads
        plans.clear()
        conn.execute("UPDATE pgskip.sweep_scans SET scanned_at = '-infinity'")
        conn.execute("SELECT * FROM pgskip.sweep(20, '1 minute')")
        reads = _reads_of_running_rows(plans)
        assert len(reads) >= 9 and not any("never executed" in r for r in reads), reads


def _reads_of_running_rows(plans: list[str]) -> list[str]:
    """The scan nodes of ``jobs``' partitions in the plan of sweep()'s read (CTE lost)."""
    (plan,) = [p for p in plans if "CTE lost" in p]
    lost = plan[plan.index("CTE lost") : plan.index("CTE looked")]
    return re.findall(r"\S*Scan\b.* on jobs_\w+ .*", lost)
