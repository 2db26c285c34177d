"""Celery schedules as data PostgreSQL can evaluate, and the slots they produce.

A *slot* is an instant at which celery beat, running punctually and without interruption since
the entry was synced, would send the entry's message. ``pgskip beat-sync`` turns every
``beat_schedule`` entry into one of three specs, stored in ``<schema>.beat_entries`` and evaluated
by the SQL function ``<schema>.fire_due()`` with the same rules as :func:`next_slot` below:

``crontab``
    The five field sets exactly as Celery expands them (``crontab.minute`` ... with Sunday = 0).
    A slot is a wall-clock time in the app's ``timezone`` where *all* fields match (Celery ANDs
    day-of-month and day-of-week; classic cron ORs them). The next slot after a run at instant
    ``t`` is the earliest matching wall time later than the wall time of ``t``, converted back to
    an instant the way Celery's ``zoneinfo`` arithmetic does (``fold=0``): a wall time that occurs
    twice when clocks go back fires once, at its first occurrence; a wall time skipped when clocks
    go forward fires at the instant it would have had under the old offset (02:30 in a gap fires
    at 03:30 new time), after which the sequence continues from the new wall time.

``interval`` (numbers, ``timedelta``, ``schedule(...)``, ``relative`` below one day)
    ``first + k * every`` for k = 0, 1, ... in elapsed time (DST does not stretch it). ``first``
    is one period after the sync (beat's first run is one period after it starts); after a
    late run, ``fire_due()`` moves it to one period after that run, as beat counts from its
    last run (:mod:`kombu_pgskip.periodic`). For ``relative=True`` Celery rounds each run down
    to the minute or hour, which makes the effective period ``every`` rounded down to whole
    minutes or hours and aligns ``first`` to that boundary (computed with Celery's own
    ``remaining(..., relative=True)``); those keep their alignment after a late run.

``days`` (``relative`` of one day or more)
    Local midnight every ``every_days`` calendar days, starting at Celery's first rounded
    deadline after the sync.

Anything else (``solar``, custom schedule classes, a custom ``nowfun``) is refused with the
reason: PostgreSQL could not reproduce it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC = timezone.utc
# The longest stretch without a matching date a valid crontab can have: 29 February on a given
# weekday recurs within 40 years (the century rule included).
_MAX_SEARCH_DAYS = 366 * 41


class Refused(ValueError):
    """A schedule PostgreSQL cannot evaluate with Celery's meaning; ``str()`` says why."""


@dataclass(frozen=True)
class CrontabSpec:
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_week: tuple[int, ...]  # Sunday = 0, as Celery
    days_of_month: tuple[int, ...]
    months: tuple[int, ...]

    kind = "crontab"

    @property
    def key(self) -> str:
        """What identifies the schedule (not its start): a change restarts the sequence."""
        return "crontab " + " ".join(
            ",".join(map(str, f))
            for f in (self.minutes, self.hours, self.days_of_month, self.months, self.days_of_week)
        )

    def describe(self) -> str:
        return (
            "crontab("
            + " ".join(
                _compact(f, full)
                for f, full in (
                    (self.minutes, range(60)),
                    (self.hours, range(24)),
                    (self.days_of_month, range(1, 32)),
                    (self.months, range(1, 13)),
                    (self.days_of_week, range(7)),
                )
            )
            + ")"
        )


@dataclass(frozen=True)
class IntervalSpec:
    every: timedelta
    first: datetime  # UTC; slots are first + k * every, k >= 0
    key: str

    kind = "interval"

    def describe(self) -> str:
        return self.key


@dataclass(frozen=True)
class DaysSpec:
    every_days: int
    first: datetime  # UTC instant of the first local midnight
    key: str

    kind = "days"

    def describe(self) -> str:
        return self.key


Spec = CrontabSpec | IntervalSpec | DaysSpec


def _compact(values: tuple[int, ...], full: range) -> str:
    if set(values) == set(full):
        return "*"
    return ",".join(map(str, values))


