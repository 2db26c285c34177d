"""The runs of a periodic entry never come in a burst: after `beat-sync` (which inserts the
slots up to the next tick itself, so that an interval entry first runs one interval after it,
as with celery beat), after a change, after a late tick and after an outage.

Celery's own example, ``add_periodic_task(10.0, say.s("hello"))``, used to print four hellos
within 3 ms at the first tick after `beat-sync`. Here `beat-sync` and pg_cron's ticks are
``fire_due(now)`` calls at chosen times; the real ticks are in tests/acceptance/test_cron_tick.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from celery.schedules import crontab

from kombu_pgskip.periodic import MissedPolicy, beat_sync
from tests.periodic_support import (
    beat_sync_as_of,
    fire,
    fired_slots,
    gaps,
    jobs,
    make_app,
    sent_times,
    sync_as_of,
)

UTC = timezone.utc
TEN_S = timedelta(seconds=10)
SCHEDULE = {
    "hello": {"task": "periodic_tests.add", "schedule": 10.0, "args": (1, 1)},
    "minutely": {"task": "periodic_tests.add", "schedule": crontab(), "args": (2, 2)},
}
NOON = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def _at(minutes: int, seconds: float) -> datetime:
    return NOON + timedelta(minutes=minutes, seconds=seconds)


@pytest.mark.parametrize("synced", [_at(0, 55), _at(0, 5)], ids=["5s-before-a-tick", "55s-before"])
def test_runs_keep_their_cadence_from_the_sync_on(db_url: str, synced: datetime) -> None:
    beat_sync_as_of(make_app(SCHEDULE, tz="UTC"), db_url, synced)
    for minute, jitter in ((1, 0.4), (2, 1.3), (3, 0.05)):  # three minutes of pg_cron ticks
        fire(db_url, _at(minute, jitter))
    horizon = _at(3, 0.05 + 90)
    # The first hello one interval after the sync, then every 10 s: none late, none early.
    hello = sent_times(db_url, "hello")
    assert hello == [synced + k * TEN_S for k in range(1, 100) if synced + k * TEN_S <= horizon]
    assert set(gaps(hello)) == {TEN_S}
    # The crontab entry on each minute after the sync.
    assert sent_times(db_url, "minutely") == [_at(m, 0) for m in (1, 2, 3, 4)]
    # One message per slot, sent at its slot (no countdown: due then).
    rows = jobs(db_url)
    assert len(rows) == len(hello) + 4 == len({r["task_id"] for r in rows})
    assert sorted(r["run_at"] for r in rows) == sorted([*hello, *sent_times(db_url, "minutely")])
    # Published, as beat would publish it, at its slot, though a tick stored it up to 90 s
    # ahead: that is its place in the queue once it is due (migration 0020).
    assert all(r["created_at"] == r["run_at"] for r in rows)


def test_a_tick_90_s_late_gives_one_late_run_then_the_cadence(db_url: str) -> None:
    beat_sync_as_of(make_app(SCHEDULE, tz="UTC"), db_url, _at(0, 5))
    fire(db_url, _at(2, 30.25))  # the 12:01 tick, 90 s late (the 12:02 one merged into it)
    fire(db_url, _at(3, 0.1))
    hello = sent_times(db_url, "hello")
    # Inserted by the sync: 12:00:15 to 12:01:25. The tick found 12:01:35 to 12:02:25 late: one
    # run at once stands for them, then every 10 s from the next whole second.
    on_time = [_at(0, 15) + k * TEN_S for k in range(8)]
    late = _at(2, 30.25)
    after = [_at(2, 41) + k * TEN_S for k in range(18) if _at(2, 41) + k * TEN_S <= _at(4, 30.1)]
    assert hello == [*on_time, late, *after]
    assert min(gaps(hello)) >= TEN_S
    assert fired_slots(db_url, "hello")[len(on_time)] == _at(2, 25)  # the late run's slot
    # The crontab's 12:02 was 30.25 s late and 12:03 only 29.75 s away: 12:03 stands for it.
    assert sent_times(db_url, "minutely") == [_at(1, 0), _at(3, 0), _at(4, 0)]


@pytest.mark.parametrize(
    "every,missed,resumed",
    [
        (10.0, "latest", [_at(20, 0.4), _at(20, 11), _at(20, 21)]),
        # A 10-second entry's newest missed slot is within the grace: it runs anyway.
        (10.0, "skip", [_at(20, 0.4), _at(20, 11), _at(20, 21)]),
        (300.0, "latest", [_at(20, 0.4)]),  # and then 12:25:01
        (300.0, "skip", [_at(20, 5)]),  # 12:15:05 missed by 295 s: on the grid again
    ],
)
def test_after_an_outage_an_interval_entry_runs_once_then_every_interval(
    db_url: str, every: float, missed: str, resumed: list[datetime]
) -> None:
    app = make_app(
        {"e": {"task": "periodic_tests.add", "schedule": every, "args": (1, 1)}}, tz="UTC"
    )
    beat_sync_as_of(app, db_url, _at(0, 5), policy=MissedPolicy(missed=missed))
    before = sent_times(db_url, "e")
    fire(db_url, _at(20, 0.4), lookahead=timedelta(seconds=25))  # pg_cron down 12:01-12:20
    after = sent_times(db_url, "e")[len(before) :]
    assert after == resumed
    assert all(gap >= timedelta(seconds=every) for gap in gaps(before + after))


def _sync_clock(url: str, entry: str) -> datetime:
    """When the latest sync's transaction ran (its fired slots record it)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT max(fired_at) FROM pgskip.beat_slots WHERE entry = %s", (entry,)
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _db_now(url: str) -> datetime:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _next_minute(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)


