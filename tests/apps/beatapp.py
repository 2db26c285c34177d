"""A Celery app with a ``beat_schedule``, for the periodic-task tests (``pgskip beat-sync``).

``PGSKIP_BEAT_SCHEDULE`` picks the schedule: ``default`` (one of every form), ``tick`` (one
entry every minute), ``hello`` (Celery's periodic-tasks example: ``add_periodic_task(10.0,
...)``, for the real pg_cron ticks), ``empty``, ``solar`` and ``lazy`` (refused). The task
``beatapp.record`` logs into ``test_runs`` like ``taskapp.record``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import psycopg
from celery import Celery
from celery.beat import BeatLazyFunc
from celery.schedules import crontab, schedule, solar

import kombu_pgskip

BROKER_URL = os.environ.get("PGSKIP_BROKER_URL", "pgskip://postgres@127.0.0.1:5432/postgres")
DB_URL = kombu_pgskip.urls.to_conninfo(BROKER_URL)

app = Celery("beatapp", broker=BROKER_URL)
app.conf.update(
    task_default_queue="default",
    broker_connection_retry_on_startup=True,
    timezone=os.environ.get("PGSKIP_BEAT_TZ", "Europe/Berlin"),
    result_expires=None,  # no celery.backend_cleanup entry
)


def _sunrise() -> solar:
    """A solar schedule without needing the ephem package (celery beat would need it)."""
    sched = solar.__new__(solar)
    sched.event, sched.lat, sched.lon = "sunrise", 52.5, 13.4
    return sched


SCHEDULES = {
    "default": {
        "nightly-billing": {"task": "billing.run", "schedule": crontab(hour=0, minute=0)},
        "first-monday": {
            "task": "beatapp.record",
            "schedule": crontab(minute=5, hour=3, day_of_month="1-7", day_of_week="mon"),
            "args": ("first-monday",),
        },
        "every-10s": {
            "task": "beatapp.record",
            "schedule": 10.0,
            "args": ("every-10s",),
            "options": {
                "queue": "fast",
                "priority": 7,
                "expires": 30,
                "headers": {"x-origin": "beat"},
            },
        },
        "every-2h": {
            "task": "reports.build",
            "schedule": timedelta(hours=2),
            "kwargs": {"kind": "summary"},
        },
        "hourly-relative": {
            "task": "reports.hourly",
            "schedule": schedule(timedelta(hours=1)),
            "relative": True,
        },
    },
    "tick": {
        "every-minute": {"task": "beatapp.record", "schedule": crontab(), "args": ("tick",)},
    },
    "hello": {},  # filled by add_periodic_task below, as Celery's example does
    "empty": {},
    "solar": {
        "sunrise": {"task": "beatapp.record", "schedule": _sunrise()},
        "ok": {"task": "beatapp.record", "schedule": 60.0},
    },
    "lazy": {
        "lazy-args": {
            "task": "beatapp.record",
            "schedule": 60.0,
            "args": (BeatLazyFunc(lambda: "now"),),
        },
        "ok": {"task": "beatapp.record", "schedule": 60.0},
    },
}

SCHEDULE = os.environ.get("PGSKIP_BEAT_SCHEDULE", "default")
app.conf.beat_schedule = SCHEDULES[SCHEDULE]


@app.task(bind=True, name="beatapp.record")
def record(self, key: str, sleep: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    headers = self.request.headers or {}
    with psycopg.connect(DB_URL, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO test_runs (key, event, pid, hostname, redelivered)"
            " VALUES (%s, %s, %s, %s, %s)",
            (
                key,
                "beat" if headers.get("celery_beat_task") else "start",
                os.getpid(),
                self.request.id,
                None,
            ),
        )
    return key


if SCHEDULE == "hello":
    app.add_periodic_task(10.0, record.s("hello"), name="say hello every 10 s")
