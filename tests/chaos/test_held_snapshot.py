"""A held snapshot: the worker names the session that holds the xmin horizon, and the bloat and
throughput effect is measured before, during and after (``bench/held_snapshot.py`` for the long
run; its figures are in docs/operations.md)."""

from __future__ import annotations

import logging
import re
import uuid

import psycopg
import pytest
from psycopg import sql

from bench.held_snapshot import HOLDER_APP, HOLDER_QUERY, held_snapshot, run
from kombu_pgskip.health import HorizonMonitor, read_holders, read_ring_block
from kombu_pgskip.store import Store
from kombu_pgskip.testing.embedded import EmbeddedPostgres
from tests.helpers import FakeClock, finished_slot_behind


def test_monitor_names_the_session_holding_the_horizon_and_throttles(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(db_url)
    clock = FakeClock()
    monitor = HorizonMonitor(store, threshold=10, clock=clock)
    try:
        assert monitor.maybe_check() == []  # nothing holds the horizon
        with held_snapshot(db_url) as pid, caplog.at_level(logging.WARNING):
            holders = read_holders(store)
            assert [h.who for h in holders if h.kind == "session"] == [str(pid)]
            for _ in range(2):  # seen, but not yet for 10 s
                clock.now += 6
                assert monitor.maybe_check() == []
            clock.now += 6
            (warned,) = monitor.maybe_check()
            assert warned.who == str(pid)
            clock.now += 6  # held on, but warned less than a threshold ago
            assert monitor.maybe_check() == []
            clock.now += 6
            assert [h.who for h in monitor.maybe_check()] == [str(pid)]
        (first, *_rest) = [
            r for r in caplog.records if r.__dict__.get("action") == "xmin_horizon_held"
        ]
        text = first.getMessage()
        assert f"backend pid {pid}" in text
        assert f"application_name={HOLDER_APP!r}" in text
        assert "user=postgres" in text and "state=idle in transaction" in text
        assert HOLDER_QUERY in text and "pg_terminate_backend" in text
        clock.now += 60  # the transaction ended: nothing to say
        assert monitor.maybe_check() == []
        assert monitor._first_seen == {}
    finally:
        store.close()


def test_monitor_names_a_prepared_transaction(
    restartable_pg: EmbeddedPostgres, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Prepared transactions need max_prepared_transactions > 0: a restart on, one off."""

    def set_prepared(value: str | None) -> None:
        with psycopg.connect(restartable_pg.dsn("postgres"), autocommit=True) as conn:
            if value is None:
                conn.execute("ALTER SYSTEM RESET max_prepared_transactions")
            else:
                conn.execute(f"ALTER SYSTEM SET max_prepared_transactions = {int(value)}")
        restartable_pg.restart()

    gid = f"pgskip-test-{uuid.uuid4().hex[:8]}"
    set_prepared("2")
    store = Store(db_url)
    try:
        finished_slot_behind(store, db_url)
        with psycopg.connect(db_url) as conn:
            conn.execute("INSERT INTO pgskip.queues (name) VALUES ('prepared')")
            conn.execute("SELECT count(*) FROM pgskip.jobs")  # its locks outlive the session
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        assert store.rotate() == (0, 0, 2)  # slot 1's lock refused
        clock = FakeClock()
        monitor = HorizonMonitor(store, threshold=10, clock=clock)
        with caplog.at_level(logging.WARNING):
            assert monitor.maybe_check() == []
            clock.now += 11
            (warned,) = monitor.maybe_check()
        assert (warned.kind, warned.who, warned.user) == ("prepared transaction", gid, "postgres")
        text = caplog.records[-1].getMessage()
        assert f"prepared transaction {gid!r}" in text and "ROLLBACK PREPARED" in text
        block = read_ring_block(store)
        assert block is not None
        assert [(h.kind, h.who, h.user) for h in block.holders] == [
            ("prepared transaction", gid, "postgres")
        ]
        assert f"held by prepared transaction {gid!r} (user=postgres" in block.describe("pgskip")
        assert f"ROLLBACK PREPARED {gid!r}" in block.describe("pgskip")
    finally:
        store.close()
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        set_prepared(None)


def test_monitor_is_off_when_the_threshold_is_zero(db_url: str) -> None:
    store = Store(db_url)
    try:
        with held_snapshot(db_url):
            monitor = HorizonMonitor(store, threshold=0, clock=FakeClock())
            assert not monitor.enabled and monitor.maybe_check() == []
    finally:
        store.close()


def test_held_snapshot_is_reported_and_its_bloat_is_measured(db_url: str) -> None:
    lines: list[str] = []
    result = run(
        db_url,
        rate=500,
        before=8,
        hold=15,
        after=8,
        threshold=5,
        probe=1500,
        lease_seconds=6,
        log=lines.append,
    )
    print("\n" + result.table())
    before, during, after = (result.phase(n) for n in ("before", "during", "after"))
    # The worker named the blocking session: pid, user, application, state, duration, query.
    assert result.warnings, "the worker logged no xmin-horizon warning"
    first = result.warnings[0]
    assert f"backend pid {result.holder_pid}" in first
    assert "user=postgres" in first and f"application_name={HOLDER_APP!r}" in first
    assert "state=idle in transaction" in first and HOLDER_QUERY in first
    held = [float(s) for s in re.findall(r"held for at least (\d+)s", first)]
    assert held and held[0] >= 5
    # Throttled: at most one warning per threshold for the same holder.
    assert len(result.warnings) <= 15 / 5 + 1
    # The flow went on in every phase, and everything was delivered in the end.
    assert before.throughput > 250 and during.throughput > 0 and after.throughput > 250
    assert result.left_at_end == 0
    # The effect: while held, VACUUM cannot remove the dead row versions of the messages that
    # went through; once released it can. (Growth per message and the burst drain rate are
    # printed, not asserted: on a shared CI machine they vary too much over seconds.)
    assert during.dead_not_removable > 5 * 1000
    # (a few may belong to statements in flight when VACUUM ran)
    assert before.dead_not_removable < 100 and after.dead_not_removable < 100
    with psycopg.connect(db_url) as conn:
        still = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (HOLDER_APP,)
        ).fetchone()
    assert still == (0,)
