"""beat-sync: idempotent, reports every change, removes what left the config, never half-syncs,
and installs its pg_cron job in the app's database from pg_cron's own."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from celery.schedules import crontab

from kombu_pgskip import cron
from kombu_pgskip.maintenance import remove_all_jobs
from kombu_pgskip.periodic import beat_sync, list_entries, plan_entries, store_entries
from tests.helpers import make_url
from tests.periodic_support import fire, jobs, make_app

UTC = timezone.utc
APPS_DIR = str(Path(__file__).resolve().parent.parent / "apps")
REPO_ROOT = str(Path(__file__).resolve().parent.parent.parent)

SCHEDULE = {
    "nightly": {
        "task": "periodic_tests.add",
        "schedule": crontab(hour=0, minute=0),
        "args": (1, 2),
    },
    "every-10s": {"task": "periodic_tests.add", "schedule": 10, "args": (3, 4)},
    "hourly": {"task": "reports.build", "schedule": timedelta(hours=1), "kwargs": {"k": "v"}},
}


def _sync(url: str, schedule: dict[str, object], *, dry_run: bool = False) -> dict[str, str]:
    now = datetime.now(UTC)
    changes = store_entries(
        url, "pgskip", plan_entries(make_app(schedule), now=now), dry_run=dry_run
    )
    return {c.name: c.sign for c in changes}


def _entries_table(url: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT * FROM pgskip.beat_entries ORDER BY name").fetchall()


def test_sync_is_idempotent_and_reports_each_change(db_url: str) -> None:
    assert _sync(db_url, SCHEDULE) == {"nightly": "+", "every-10s": "+", "hourly": "+"}
    before = _entries_table(db_url)
    assert _sync(db_url, SCHEDULE) == {"nightly": "=", "every-10s": "=", "hourly": "="}
    assert _entries_table(db_url) == before  # not even updated_at moved

    changed = dict(SCHEDULE, nightly={**SCHEDULE["nightly"], "schedule": crontab(hour=1, minute=0)})
    del changed["hourly"]
    changed["new"] = {"task": "periodic_tests.add", "schedule": 60, "args": (0, 0)}
    now = datetime.now(UTC)
    changes = store_entries(db_url, "pgskip", plan_entries(make_app(changed), now=now))
    by_name = {c.name: c for c in changes}
    assert {n: c.sign for n, c in by_name.items()} == {
        "nightly": "~", "every-10s": "=", "new": "+", "hourly": "-",
    }  # fmt: skip
    assert "crontab(0 0 * * *)" in by_name["nightly"].detail
    assert "crontab(0 1 * * *)" in by_name["nightly"].detail
    assert "next run" in by_name["new"].detail
    assert [e.name for e in list_entries(db_url, "pgskip")] == ["every-10s", "new", "nightly"]


def test_dry_run_changes_nothing(db_url: str) -> None:
    assert _sync(db_url, SCHEDULE, dry_run=True) == {
        "nightly": "+",
        "every-10s": "+",
        "hourly": "+",
    }
    assert _entries_table(db_url) == []


# The every-10s entry alone: the hourly one (aligned to the hour) and the nightly one would
# also have a slot within fire()'s 90-second lookahead shortly before they are due.
EVERY_10S = {"every-10s": SCHEDULE["every-10s"]}


def test_changed_message_replaces_waiting_messages_one_per_slot(db_url: str) -> None:
    _sync(db_url, EVERY_10S)
    fire(db_url, datetime.now(UTC))
    waiting = [j for j in jobs(db_url) if j["status"] == "scheduled"]
    assert waiting and all(j["body"][0] == [3, 4] for j in waiting)

    changed = {"every-10s": {**SCHEDULE["every-10s"], "args": (7, 8)}}
    assert _sync(db_url, changed)["every-10s"] == "~"
    fire(db_url, datetime.now(UTC))
    rows = jobs(db_url)
    assert all(j["body"][0] == [7, 8] for j in rows if j["status"] == "scheduled")
    with psycopg.connect(db_url) as conn:
        slots = conn.execute(
            "SELECT slot, task_id FROM pgskip.beat_slots WHERE entry = 'every-10s'"
        ).fetchall()
    # Exactly one message per slot survives, and each slot record points at it.
    assert sorted(j["task_id"] for j in rows) == sorted(t for _, t in slots)


def test_removed_entry_takes_its_waiting_messages_with_it(db_url: str) -> None:
    _sync(db_url, EVERY_10S)
    fire(db_url, datetime.now(UTC))
    assert any(j["status"] == "scheduled" for j in jobs(db_url))
    assert _sync(db_url, {})["every-10s"] == "-"
    assert not [j for j in jobs(db_url) if j["status"] == "scheduled"]


def test_interval_start_survives_a_resync(db_url: str) -> None:
    _sync(db_url, SCHEDULE)
    first = next(e for e in list_entries(db_url, "pgskip") if e.name == "hourly").next_run
    _sync(db_url, dict(SCHEDULE, hourly={**SCHEDULE["hourly"], "kwargs": {"k": "w"}}))
    again = next(e for e in list_entries(db_url, "pgskip") if e.name == "hourly").next_run
    assert again == first


def test_beat_sync_installs_the_firing_job_in_the_apps_database(
    db_url: str, pg_cron_database: str
) -> None:
    app = make_app(SCHEDULE)
    dbname = db_url.rsplit("/", 1)[1]
    try:
        result = beat_sync(app, db_url, "pgskip")
        assert result.cron_changes == [
            f"pg_cron job pgskip:{dbname}:pgskip:fire installed: '* * * * *' runs "
            'SELECT "pgskip".fire_due()'
        ]
        cron_url = make_url(db_url, pg_cron_database)
        with psycopg.connect(cron_url) as conn:
            row = conn.execute(
                "SELECT schedule, command, database FROM cron.job WHERE jobname = %s",
                (f"pgskip:{dbname}:pgskip:fire",),
            ).fetchone()
        assert row == ("* * * * *", 'SELECT "pgskip".fire_due()', dbname)
        # What pg_cron will run works in the app's database.
        with psycopg.connect(db_url, autocommit=True) as conn:
            assert conn.execute(row[1]).fetchone() is not None
        again = beat_sync(app, db_url, "pgskip")
        assert again.cron_changes == [] and not again.changed
        emptied = beat_sync(make_app({}), db_url, "pgskip")
        assert emptied.cron_changes == [f"pg_cron job pgskip:{dbname}:pgskip:fire removed"]
        assert {c.sign for c in emptied.changes} == {"-"}
    finally:
        remove_all_jobs(db_url, "pgskip")
    server = cron.locate(db_url)
    with cron.cron_session(db_url, server) as conn:
        assert cron.list_jobs(conn, cron.job_prefix(dbname, "pgskip")) == []


def _celery(args: list[str], broker_url: str, schedule: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PGSKIP_BROKER_URL=broker_url, PGSKIP_BEAT_SCHEDULE=schedule)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "beatapp", "pgskip", *args],
        cwd=APPS_DIR, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "schedule,entry,reason",
    [("solar", "sunrise", "solar schedules"), ("lazy", "lazy-args", "BeatLazyFunc")],
)
def test_cli_refuses_the_whole_schedule_naming_the_entry(
    db_url: str, schedule: str, entry: str, reason: str
) -> None:
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    proc = _celery(["beat-sync", "--no-cron"], broker, schedule)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{entry}: " in proc.stderr and reason in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert _entries_table(db_url) == []  # the valid "ok" entry was not stored either


def test_cli_beat_sync_and_beat_list(db_url: str, pg_cron_database: str) -> None:
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    try:
        # --wait 0: judge by past runs only (the new jobs have none: not checked).
        first = _celery(["beat-sync", "--wait", "0"], broker, "default")
        assert first.returncode == 0, first.stderr
        assert "+ nightly-billing: billing.run crontab(0 0 * * *) [Europe/Berlin]" in first.stdout
        assert ":fire installed" in first.stdout and ":sweep installed" in first.stdout
        checked = first.stdout.rstrip().splitlines()[-1]
        assert checked.startswith(
            ("pg_cron has not run these jobs yet", "pg_cron can run these jobs")  # a tick between
        ), first.stdout
        second = _celery(["beat-sync", "--wait", "0"], broker, "default")
        assert second.returncode == 0, second.stderr
        assert "= nightly-billing" in second.stdout and "\nno changes\n" in second.stdout
        listing = _celery(["beat-list"], broker, "default")
        assert listing.returncode == 0, listing.stderr
        for name in ("every-10s", "first-monday", "nightly-billing", "pgskip:"):
            assert name in listing.stdout
    finally:
        remove_all_jobs(db_url, "pgskip")
