"""fire_due(): the right slots, the right messages, exactly once, and the missed-slot policy.

Firing is driven by calling ``pgskip.fire_due(now)`` with explicit times, as pg_cron would each
minute; one real pg_cron tick is in tests/acceptance/test_cron_tick.py.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import psycopg
import pytest
from celery.schedules import crontab

from kombu_pgskip.periodic import MissedPolicy, fire_due, list_entries, plan_entries
from kombu_pgskip.schedule_spec import slots
from tests.periodic_support import fire, fired_slots, jobs, make_app, sync_as_of

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
# Sunday 27 October 2024: clocks in Berlin go back from 03:00 CEST to 02:00 CET (01:00 UTC).
DST_START = datetime(2024, 10, 26, 22, 0, tzinfo=UTC)

SCHEDULE = {
    "quarter-hourly-at-night": {
        "task": "periodic_tests.add", "schedule": crontab(minute="*/15", hour="1-3"),
        "args": (1, 2),
    },
    "every-10s": {
        "task": "periodic_tests.add", "schedule": 10, "args": (3, 4),
        "options": {"queue": "fast", "priority": 5, "expires": 30},
    },
    "every-90min": {
        "task": "periodic_tests.add", "schedule": timedelta(minutes=90), "args": (5, 6),
    },
}  # fmt: skip


def test_minutely_firing_inserts_exactly_the_schedules_slots(db_url: str) -> None:
    app = make_app(SCHEDULE)
    sync_as_of(app, db_url, DST_START)
    plans = {p.name: p for p in plan_entries(app, now=DST_START)}
    end = DST_START + timedelta(hours=6)
    minute = DST_START
    last_now = minute
    while minute <= end:
        last_now = minute + timedelta(seconds=random.uniform(0, 3))  # pg_cron's jitter
        fire(db_url, last_now)
        minute += timedelta(minutes=1)
    horizon = last_now + timedelta(minutes=1)
    for name, plan in plans.items():
        expected = list(slots(plan.spec, BERLIN, DST_START, horizon))
        assert fired_slots(db_url, name) == expected, name
    # The repeated hour fires once: 02:00, 02:15, 02:30, 02:45 CEST then 03:00 CET.
    night = fired_slots(db_url, "quarter-hourly-at-night")
    assert [t.astimezone(BERLIN).strftime("%H:%M%z") for t in night] == [
        "01:00+0200", "01:15+0200", "01:30+0200", "01:45+0200",
        "02:00+0200", "02:15+0200", "02:30+0200", "02:45+0200",
        "03:00+0100", "03:15+0100", "03:30+0100", "03:45+0100",
    ]  # fmt: skip
    # One message per slot and queue, each with its own task id.
    rows = jobs(db_url)
    total = sum(len(fired_slots(db_url, n)) for n in plans)
    assert len(rows) == total
    assert len({r["task_id"] for r in rows}) == total


def test_each_firing_is_the_captured_message_with_a_fresh_id_and_shifted_times(
    db_url: str,
) -> None:
    app = make_app(SCHEDULE)
    start = datetime(2024, 5, 1, 9, 59, 30, tzinfo=UTC)
    sync_as_of(app, db_url, start)
    now = datetime(2024, 5, 1, 10, 0, 0, 500000, tzinfo=UTC)
    fire(db_url, now)
    fast = jobs(db_url, "periodic_tests.add")
    tens = [j for j in fast if j["queue"] == "fast"]
    # Slots at 09:59:40 and 09:59:50 are due (pending); 10:00:00 too; the next six minute's
    # worth are inserted ahead, scheduled at their exact second.
    assert [j["run_at"] for j in tens if j["status"] == "scheduled"] == [
        datetime(2024, 5, 1, 10, 0, s, tzinfo=UTC) for s in (10, 20, 30, 40, 50)
    ] + [datetime(2024, 5, 1, 10, 1, 0, tzinfo=UTC)]
    assert [j["status"] for j in tens[:3]] == ["pending"] * 3
    for job in tens:
        payload = job["payload"]
        headers, props = payload["headers"], payload["properties"]
        assert headers["id"] == headers["root_id"] == props["correlation_id"] == job["task_id"]
        assert headers["celery_beat_task"] is True
        assert headers["task"] == "periodic_tests.add" and job["priority"] == 5
        assert job["body"][:2] == [[3, 4], {}]
        # expires is 30 s after the message is sent: at its slot, or now for a late one.
        sent = max(job["run_at"], now) if job["status"] == "scheduled" else now
        assert datetime.fromisoformat(headers["expires"]) == sent + timedelta(seconds=30)
    assert len({j["task_id"] for j in tens}) == len(tens)


def test_concurrent_firing_sends_one_message_per_slot(db_url: str) -> None:
    app = make_app(SCHEDULE)
    start = datetime(2024, 10, 27, 0, 0, tzinfo=UTC)
    sync_as_of(app, db_url, start)
    nows = [start + timedelta(seconds=30 * i) for i in range(60)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        # Every session fires every minute, as if pg_cron and several `pgskip tick` schedulers
        # ran at once; each lags the others by a random few milliseconds per call.
        rnd = random.Random(seed)
        try:
            with psycopg.connect(db_url, autocommit=True) as conn:
                for now in nows:
                    time.sleep(rnd.uniform(0, 0.003))
                    conn.execute("SELECT pgskip.fire_due(%s)", (now,))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows = jobs(db_url)
    per_task_id = Counter(r["task_id"] for r in rows)
    assert set(per_task_id.values()) == {1}
    with psycopg.connect(db_url) as conn:
        slot_rows = conn.execute("SELECT entry, slot, task_id FROM pgskip.beat_slots").fetchall()
    assert len(slot_rows) == len(rows) == len({(e, s) for e, s, _ in slot_rows})
    assert {r[2] for r in slot_rows} == set(per_task_id)
    # And every slot up to the last firing's horizon is there.
    for plan in plan_entries(app, now=start):
        expected = list(slots(plan.spec, BERLIN, start, nows[-1] + timedelta(minutes=1)))
        assert fired_slots(db_url, plan.name) == expected, plan.name


HOURLY = {"hourly": {"task": "periodic_tests.add", "schedule": crontab(minute=0), "args": (1, 1)}}
SYNCED = datetime(2024, 5, 1, 10, 0, 30, tzinfo=UTC)
BACK_UP = datetime(2024, 5, 1, 15, 30, tzinfo=UTC)  # down since 10:00:30; 11:00..15:00 missed


@pytest.mark.parametrize(
    "policy,expected",
    [
        (MissedPolicy(missed="latest"), ["15:00"]),
        (MissedPolicy(missed="all"), ["11:00", "12:00", "13:00", "14:00", "15:00"]),
        (MissedPolicy(missed="skip"), []),
        (MissedPolicy(missed="latest", deadline=timedelta(minutes=10)), []),
        (MissedPolicy(missed="skip", grace=timedelta(hours=1)), ["15:00"]),
    ],
    ids=["latest", "all", "skip", "latest-past-deadline", "skip-with-long-grace"],
)
def test_slots_missed_while_down_follow_the_policy(
    db_url: str, policy: MissedPolicy, expected: list[str]
) -> None:
    sync_as_of(make_app(HOURLY, tz="UTC"), db_url, SYNCED, policy=policy)
    fire(db_url, BACK_UP)
    assert [t.strftime("%H:%M") for t in fired_slots(db_url, "hourly")] == expected
    assert all(j["status"] == "pending" for j in jobs(db_url))
    # Then the normal rhythm, whatever the policy.
    fire(db_url, datetime(2024, 5, 1, 16, 0, 0, 200000, tzinfo=UTC))
    assert fired_slots(db_url, "hourly")[-1] == datetime(2024, 5, 1, 16, 0, tzinfo=UTC)


def test_catch_up_of_all_missed_slots_is_bounded_per_run(db_url: str) -> None:
    policy = MissedPolicy(missed="all", max_catchup=2)
    sync_as_of(make_app(HOURLY, tz="UTC"), db_url, SYNCED, policy=policy)
    counts = [fire(db_url, BACK_UP) for _ in range(4)]
    assert counts == [2, 2, 1, 0]
    assert len(fired_slots(db_url, "hourly")) == 5


def test_a_missed_slot_stands_in_only_when_nothing_is_due_now(db_url: str) -> None:
    every_minute = {"m": {"task": "periodic_tests.add", "schedule": crontab(), "args": (0, 0)}}
    sync_as_of(make_app(every_minute, tz="UTC"), db_url, SYNCED)
    now = datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=UTC)  # down for two hours
    fire(db_url, now)
    got = [t.strftime("%H:%M") for t in fired_slots(db_url, "m")]
    # Slots within the 2-minute grace still fire; the earlier ones are dropped (one is due now).
    assert got == ["11:59", "12:00", "12:01"]


def test_python_fire_due_and_beat_list_report_next_and_last_run(db_url: str) -> None:
    now = datetime.now(UTC)
    sync_as_of(make_app(HOURLY, tz="UTC"), db_url, now - timedelta(hours=1, minutes=1))
    assert fire_due(db_url, "pgskip", lookahead=timedelta(0)) == 1
    (entry,) = list_entries(db_url, "pgskip")
    top_of_hour = now.replace(minute=0, second=0, microsecond=0)
    assert entry.last_run == top_of_hour
    assert entry.next_run == top_of_hour + timedelta(hours=1)
    assert entry.last_task_id == jobs(db_url)[0]["task_id"]
    assert entry.queues == ["celery"] and entry.schedule == "crontab(0 * * * *)"
