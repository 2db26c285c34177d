"""fire_due(): the right slots, the right messages, exactly once, and the missed-slot policy.

Firing is driven by calling ``pgskip.fire_due(now)`` with explicit times, as pg_cron would each
minute; the runs' pacing around syncs and late ticks is in test_periodic_pacing.py, and real
pg_cron ticks are in tests/acceptance/test_cron_tick.py.
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

from kombu_pgskip.periodic import (
    DEFAULT_LOOKAHEAD,
    MissedPolicy,
    fire_due,
    list_entries,
    plan_entries,
)
from kombu_pgskip.schedule_spec import slots
from tests.periodic_support import (
    fire,
    fired_slots,
    gaps,
    jobs,
    make_app,
    sent_times,
    sync_as_of,
)

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
    horizon = last_now + DEFAULT_LOOKAHEAD
    for name, plan in plans.items():
        expected = list(slots(plan.spec, BERLIN, DST_START, horizon))
        assert fired_slots(db_url, name) == expected, name
        # Inserted ahead, each is sent at its slot: up to 3 s of jitter makes none late.
        assert sent_times(db_url, name) == expected, name
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
    sync_as_of(app, db_url, start)  # and nothing fired until the tick below
    now = datetime(2024, 5, 1, 10, 0, 0, 500000, tzinfo=UTC)
    fire(db_url, now)
    fast = jobs(db_url, "periodic_tests.add")
    tens = [j for j in fast if j["queue"] == "fast"]
    # The slots at 09:59:40, 09:59:50 and 10:00:00 are late: one message, sent now, stands for
    # them; the next ones follow every 10 s from the next whole second, scheduled at their
    # exact time, up to the lookahead.
    assert [j["status"] for j in tens[:1]] == ["pending"]
    assert [j["run_at"] for j in tens if j["status"] == "scheduled"] == [
        datetime(2024, 5, 1, 10, 0, 11, tzinfo=UTC) + timedelta(seconds=10 * k) for k in range(8)
    ]
    assert fired_slots(db_url, "every-10s")[0] == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
    for job in tens:
        payload = job["payload"]
        headers, props = payload["headers"], payload["properties"]
        assert headers["id"] == headers["root_id"] == props["correlation_id"] == job["task_id"]
        assert headers["celery_beat_task"] is True
        assert headers["task"] == "periodic_tests.add" and job["priority"] == 5
        assert job["body"][:2] == [[3, 4], {}]
        # expires is 30 s after the message is sent: at its run time, or now for the late one.
        sent = job["run_at"] if job["status"] == "scheduled" else now
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
        expected = list(slots(plan.spec, BERLIN, start, nows[-1] + DEFAULT_LOOKAHEAD))
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
    # Sent at once, and 'all' paced: 60 s / max_catchup (100) apart, never at the same instant.
    pace = timedelta(seconds=0.6)
    assert sent_times(db_url, "hourly") == [BACK_UP + k * pace for k in range(len(expected))]
    # Then the normal rhythm, whatever the policy.
    fire(db_url, datetime(2024, 5, 1, 16, 0, 0, 200000, tzinfo=UTC))
    assert fired_slots(db_url, "hourly")[-1] == datetime(2024, 5, 1, 16, 0, tzinfo=UTC)


def test_catch_up_of_all_missed_slots_is_paced(db_url: str) -> None:
    policy = MissedPolicy(missed="all", max_catchup=2)
    sync_as_of(make_app(HOURLY, tz="UTC"), db_url, SYNCED, policy=policy)
    # At most 2 a minute: one every 30 s, up to the lookahead (90 s), then from the next tick.
    counts = [fire(db_url, BACK_UP), fire(db_url, BACK_UP)]
    counts.append(fire(db_url, BACK_UP + timedelta(minutes=1)))
    assert counts == [4, 0, 1]
    assert sent_times(db_url, "hourly") == [BACK_UP + k * timedelta(seconds=30) for k in range(5)]
    assert [t.strftime("%H:%M") for t in fired_slots(db_url, "hourly")] == [
        "11:00", "12:00", "13:00", "14:00", "15:00",
    ]  # fmt: skip
    # Caught up: the next slot is sent at its time.
    fire(db_url, datetime(2024, 5, 1, 16, 0, tzinfo=UTC))
    assert sent_times(db_url, "hourly")[-1] == datetime(2024, 5, 1, 16, 0, tzinfo=UTC)


EVERY_MINUTE = {"m": {"task": "periodic_tests.add", "schedule": crontab(), "args": (0, 0)}}


@pytest.mark.parametrize(
    "back_up,expected",
    [
        # 12:00 is 0.3 s late: it runs at once and stands for the two hours missed before it.
        (datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=UTC), ["12:00", "12:01"]),
        # 12:00 is 40 s late and 12:01 is 20 s away: 12:01's run stands for it.
        (datetime(2024, 5, 1, 12, 0, 40, tzinfo=UTC), ["12:01", "12:02"]),
    ],
    ids=["late-slot-runs", "next-slot-nearer"],
)
def test_late_slots_of_a_crontab_run_once_unless_the_next_slot_is_nearer(
    db_url: str, back_up: datetime, expected: list[str]
) -> None:
    sync_as_of(make_app(EVERY_MINUTE, tz="UTC"), db_url, SYNCED)
    fire(db_url, back_up)  # down for two hours
    got = fired_slots(db_url, "m")
    assert [t.strftime("%H:%M") for t in got] == expected
    sent = sent_times(db_url, "m")
    assert sent == [max(slot, back_up) for slot in got]
    assert min(gaps(sent)) >= timedelta(seconds=30)


def test_python_fire_due_and_beat_list_report_next_and_last_run(db_url: str) -> None:
    sync_as_of(make_app(HOURLY, tz="UTC"), db_url, SYNCED)
    back_up = datetime(2024, 5, 1, 11, 5, tzinfo=UTC)  # 11:00 missed
    assert fire_due(db_url, "pgskip", now=back_up, lookahead=timedelta(0)) == 1
    (entry,) = list_entries(db_url, "pgskip")
    assert entry.last_run == back_up  # the 11:00 slot, sent when the database came back
    assert entry.next_run == datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    assert entry.last_task_id == jobs(db_url)[0]["task_id"]
    assert entry.queues == ["celery"] and entry.schedule == "crontab(0 * * * *)"
