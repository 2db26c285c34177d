"""beat-sync builds exactly the messages celery beat would send, and refuses what it cannot honour.

No database: the plan is built with Celery on an in-memory kombu channel and compared with what
``celery.beat.Scheduler.apply_async`` itself publishes for the same entry.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import kombu
import pytest
from celery import Celery
from celery.beat import BeatLazyFunc, Scheduler
from celery.schedules import crontab, solar

from kombu_pgskip import cron, exceptions
from kombu_pgskip.maintenance import FailedFilter, MaintenanceConfig, parse_duration
from kombu_pgskip.periodic import (
    MissedPolicy,
    ScheduleRefused,
    _CaptureTransport,
    default_policy,
    plan_entries,
    sync_lookahead,
    tick_of,
)

NOW = datetime(2024, 5, 1, 10, 0, 0, tzinfo=timezone.utc)


def make_app(schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery("proj", set_as_current=False, broker="memory://")
    app.conf.update(timezone="Europe/Berlin", result_expires=None, beat_schedule=schedule, **conf)

    @app.task(name="proj.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="proj.cleanup", expires=600, shared=False)
    def cleanup() -> None:
        return None

    return app


def beat_sends(app: Celery, name: str, entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """What celery beat's own Scheduler publishes for ``entry``."""
    scheduler = Scheduler(app, lazy=True)
    beat_entry = scheduler.Entry(**dict(entry, name=name, app=app))
    conn = kombu.Connection(transport=_CaptureTransport)
    with conn:
        producer = app.amqp.Producer(conn, auto_declare=False)
        scheduler.apply_async(beat_entry, producer=producer, advance=False)
        return list(conn.transport.captured)


def normalised(message: dict[str, Any]) -> dict[str, Any]:
    """The message with what differs between any two sends (ids, tags, send times) blanked."""
    m = json.loads(json.dumps(message))
    task_id = m["headers"]["id"]
    for section in ("headers", "properties"):
        for key, value in list(m[section].items()):
            if value == task_id:
                m[section][key] = "<id>"
    m["properties"]["delivery_tag"] = "<tag>"
    for key in ("eta", "expires"):
        if m["headers"].get(key):
            m["headers"][key] = "<time>"
    return m


SCHEDULE = {
    "nightly": {"task": "proj.add", "schedule": crontab(hour=0, minute=0), "args": (1, 2)},
    "seconds": {
        "task": "proj.add",
        "schedule": 10.0,
        "kwargs": {"x": 1, "y": 2},
        "options": {"queue": "fast", "priority": 7, "expires": 30, "headers": {"x-team": "ops"}},
    },
    "unregistered": {"task": "other.service.run", "schedule": timedelta(hours=2), "args": ["a"]},
    "delayed": {"task": "proj.add", "schedule": 60, "args": (3, 4), "options": {"countdown": 15}},
    "task-expires": {"task": "proj.cleanup", "schedule": crontab(minute="*/5")},
    "relative": {
        "task": "proj.add",
        "schedule": timedelta(hours=1),
        "relative": True,
        "args": (0, 0),
    },
}


def test_each_message_is_what_celery_beat_sends() -> None:
    app = make_app(SCHEDULE)
    plans = {p.name: p for p in plan_entries(app, now=NOW)}
    assert sorted(plans) == sorted(SCHEDULE)
    for name, entry in SCHEDULE.items():
        ours = [(m["queue"], normalised(m["payload"])) for m in plans[name].messages]
        theirs = [(q, normalised(m)) for q, m in beat_sends(app, name, entry)]
        assert ours == theirs, name


