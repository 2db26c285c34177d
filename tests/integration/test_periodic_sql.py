"""The SQL evaluator (migrations/0002_periodic.sql) gives the slots of kombu_pgskip.schedule_spec,
which tests/unit/test_schedule_semantics.py proves are Celery's: over a year, across DST."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import psycopg
import pytest
from celery.schedules import crontab

from kombu_pgskip.schedule_spec import CrontabSpec, local_to_utc, slots, spec_for

UTC = timezone.utc
YEAR = (datetime(2024, 1, 1, tzinfo=UTC), datetime(2025, 1, 1, tzinfo=UTC))


def _sql_crontab_slots(
    conn: psycopg.Connection[tuple[object, ...]],
    spec: CrontabSpec,
    tz: str,
    start: datetime,
    end: datetime,
) -> list[datetime]:
    rows = conn.execute(
        """
        WITH RECURSIVE s(t) AS (
            SELECT pgskip.beat_cron_next(%(start)s, %(tz)s, %(mi)s, %(h)s, %(dow)s, %(dom)s, %(mo)s)
            UNION ALL
            SELECT pgskip.beat_cron_next(t, %(tz)s, %(mi)s, %(h)s, %(dow)s, %(dom)s, %(mo)s)
              FROM s WHERE t <= %(end)s
        )
        SELECT t FROM s WHERE t <= %(end)s
        """,
        {
            "start": start,
            "end": end,
            "tz": tz,
            "mi": list(spec.minutes),
            "h": list(spec.hours),
            "dow": list(spec.days_of_week),
            "dom": list(spec.days_of_month),
            "mo": list(spec.months),
        },
    ).fetchall()
    return [r[0].astimezone(UTC) for r in rows]  # type: ignore[attr-defined]


@pytest.mark.parametrize("tz", ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"])
def test_sql_crontab_slots_over_a_year_match(db_url: str, tz: str) -> None:
    z = ZoneInfo(tz)
    with psycopg.connect(db_url) as conn:
        for fields in (
            {"minute": "30", "hour": "2"},
            {"minute": "0", "hour": "0"},
            {"minute": "*/15", "hour": "1-3"},
            {"minute": "5", "hour": "3", "day_of_month": "1-7", "day_of_week": "mon"},
            {"minute": "0", "hour": "0", "day_of_month": "29", "month_of_year": "2"},
        ):
            spec = spec_for(crontab(**fields), tz=z, now=YEAR[0])
            assert isinstance(spec, CrontabSpec)
            expected = list(slots(spec, z, *YEAR))
            assert _sql_crontab_slots(conn, spec, tz, *YEAR) == expected, fields


def test_sql_every_minute_crontab_around_dst_changes_matches(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        for tz, days in (("Europe/Berlin", [(3, 31), (10, 27)]),
                         ("America/New_York", [(3, 10), (11, 3)])):  # fmt: skip
            z = ZoneInfo(tz)
            for month, day in days:
                start = datetime(2024, month, day, tzinfo=z).astimezone(UTC) - timedelta(hours=3)
                end = start + timedelta(hours=8)
                for fields in ({"minute": "*"}, {"minute": "*", "hour": "2"}):
                    spec = spec_for(crontab(**fields), tz=z, now=start)
                    assert isinstance(spec, CrontabSpec)
                    got = _sql_crontab_slots(conn, spec, tz, start, end)
                    assert got == list(slots(spec, z, start, end)), (tz, month, fields)


def test_sql_wall_time_conversion_is_zoneinfo_fold_zero(db_url: str) -> None:
    """PostgreSQL's own AT TIME ZONE picks the second of two repeated wall times; ours the first."""
    cases: list[tuple[str, datetime]] = []
    for tz, day in (
        ("Europe/Berlin", datetime(2024, 3, 31)),
        ("Europe/Berlin", datetime(2024, 10, 27)),
        ("America/New_York", datetime(2024, 11, 3)),
        ("Australia/Lord_Howe", datetime(2024, 4, 7)),
        ("Australia/Lord_Howe", datetime(2024, 10, 6)),
    ):
        cases += [(tz, day + timedelta(minutes=5 * i)) for i in range(12 * 5)]
    with psycopg.connect(db_url) as conn:
        got = conn.execute(
            "SELECT pgskip.beat_local_to_utc(w, tz) FROM unnest(%s::text[], %s::timestamp[])"
            " AS c(tz, w)",
            ([c[0] for c in cases], [c[1] for c in cases]),
        ).fetchall()
    expected = [local_to_utc(w, ZoneInfo(tz)) for tz, w in cases]
    assert [r[0].astimezone(UTC) for r in got] == expected  # type: ignore[attr-defined]
