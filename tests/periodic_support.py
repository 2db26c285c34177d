"""Helpers for the periodic-task tests: an in-process Celery app, syncing "as of" a chosen time,
firing with an explicit ``now``, reading what was fired and when it is sent; and
``celery -A beatapp pgskip ...`` processes, and servers whose pg_hba.conf asks for a password."""

from __future__ import annotations

import base64
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery

from kombu_pgskip.migrate import migrate
from kombu_pgskip.periodic import (
    DEFAULT_LOOKAHEAD,
    DEFAULT_TICK,
    Change,
    MissedPolicy,
    plan_entries,
    store_entries,
    sync_lookahead,
)
from kombu_pgskip.testing.embedded import EmbeddedPostgres, find_bindir
from tests.helpers import REPO_ROOT

SCHEMA = "pgskip"
APPS_DIR = str(REPO_ROOT / "tests" / "apps")


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


def beat_sync_as_of(
    app: Celery, url: str, start: datetime, policy: MissedPolicy | None = None
) -> list[Change]:
    """What ``beat-sync`` does, as if it ran at ``start``: store (as :func:`sync_as_of`), then
    fire up to half a minute after the next minute tick."""
    changes = sync_as_of(app, url, start, policy)
    fire(url, start, sync_lookahead(start, DEFAULT_TICK))
    return changes


def fire(url: str, now: datetime, lookahead: timedelta = DEFAULT_LOOKAHEAD) -> int:
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


def sent_times(url: str, entry: str) -> list[datetime]:
    """When each of the entry's fired slots is sent, in order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT sent_at FROM pgskip.beat_slots WHERE entry = %s ORDER BY sent_at", (entry,)
        ).fetchall()
    return [r[0] for r in rows]


def gaps(times: list[datetime]) -> list[timedelta]:
    """The time between each run and the next."""
    return [b - a for a, b in itertools.pairwise(times)]


def jobs(url: str, task: str | None = None) -> list[dict[str, Any]]:
    """Rows of pgskip.jobs (payload parsed, body decoded), oldest first."""
    with psycopg.connect(url) as conn:
        cur = conn.execute(
            "SELECT id, queue, priority, status::text, run_at, payload, task_name, task_id,"
            " expires_at, created_at FROM pgskip.jobs"
            " WHERE %(t)s::text IS NULL OR task_name = %(t)s"
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


# -- `celery -A beatapp pgskip ...` processes -----------------------------------------------------


def start_celery(args: list[str], url: str, schedule: str) -> subprocess.Popen[str]:
    """``celery -A beatapp pgskip <args>`` with the broker at ``url`` and the named schedule."""
    broker = url.replace("postgresql://", "pgskip://", 1)
    env = dict(os.environ, PGSKIP_BROKER_URL=broker, PGSKIP_BEAT_SCHEDULE=schedule)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "beatapp", "pgskip", *args],
        cwd=APPS_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The process's exit status and output, once it ended (killed after ``timeout``)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def celery(
    args: list[str], url: str, schedule: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return finish(start_celery(args, url, schedule), timeout)


def reap(proc: subprocess.Popen[str]) -> None:
    """A process a failed assertion left running: killed, its pipes closed."""
    if proc.poll() is None:
        proc.kill()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    proc.wait()


# -- servers of a test's own ----------------------------------------------------------------------


def local_binaries() -> None:
    """Servers of the test's own need local PostgreSQL binaries (skips only against an
    external server without them)."""
    try:
        find_bindir()
    except RuntimeError as exc:
        if os.environ.get("PGSKIP_TEST_DSN"):
            pytest.skip(f"no local PostgreSQL binaries and PGSKIP_TEST_DSN is set: {exc}")
        raise


SECRET = "app-secret"


@contextmanager
def asking_for_a_password(**conf: str) -> Iterator[tuple[EmbeddedPostgres, str]]:
    """(server, URL of role ``app`` on its database ``app``): pg_cron loaded, and pg_hba.conf
    asking ``app`` for its password (scram-sha-256) over TCP, as many installations do."""
    local_binaries()
    hba = [
        "host  all  app  127.0.0.1/32  scram-sha-256",
        "host  all  app  ::1/128  scram-sha-256",
    ]
    with EmbeddedPostgres(fsync=False, hba=hba, extra_conf=conf) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE app LOGIN PASSWORD '{SECRET}'")
            conn.execute("CREATE DATABASE app OWNER app")
            conn.execute("GRANT USAGE ON SCHEMA cron TO app")
            conn.execute(
                "GRANT EXECUTE ON FUNCTION"
                " cron.schedule_in_database(text,text,text,text,text,boolean) TO app"
            )
        url = f"postgresql://app:{SECRET}@127.0.0.1:{pg.port}/app"
        migrate(url)
        yield pg, url
