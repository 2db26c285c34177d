"""`celery inspect scheduled` lists the ETAs waiting in the database, in Celery's own format.

A countdown longer than ``eta_threshold`` (2 s by default) is stored as a ``scheduled`` row, not
held by a worker; the worker's ``scheduled`` command lists those of its queues after the ones it
holds in memory (kombu_pgskip/control.py). Real ``celery worker`` processes, real PostgreSQL.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import kombu.pools
import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, celery_cli, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance

HOST = socket.gethostname()
FIRST = f"sched1@{HOST}"


def worker(broker_url: str, name: str, queues: list[str]) -> CeleryWorker:
    return CeleryWorker(
        "taskapp", broker_url, queues=queues, concurrency=1, cwd=APPS_DIR, hostname=f"{name}@%h"
    )


@pytest.fixture(scope="module")
def first_worker(module_broker_url: str) -> Iterator[CeleryWorker]:
    with worker(module_broker_url, "sched1", ["default", "shared"]) as w:
        yield w


def publisher(broker_url: str, **transport_options: Any) -> Celery:
    app = Celery("sched", broker=broker_url, set_as_current=False)
    app.conf.task_default_queue = "default"
    app.conf.broker_transport_options = transport_options
    return app


@pytest.fixture
def app(module_broker_url: str, first_worker: CeleryWorker) -> Iterator[Celery]:
    app = publisher(module_broker_url)
    yield app
    app.close()
    kombu.pools.reset()  # see tests/acceptance/test_remote_control.py


def scheduled_ids(app: Celery, node: str, **arguments: Any) -> list[str]:
    reply = app.control.inspect(destination=[node], timeout=5)._request("scheduled", **arguments)
    return [entry["request"]["id"] for entry in reply[node]]


def stored(db_url: str, task_id: str) -> tuple[str, str]:
    """(status, the eta header Celery wrote) of a task's row."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT status::text, payload->'headers'->>'eta' FROM pgskip.jobs WHERE task_id = %s",
            (task_id,),
        ).fetchone()
    assert row is not None
    return str(row[0]), str(row[1])


def test_inspect_scheduled_lists_the_stored_etas_after_those_held_in_memory_as_celery_does(
    app: Celery, module_broker_url: str, module_db_url: str
) -> None:
    # A publisher whose threshold is an hour: the worker holds this ETA in memory.
    holding = publisher(module_broker_url, eta_threshold=3600)
    try:
        held = holding.send_task("taskapp.record", args=("held",), countdown=120)
        wait_until(lambda: held.id in scheduled_ids(app, FIRST), 20, "the worker to hold it")
    finally:
        holding.close()
    sent_at = datetime.now(timezone.utc)
    soon = app.send_task("taskapp.record", args=("soon",), countdown=5)
    later = app.send_task("taskapp.record", args=("later",), kwargs={"sleep": 0}, countdown=3600)
    latest = app.send_task("taskapp.record", args=("latest",), countdown=7200)
    assert stored(module_db_url, soon.id)[0] == stored(module_db_url, later.id)[0] == "scheduled"

    reply = app.control.inspect(destination=[FIRST], timeout=5).scheduled()[FIRST]
    # Memory first (Celery's own listing), then the stored ones earliest first, each once.
    assert [e["request"]["id"] for e in reply] == [held.id, soon.id, later.id, latest.id]
    from_memory = reply[0]
    for entry, task_id, args, kwargs, countdown in (
        (reply[1], soon.id, ["soon"], {}, 5),
        (reply[2], later.id, ["later"], {"sleep": 0}, 3600),
    ):
        # The same fields as Celery gives an ETA it holds, with this message's values.
        assert set(entry) == set(from_memory) == {"eta", "priority", "request"}
        assert entry["priority"] == from_memory["priority"] == 6
        eta = stored(module_db_url, task_id)[1]
        assert entry["eta"] == eta
        ahead = datetime.fromisoformat(eta) - sent_at
        assert timedelta(seconds=countdown) <= ahead < timedelta(seconds=countdown + 5)
        assert entry["request"] == {
            **from_memory["request"],
            "id": task_id,
            "args": args,
            "kwargs": kwargs,
        }
    assert from_memory["request"]["name"] == from_memory["request"]["type"] == "taskapp.record"
    assert from_memory["request"]["hostname"] == FIRST
    assert from_memory["request"]["delivery_info"]["routing_key"] == "default"
    assert from_memory["request"]["acknowledged"] is False

    # Once due, the 5 s one runs (not before its ETA) and is no longer listed.
    wait_until(lambda: "soon" in [k for k, *_ in runs(module_db_url, "start")], 30, "soon")
    with psycopg.connect(module_db_url) as conn:
        row = conn.execute("SELECT at FROM test_runs WHERE key = 'soon'").fetchone()
    assert row is not None and row[0] >= datetime.fromisoformat(reply[1]["eta"])
    # The command a user types shows the rest.
    cli = celery_cli("inspect", "scheduled", "-d", FIRST, "--json", broker=module_broker_url)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    listed = json.loads(cli.stdout.strip().splitlines()[-1])[FIRST]
    assert [e["request"]["id"] for e in listed] == [held.id, later.id, latest.id]

    # Bounded: at most `limit` stored ones (those in memory are Celery's, all of them).
    assert scheduled_ids(app, FIRST, limit=1) == [held.id, later.id]
    bad = app.control.inspect(destination=[FIRST], timeout=5)._request("scheduled", limit="x")
    assert "is not a whole number >= 0; pass e.g. limit=5000" in bad[FIRST]["error"]


def test_of_two_workers_on_a_queue_the_first_consumer_lists_its_stored_etas_once(
    app: Celery, module_broker_url: str
) -> None:
    second = f"sched2@{HOST}"
    with worker(module_broker_url, "sched2", ["shared"]):
        etas = [
            app.send_task("taskapp.record", args=(f"shared{i}",), queue="shared", countdown=3600)
            for i in range(2)
        ]
        ids = [r.id for r in etas]
        both = app.control.inspect(destination=[FIRST, second], timeout=5).scheduled()
        shared = {node: [e["request"]["id"] for e in entries] for node, entries in both.items()}
        # sched1 consumed the queue first: it lists them; sched2 does not list them again.
        assert [i for i in shared[FIRST] if i in ids] == ids
        assert shared[second] == []

        # sched1 stops consuming the queue: sched2 is now its first consumer and lists them.
        app.control.cancel_consumer("shared", destination=[FIRST], reply=True)
        assert [i for i in scheduled_ids(app, FIRST) if i in ids] == []
        wait_until(lambda: scheduled_ids(app, second) == ids, 10, "sched2 to list them")
