"""The slots of every schedule form are the runs celery beat would make, DST included.

The reference is Celery itself: a punctual beat is simulated by asking Celery's own ``crontab`` /
``schedule`` objects for the next run after each run (``remaining_estimate`` with ``now`` at the
last run, as beat does right after sending). ``kombu_pgskip.schedule_spec`` must produce the same
instants; the SQL evaluator is checked against it in tests/integration/test_periodic_sql.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar

from kombu_pgskip.schedule_spec import (
    CrontabSpec,
    DaysSpec,
    IntervalSpec,
    Refused,
    local_to_utc,
    next_slot,
    slots,
    spec_for,
    zone,
)

UTC = timezone.utc
YEAR = (datetime(2024, 1, 1, tzinfo=UTC), datetime(2025, 1, 1, tzinfo=UTC))
ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]


def _app(tz: str) -> Celery:
    app = Celery(set_as_current=False, broker="memory://")
    app.conf.timezone = tz
    return app


def celery_runs(sched: Any, start: datetime, end: datetime) -> list[datetime]:
    """The instants a punctual celery beat started at ``start`` would send the entry."""
    runs: list[datetime] = []
    last = start.astimezone(sched.tz)
    while True:
        current = last
        sched.nowfun = lambda current=current: current
        nxt = current.astimezone(UTC) + sched.remaining_estimate(current)
        assert nxt > current.astimezone(UTC), "Celery's schedule did not advance"
        if nxt > end:
            return runs
        runs.append(nxt)
        last = nxt.astimezone(sched.tz)


CRONTABS = [
    {"minute": "0", "hour": "0"},  # nightly
    {"minute": "30", "hour": "2"},  # inside the DST gap / repeated hour in Europe and the US
    {"minute": "0,30", "hour": "2"},
    {"minute": "*/15", "hour": "1-3"},
    {"minute": "0"},  # hourly
    {"minute": "59", "hour": "1,2"},
    {"minute": "0", "hour": "2", "day_of_week": "sun"},  # the DST Sundays themselves
    # Celery ANDs day of month and day of week: the first Monday of each month.
    {"minute": "5", "hour": "3", "day_of_month": "1-7", "day_of_week": "mon"},
    {"minute": "0", "hour": "12", "day_of_month": "31"},  # months without a 31st
    {"minute": "0", "hour": "0", "day_of_month": "29", "month_of_year": "2"},  # leap day
    {"minute": "*/20", "hour": "*/6", "day_of_week": "mon-fri", "month_of_year": "3,10,11"},
]


@pytest.mark.parametrize("tz", ZONES)
@pytest.mark.parametrize(
    "fields", CRONTABS, ids=lambda f: " ".join(f"{k}={v}" for k, v in f.items())
)
def test_crontab_slots_over_a_year_are_celerys_runs(tz: str, fields: dict[str, str]) -> None:
    app = _app(tz)
    expected = celery_runs(crontab(app=app, **fields), *YEAR)
    spec = spec_for(crontab(**fields), tz=ZoneInfo(tz), now=YEAR[0])
    assert list(slots(spec, ZoneInfo(tz), *YEAR)) == expected


# The 2024 DST changes (local date) of the zones with DST above.
DST_DAYS = {
    "Europe/Berlin": [(3, 31), (10, 27)],
    "America/New_York": [(3, 10), (11, 3)],
    "Australia/Lord_Howe": [(4, 7), (10, 6)],  # a 30-minute shift
}


@pytest.mark.parametrize("tz", sorted(DST_DAYS))
def test_every_minute_crontab_across_both_dst_changes(tz: str) -> None:
    app = _app(tz)
    z = ZoneInfo(tz)
    for month, day in DST_DAYS[tz]:
        start = datetime(2024, month, day, tzinfo=z).astimezone(UTC) - timedelta(hours=6)
        end = start + timedelta(hours=36)
        for fields in (
            {"minute": "*"},
            {"minute": "*", "hour": "2"},
            {"minute": "*/7", "hour": "1-3"},
        ):
            expected = celery_runs(crontab(app=app, **fields), start, end)
            spec = spec_for(crontab(**fields), tz=z, now=start)
            assert list(slots(spec, z, start, end)) == expected, (month, fields)


def test_crontab_repeated_hour_fires_once_and_skipped_time_fires_after_the_jump() -> None:
    z = ZoneInfo("Europe/Berlin")
    spec = spec_for(crontab(minute=30, hour=2), tz=z, now=YEAR[0])
    # 31 March 2024: 02:30 does not exist; it fires at 03:30 CEST (01:30 UTC).
    spring = next_slot(spec, z, datetime(2024, 3, 30, 12, tzinfo=UTC))
    assert spring == datetime(2024, 3, 31, 1, 30, tzinfo=UTC)
    # 27 October 2024: 02:30 happens twice; only the first (CEST, 00:30 UTC) fires.
    autumn = list(slots(spec, z, datetime(2024, 10, 26, 12, tzinfo=UTC),
                        datetime(2024, 10, 28, 12, tzinfo=UTC)))  # fmt: skip
    assert autumn == [
        datetime(2024, 10, 27, 0, 30, tzinfo=UTC),
        datetime(2024, 10, 28, 1, 30, tzinfo=UTC),
    ]


INTERVALS = [
    (10, False),
    (0.5, False),
    (timedelta(minutes=90), False),
    (timedelta(hours=25), False),
    (timedelta(days=2), False),
    (30, True),
    (1.5, True),
    (90, True),
    (timedelta(minutes=45), True),
    (timedelta(minutes=90), True),  # Celery's relative rounding makes this hourly
    (timedelta(hours=1), True),
    (timedelta(hours=2), True),
    (timedelta(days=1), True),
    (timedelta(days=2.5), True),
]


# A week before, and minutes before, each 2024 DST change in Europe and the US.
STARTS = [
    datetime(2024, 3, 8, 10, 17, 23, tzinfo=UTC),
    datetime(2024, 3, 10, 6, 55, 1, tzinfo=UTC),
    datetime(2024, 3, 28, 0, 59, 59, tzinfo=UTC),
    datetime(2024, 3, 31, 0, 55, 1, tzinfo=UTC),
    datetime(2024, 10, 25, 0, 59, 59, tzinfo=UTC),
    datetime(2024, 10, 27, 0, 55, 1, tzinfo=UTC),
    datetime(2024, 11, 1, 7, 31, tzinfo=UTC),
    datetime(2024, 11, 3, 5, 55, 1, tzinfo=UTC),
]


@pytest.mark.parametrize("tz", ["Europe/Berlin", "America/New_York", "Asia/Kolkata", "UTC"])
@pytest.mark.parametrize("every,relative", INTERVALS, ids=lambda v: str(v))
def test_interval_slots_across_dst_are_celerys_runs(tz: str, every: Any, relative: bool) -> None:
    app = _app(tz)
    z = ZoneInfo(tz)
    period = every if isinstance(every, timedelta) else timedelta(seconds=every)
    for start in STARTS:
        end = start + min(timedelta(days=9), period * 1500)
        expected = celery_runs(schedule(every, relative=relative, app=app), start, end)
        spec = spec_for(every, tz=z, now=start, relative=relative)
        assert list(slots(spec, z, start, end)) == expected, start


def test_relative_schedules_map_to_the_effective_period() -> None:
    z = ZoneInfo("Europe/Berlin")
    now = datetime(2024, 5, 1, 10, 17, 23, tzinfo=UTC)
    hourly = spec_for(timedelta(minutes=90), tz=z, now=now, relative=True)
    assert isinstance(hourly, IntervalSpec) and hourly.every == timedelta(hours=1)
    assert hourly.first == datetime(2024, 5, 1, 11, 0, tzinfo=UTC)
    assert "runs every 1 hour" in hourly.describe()
    daily = spec_for(timedelta(days=2.5), tz=z, now=now, relative=True)
    assert isinstance(daily, DaysSpec) and daily.every_days == 2
    assert daily.first.astimezone(z).time().isoformat() == "00:00:00"


def test_interval_starts_one_period_after_the_sync_on_a_whole_second() -> None:
    now = datetime(2024, 5, 1, 10, 17, 23, 400000, tzinfo=UTC)
    spec = spec_for(timedelta(minutes=5), tz=ZoneInfo("UTC"), now=now)
    assert isinstance(spec, IntervalSpec)
    assert spec.first == datetime(2024, 5, 1, 10, 22, 24, tzinfo=UTC)
    assert next_slot(spec, ZoneInfo("UTC"), spec.first) == spec.first + timedelta(minutes=5)


def test_crontab_spec_keeps_celerys_expanded_fields() -> None:
    spec = spec_for(crontab(minute="*/20", hour="9-17", day_of_week="mon-fri"),
                    tz=ZoneInfo("UTC"), now=YEAR[0])  # fmt: skip
    assert isinstance(spec, CrontabSpec)
    assert spec.minutes == (0, 20, 40)
    assert spec.hours == tuple(range(9, 18))
    assert spec.days_of_week == (1, 2, 3, 4, 5)
    assert spec.days_of_month == tuple(range(1, 32)) and spec.months == tuple(range(1, 13))
    assert spec.describe() == "crontab(0,20,40 9,10,11,12,13,14,15,16,17 * * 1,2,3,4,5)"


def test_local_to_utc_is_zoneinfo_fold_zero() -> None:
    z = ZoneInfo("America/New_York")
    # Repeated 01:30 on 3 November 2024: the first (EDT) occurrence.
    assert local_to_utc(datetime(2024, 11, 3, 1, 30), z) == datetime(2024, 11, 3, 5, 30, tzinfo=UTC)
    # Skipped 02:30 on 10 March 2024: the offset from before the change (EST).
    assert local_to_utc(datetime(2024, 3, 10, 2, 30), z) == datetime(2024, 3, 10, 7, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    "sched,reason",
    [
        (solar.__new__(solar), "solar schedules"),
        (0, "not positive"),
        (timedelta(seconds=-5), "not positive"),
        (crontab(nowfun=lambda: datetime.now(UTC)), "nowfun"),
        (object(), "schedule class builtins.object"),
        (True, "not a number"),
    ],
    ids=["solar", "zero", "negative", "nowfun", "custom-class", "bool"],
)
def test_schedules_postgresql_cannot_honour_are_refused_with_the_reason(
    sched: Any, reason: str
) -> None:
    with pytest.raises(Refused, match=reason):
        spec_for(sched, tz=ZoneInfo("UTC"), now=YEAR[0])


def test_sub_second_relative_interval_is_refused() -> None:
    with pytest.raises(Refused, match="one second"):
        spec_for(0.5, tz=ZoneInfo("UTC"), now=YEAR[0], relative=True)


def test_timezone_needs_an_iana_name() -> None:
    assert zone("Europe/Berlin") == ZoneInfo("Europe/Berlin")
    assert zone(timezone.utc) == ZoneInfo("UTC")
    with pytest.raises(Refused, match="IANA"):
        zone(timezone(timedelta(hours=2)))