def test_messages_are_task_protocol_2_with_the_beat_header() -> None:
    app = make_app(SCHEDULE)
    plan = {p.name: p for p in plan_entries(app, now=NOW)}["seconds"]
    (message,) = plan.messages
    payload = message["payload"]
    assert message["queue"] == "fast" and message["priority"] == 7
    # Celery turns expires into an AMQP expiration too; as for any task message, the expired
    # message is delivered and the worker marks the task REVOKED (no TTL that deletes it).
    assert payload["properties"]["expiration"] == "30000" and message["ttl_ms"] is None
    headers = payload["headers"]
    assert headers["celery_beat_task"] is True
    assert headers["x-team"] == "ops"
    assert headers["task"] == "proj.add" and headers["lang"] == "py"
    assert headers["root_id"] == headers["id"] and headers["parent_id"] is None
    body = json.loads(base64.b64decode(payload["body"]))
    assert body == [[], {"x": 1, "y": 2}, {"callbacks": None, "errbacks": None, "chain": None,
                                           "chord": None}]  # fmt: skip
    # Replaced by a new id at every firing.
    assert ["headers", "id"] in plan.id_paths and ["headers", "root_id"] in plan.id_paths
    assert ["properties", "correlation_id"] in plan.id_paths
    assert plan.expires_offset == timedelta(seconds=30) and plan.eta_offset is None


def test_countdown_and_task_level_expires_move_with_each_firing() -> None:
    plans = {p.name: p for p in plan_entries(make_app(SCHEDULE), now=NOW)}
    assert plans["delayed"].eta_offset == timedelta(seconds=15)
    assert plans["task-expires"].expires_offset == timedelta(seconds=600)
    assert plans["nightly"].eta_offset is None and plans["nightly"].expires_offset is None


def test_the_plan_is_stable_between_syncs() -> None:
    first = {p.name: p.digest for p in plan_entries(make_app(SCHEDULE), now=NOW)}
    later = NOW + timedelta(hours=3)
    again = {p.name: p.digest for p in plan_entries(make_app(SCHEDULE), now=later)}
    assert first == again
    changed = dict(SCHEDULE, nightly={**SCHEDULE["nightly"], "args": (5, 6)})
    digests = {p.name: p.digest for p in plan_entries(make_app(changed), now=NOW)}
    assert digests["nightly"] != first["nightly"]
    assert {k: v for k, v in digests.items() if k != "nightly"} == {
        k: v for k, v in first.items() if k != "nightly"
    }


def test_unhonourable_entries_are_refused_together_naming_each() -> None:
    sun = solar.__new__(solar)
    sun.event, sun.lat, sun.lon = "sunrise", 52.5, 13.4
    app = make_app(
        {
            "fine": {"task": "proj.add", "schedule": 60, "args": (1, 2)},
            "sunrise": {"task": "proj.add", "schedule": sun},
            "lazy": {"task": "proj.add", "schedule": 60, "args": (BeatLazyFunc(lambda: 1), 2)},
            "typo": {"task": "proj.add", "schedule": 60, "kwarg": {}},
            "bad-args": {"task": "proj.add", "schedule": 60, "args": (1, 2, 3)},
        }
    )
    with pytest.raises(ScheduleRefused) as info:
        plan_entries(app, now=NOW)
    problems = dict(info.value.problems)
    assert sorted(problems) == ["bad-args", "lazy", "sunrise", "typo"]
    assert "solar" in problems["sunrise"]
    assert "BeatLazyFunc" in problems["lazy"]
    assert "kwarg" in problems["typo"]
    assert "could not build its message" in problems["bad-args"]
    assert "nothing was changed" in str(info.value)
    assert isinstance(info.value, exceptions.ConfigurationError)


def test_eager_apps_and_protocol_1_are_refused() -> None:
    with pytest.raises(ScheduleRefused, match="task_always_eager"):
        plan_entries(make_app(SCHEDULE, task_always_eager=True), now=NOW)
    with pytest.raises(ScheduleRefused, match="protocol 2"):
        plan_entries(make_app(SCHEDULE, task_protocol=1), now=NOW)


def test_backend_cleanup_is_added_when_beat_would_add_it() -> None:
    app = make_app({})
    app.conf.result_expires = timedelta(days=1)
    (plan,) = plan_entries(app, now=NOW)
    assert plan.name == "celery.backend_cleanup" and plan.task == "celery.backend_cleanup"
    assert plan.expires_offset == timedelta(hours=12)


