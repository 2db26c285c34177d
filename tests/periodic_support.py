"""Helpers for the periodic-task tests: an in-process Celery app, syncing "as of" a chosen time,
firing with an explicit ``now``, and reading what was fired."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta
from typing import Any

import psycopg
from celery import Celery

from kombu_pgskip.periodic import Change, MissedPolicy, plan_entries, store_entries

SCHEMA = "pgskip"


def make_app(schedule: dict[str, Any], tz: str = "Europe/Berlin", **conf: Any) -> Celery:
    """A Celery app whose only job is to build messages (beat-sync never uses its broker)."""
    app = Celery("periodic_tests", set_as_current=False, broker="memory://")
    app.conf.update(timezone=tz, result_expires=None, beat_schedule=schedule, **conf)

    @app.task(name="periodic_tests.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


def sync_as_of(
    app: Celery, url: str, start: datetime, policy: MissedPolicy | None = None
) -> list[Change]:
    """beat-sync as if it ran at ``start``: interval entries count from it, every cursor starts
    at the first slot after it."""
    changes = store_entries(url, SCHEMA, plan_entries(app, now=start, policy=policy))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.beat_entries AS e SET next_slot = pgskip.beat_next_slot(e, %s)",
            (start,),
        )
    return changes


def fire(url: str, now: datetime, lookahead: timedelta = timedelta(minutes=1)) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pgskip.fire_due(%s, %s)", (now, lookahead)).fetchone()
    assert row is not None
    return int(row[0])


def fired_slots(url: str, entry: str) -> list[datetime]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT slot FROM pgskip.beat_slots WHERE entry = %s ORDER BY slot", (entry,)
        ).fetchall()
    return [r[0] for r in rows]


def jobs(url: str, task: str | None = None) -> list[dict[str, Any]]:
    """Rows of pgskip.jobs (payload parsed, body decoded), oldest first."""
    with psycopg.connect(url) as conn:
        cur = conn.execute(
            "SELECT id, queue, priority, status::text, run_at, payload, task_name, task_id,"
            " expires_at FROM pgskip.jobs WHERE %(t)s::text IS NULL OR task_name = %(t)s"
            " ORDER BY id",
            {"t": task},
        )
        cols = [d.name for d in cur.description or []]
        out = []
        for row in cur.fetchall():
            job = dict(zip(cols, row, strict=True))
            payload = job["payload"]
            job["body"] = json.loads(base64.b64decode(payload["body"]))
            out.append(job)
    return out