def _human(delta: timedelta) -> str:
    secs = delta.total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if secs >= size and secs % size == 0:
            n = int(secs // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    text = f"{secs:g}"
    return f"{text} second{'s' if text != '1' else ''}"


def zone(tz: tzinfo | str) -> ZoneInfo:
    """The app's timezone as a named IANA zone (PostgreSQL needs the name), or refuse."""
    if isinstance(tz, ZoneInfo):
        return tz
    if tz is UTC:
        return ZoneInfo("UTC")
    name = tz if isinstance(tz, str) else getattr(tz, "key", None) or getattr(tz, "zone", None)
    if isinstance(name, str):
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            pass
    raise Refused(
        f"the app's timezone {tz!r} has no IANA name; set app.conf.timezone to one such as "
        "'Europe/Berlin' or 'UTC'"
    )


def spec_for(schedule: Any, *, tz: ZoneInfo, now: datetime, relative: bool = False) -> Spec:
    """The spec of a ``beat_schedule`` entry's ``schedule`` (and ``relative`` flag).

    ``now`` is the sync time (the database's clock): interval entries start one period later.
    Raises :class:`Refused` naming the reason when the schedule cannot be honoured.
    """
    from celery.schedules import crontab, solar
    from celery.schedules import schedule as interval_schedule

    if isinstance(schedule, bool):
        raise Refused(f"schedule {schedule!r} is not a number, timedelta or Celery schedule")
    if isinstance(schedule, (int, float)):
        return _interval_spec(timedelta(seconds=schedule), relative, tz, now)
    if isinstance(schedule, timedelta):
        return _interval_spec(schedule, relative, tz, now)
    if isinstance(schedule, solar):
        raise Refused(
            "solar schedules follow the sun's position, which PostgreSQL cannot compute; "
            "use a crontab with fixed times, or keep running celery beat for this entry"
        )
    if type(schedule) is crontab:
        _refuse_nowfun(schedule)
        return CrontabSpec(
            minutes=tuple(sorted(schedule.minute)),
            hours=tuple(sorted(schedule.hour)),
            days_of_week=tuple(sorted(schedule.day_of_week)),
            days_of_month=tuple(sorted(schedule.day_of_month)),
            months=tuple(sorted(schedule.month_of_year)),
        )
    if type(schedule) is interval_schedule:
        _refuse_nowfun(schedule)
        return _interval_spec(schedule.run_every, bool(schedule.relative), tz, now)
    raise Refused(
        f"schedule class {type(schedule).__module__}.{type(schedule).__qualname__} is not "
        "one PostgreSQL can evaluate (supported: numbers, timedelta, celery.schedules.schedule "
        "and crontab)"
    )


def _refuse_nowfun(schedule: Any) -> None:
    if getattr(schedule, "nowfun", None) is not None:
        raise Refused(
            "the schedule has a custom nowfun, which PostgreSQL cannot call; the app's "
            "timezone setting is honoured without it"
        )


def _interval_spec(every: timedelta, relative: bool, tz: ZoneInfo, now: datetime) -> Spec:
    if every <= timedelta(0):
        raise Refused(f"interval {every} is not positive (celery beat would send it continuously)")
    now = now.astimezone(UTC)
    if not relative:
        if every >= timedelta(seconds=1) and now.microsecond:
            # Whole seconds read better in beat-list; beat's own start is arbitrary anyway.
            now = now.replace(microsecond=0) + timedelta(seconds=1)
        return IntervalSpec(every=every, first=now + every, key=f"every {_human(every)}")
    if every < timedelta(seconds=1):
        raise Refused(
            f"relative interval {every} is shorter than the one second Celery rounds relative "
            "schedules to (celery beat would send it continuously)"
        )
    from celery.utils.time import remaining

    # Celery's own rounding gives the first run; later runs keep that alignment.
    local_now = now.astimezone(tz)
    # (Elapsed-time addition in UTC: aware local + timedelta would be wall-clock arithmetic.)
    first = now + remaining(local_now, every, local_now, relative=True)
    key = f"every {_human(every)}, relative"
    if every >= timedelta(days=1):
        days = int(every // timedelta(days=1))
        key += f" (local midnight every {_human(timedelta(days=days))})"
        return DaysSpec(every_days=days, first=first, key=key)
    if every >= timedelta(hours=1):
        unit = timedelta(hours=1)
    elif every >= timedelta(minutes=1):
        unit = timedelta(minutes=1)
    else:
        unit = timedelta(seconds=1)
    effective = unit * int(every // unit)
    if effective != every:
        key += f" (runs every {_human(effective)})"
    return IntervalSpec(every=effective, first=first, key=key)


# -- slots -------------------------------------------------------------------------------------


def local_to_utc(wall: datetime, tz: ZoneInfo) -> datetime:
    """A naive wall time in ``tz`` as an instant, as Celery's zoneinfo arithmetic does (fold=0)."""
    return wall.replace(tzinfo=tz, fold=0).astimezone(UTC)


def _day_matches(spec: CrontabSpec, d: date) -> bool:
    return (
        d.month in spec.months
        and d.day in spec.days_of_month
        and d.isoweekday() % 7 in spec.days_of_week
    )


def _first_time_after(spec: CrontabSpec, d: date, after: datetime | None) -> datetime | None:
    """The first matching wall time on date ``d`` strictly after the naive ``after``."""
    for h in spec.hours:
        for m in spec.minutes:
            cand = datetime.combine(d, time(h, m))
            if after is None or cand > after:
                return cand
    return None


def cron_next(spec: CrontabSpec, tz: ZoneInfo, after: datetime) -> datetime | None:
    """The first crontab slot strictly after the instant ``after`` (None: never again)."""
    wall = after.astimezone(tz).replace(tzinfo=None)
    d = wall.date()
    floor: datetime | None = wall
    for _ in range(_MAX_SEARCH_DAYS):
        if _day_matches(spec, d):
            cand = _first_time_after(spec, d, floor)
            while cand is not None:
                slot = local_to_utc(cand, tz)
                if slot > after:
                    return slot
                # Only when starting inside a repeated hour: that wall time's first occurrence
                # is already past; look further.
                cand = _first_time_after(spec, d, cand)
        d += timedelta(days=1)
        floor = None
    return None


def next_slot(spec: Spec, tz: ZoneInfo, after: datetime) -> datetime | None:
    """The first slot of ``spec`` strictly after the instant ``after``."""
    after = after.astimezone(UTC)
    if isinstance(spec, CrontabSpec):
        return cron_next(spec, tz, after)
    if isinstance(spec, IntervalSpec):
        if after < spec.first:
            return spec.first
        every_us = _micros(spec.every)
        k = _micros(after - spec.first) // every_us + 1
        return spec.first + timedelta(microseconds=k * every_us)
    first_day = spec.first.astimezone(tz).date()
    if after < spec.first:
        return spec.first
    d = after.astimezone(tz).date()
    k = max(0, math.ceil((d - first_day).days / spec.every_days))
    while True:
        cand = local_to_utc(
            datetime.combine(first_day + timedelta(days=k * spec.every_days), time()), tz
        )
        if cand > after:
            return cand
        k += 1


def slots(spec: Spec, tz: ZoneInfo, after: datetime, until: datetime) -> Iterator[datetime]:
    """Every slot in ``(after, until]``, in order."""
    current: datetime | None = after
    while current is not None:
        current = next_slot(spec, tz, current)
        if current is None or current > until:
            return
        yield current


def _micros(delta: timedelta) -> int:
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