def test_missed_policy_comes_from_the_cli_the_app_then_the_entry() -> None:
    app = make_app(
        {
            "a": {"task": "proj.add", "schedule": 60, "args": (1, 2)},
            "b": {
                "task": "proj.add",
                "schedule": crontab(),
                "args": (1, 2),
                "options": {"pgskip_missed": "all", "pgskip_max_catchup": 5, "pgskip_grace": 30},
            },
        },
        pgskip_beat_missed="skip",
        beat_cron_starting_deadline=600,
    )
    plans = {p.name: p for p in plan_entries(app, now=NOW)}
    assert plans["a"].policy == MissedPolicy(missed="skip")
    assert plans["b"].policy == MissedPolicy(
        missed="all", grace=timedelta(seconds=30), max_catchup=5, deadline=timedelta(seconds=600)
    )
    # Our options never reach the message.
    assert "pgskip_missed" not in plans["b"].messages[0]["payload"]["properties"]
    assert default_policy(app, missed="latest", grace=5).grace == timedelta(seconds=5)
    with pytest.raises(exceptions.ConfigurationError, match="pgskip_beat_missed"):
        default_policy(make_app({}, pgskip_beat_missed="sometimes"))


def test_firing_job_uses_seconds_only_where_pg_cron_has_them() -> None:
    old = cron.CronServer("app", "postgres", "u", "1.4-1")
    new = cron.CronServer("app", "postgres", "u", "1.6.4")
    assert not old.supports_seconds and new.supports_seconds
    assert cron.tick_schedule(old, 10.0) == ("* * * * *", 60)
    assert cron.tick_schedule(new, 10.0) == ("10 seconds", 10)
    assert cron.tick_schedule(new, 0.5) == ("1 seconds", 1)
    assert cron.tick_schedule(new, None) == ("* * * * *", 60)
    assert cron.tick_schedule(new, 3600.0) == ("* * * * *", 60)


def test_beat_sync_fires_up_to_half_a_tick_after_the_next_tick() -> None:
    minute, at = timedelta(minutes=1), NOW.replace(hour=12)
    assert sync_lookahead(at + timedelta(seconds=55), minute) == timedelta(seconds=35)
    assert sync_lookahead(at + timedelta(seconds=5), minute) == timedelta(seconds=85)
    assert sync_lookahead(at, minute) == timedelta(seconds=90)  # that tick may have run already
    berlin = (at + timedelta(seconds=5)).astimezone(ZoneInfo("Europe/Berlin"))
    assert sync_lookahead(berlin, minute) == timedelta(seconds=85)
    assert sync_lookahead(at + timedelta(seconds=5), timedelta(seconds=10)) == timedelta(seconds=10)
    # Without pg_cron, `pgskip tick` runs every minute.
    assert tick_of(None, plan_entries(make_app({}), now=NOW)) == ("* * * * *", minute)


def test_maintenance_settings_parse_and_validate() -> None:
    config = MaintenanceConfig.build(
        {"completed_retention": "2h", "failed_retention": "never", "max_attempts": "5"}
    )
    assert config.completed_retention == timedelta(hours=2)
    assert config.failed_retention is None and config.max_attempts == 5
    assert config.prune_batch == 10_000
    assert MaintenanceConfig.build({"prune_batch": "500"}).prune_batch == 500
    for bad, message in (
        ("lots", "prune_batch must be an integer"),
        (True, "prune_batch must be an integer"),
        (0, "prune_batch must be >= 1"),
        ("-5", "prune_batch must be >= 1"),
    ):
        with pytest.raises(exceptions.ConfigurationError, match=message):
            MaintenanceConfig.build({"prune_batch": bad})
    assert parse_duration(90) == timedelta(seconds=90)
    assert parse_duration("7d") == timedelta(days=7)
    with pytest.raises(exceptions.ConfigurationError, match="unknown"):
        MaintenanceConfig.build({"retention": "1d"})
    with pytest.raises(exceptions.ConfigurationError, match="expected seconds"):
        parse_duration("soon")
    app = Celery(set_as_current=False, broker="memory://")
    app.conf.broker_transport_options = {"max_attempts": 7}
    app.conf.pgskip_maintenance = {"completed_retention": 60}
    from_app = MaintenanceConfig.from_app(app, failed_retention="1d")
    assert from_app.max_attempts == 7
    assert from_app.completed_retention == timedelta(minutes=1)
    assert from_app.failed_retention == timedelta(days=1)


def test_task_name_filter_treats_only_star_as_a_wildcard() -> None:
    assert FailedFilter(task="billing.*").params()["task"] == "billing.%"
    assert FailedFilter(task="a_b%c").params()["task"] == "a\\_b\\%c"