def test_beat_sync_fires_up_to_the_next_tick_and_a_change_keeps_the_pace(db_url: str) -> None:
    app = make_app({"hello": SCHEDULE["hello"]}, tz="UTC")
    before = _db_now(db_url)
    beat_sync(app, db_url, "pgskip", use_cron=False)
    hello = sent_times(db_url, "hello")
    # The first hello one interval after the sync (on a whole second), then every 10 s until
    # half a minute after the next minute's tick, waiting as scheduled rows.
    assert before + TEN_S <= hello[0] <= before + TEN_S + timedelta(seconds=2)
    assert set(gaps(hello)) == {TEN_S}
    tick = _next_minute(_sync_clock(db_url, "hello"))
    assert hello[-1] <= tick + timedelta(seconds=30) < hello[-1] + TEN_S
    assert [j["status"] for j in jobs(db_url)] == ["scheduled"] * len(hello)

    # A changed message replaces the waiting ones, at the same times.
    waiting = {j["task_id"] for j in jobs(db_url)}
    app.conf.beat_schedule = {"hello": {**SCHEDULE["hello"], "args": (5, 5)}}
    (change,) = beat_sync(app, db_url, "pgskip", use_cron=False).changes
    assert change.sign == "~"
    assert f"next run {hello[0].astimezone(UTC).isoformat(sep=' ')}" in change.detail
    assert sent_times(db_url, "hello")[: len(hello)] == hello
    assert not waiting & {j["task_id"] for j in jobs(db_url)}
    assert {tuple(j["body"][0]) for j in jobs(db_url)} == {(5, 5)}

    # A changed interval starts one new interval after that sync: what the old one would have
    # sent after it is gone.
    app.conf.beat_schedule = {"hello": {**SCHEDULE["hello"], "schedule": 15.0}}
    before = _db_now(db_url)
    beat_sync(app, db_url, "pgskip", use_cron=False)
    synced = _sync_clock(db_url, "hello")
    new = [t for t in sent_times(db_url, "hello") if t > synced]
    assert before + timedelta(seconds=15) <= new[0] <= before + timedelta(seconds=17)
    assert set(gaps(new)) == {timedelta(seconds=15)}

    # The next tick, a little late, goes on where the sync stopped.
    fire(db_url, _next_minute(synced) + timedelta(seconds=0.5))
    later = [t for t in sent_times(db_url, "hello") if t >= new[0]]
    assert len(later) > len(new) and set(gaps(later)) == {timedelta(seconds=15)}


def test_a_relative_entry_keeps_to_the_wall_clock_after_a_late_tick(db_url: str) -> None:
    app = make_app(
        {
            "hourly": {
                "task": "periodic_tests.add",
                "schedule": 3600.0,
                "relative": True,
                "args": (3, 3),
            }
        },
        tz="UTC",
    )
    sync_as_of(app, db_url, _at(0, 5))  # relative: on the hour, from 13:00
    fire(db_url, _at(61, 30))  # 13:00 found 90 s late
    fire(db_url, _at(120, 0.2))
    assert sent_times(db_url, "hourly") == [_at(61, 30), _at(120, 0.2)]
    assert fired_slots(db_url, "hourly") == [_at(60, 0), _at(120, 0)]
