"""Pausing a queue for every worker (migration 0021): the store's fetches skip a paused queue's
messages and take them again once it is resumed, and the `pause`, `resume` and `status`
commands say what they did. Real workers: tests/acceptance/test_pause.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from kombu import Connection, Queue

from kombu_pgskip import exceptions
from kombu_pgskip.__main__ import main
from kombu_pgskip.envelope import to_row
from kombu_pgskip.store import Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _publish(store: Store, queue: str, n: int = 1, **headers: Any) -> list[int]:
    ids = []
    for i in range(n):
        message = {
            "body": json.dumps({"i": i}),
            "headers": {"task": "t", "id": str(uuid.uuid4()), **headers},
            "properties": {"priority": 0, "delivery_info": {}},
        }
        ids.append(store.publish(to_row(queue, message, eta_threshold=2, max_message_size=10**6)))
    return ids


def _consumer(store: Store, queues: list[str]) -> uuid.UUID:
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="test", queues=queues, lease=30)
    return cid


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def test_a_paused_queue_keeps_its_messages_pending_until_resumed(store: Store) -> None:
    held = _publish(store, "reports", 3)
    other = _publish(store, "emails", 2)
    c = _consumer(store, ["reports", "emails"])
    assert store.pause(["reports"], "nightly import") == ["reports"]
    assert store.pause(["reports"]) == []  # already paused: its reason stays
    (row,) = store.paused()
    assert (row["name"], row["reason"], row["pending"]) == ("reports", "nightly import", 3)
    # One fetch of both queues takes only the other's, then nothing, however often it runs.
    assert sorted(r.id for r in store.fetch(["reports", "emails"], 10, c)) == other
    assert store.fetch(["reports", "emails"], 10, c) == []
    assert store.fetch(["reports"], 10, c, no_ack=True) == []
    # Publishing to it goes on.
    held += _publish(store, "reports")
    assert store.resume(["reports", "never-paused"]) == ["reports"]
    assert store.paused() == []
    assert [r.id for r in store.fetch(["reports"], 10, c)] == held


def test_resume_wakes_the_queues_consumers(store: Store, db_url: str) -> None:
    store.pause(["reports"])
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.channel}"')
        store.resume(["reports"])
        got = [(n.channel, n.payload) for n in listener.notifies(timeout=2, stop_after=1)]
    assert got == [(store.channel, "reports")]


def test_countdowns_fall_due_while_paused_and_wait_for_the_resume(
    store: Store, db_url: str
) -> None:
    eta = datetime.now(timezone.utc) + timedelta(minutes=5)
    (stored,) = _publish(store, "reports", eta=eta.isoformat())
    store.pause(["reports"])
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgskip.jobs SET run_at = now() - interval '1 s' WHERE id = %s", (stored,)
        )
    assert store.promote_scheduled()[0] == 1
    c = _consumer(store, ["reports"])
    assert store.fetch(["reports"], 10, c) == []
    store.resume(["reports"])
    assert [r.id for r in store.fetch(["reports"], 10, c)] == [stored]


def test_a_queue_paused_before_it_exists_stays_paused_through_redeclarations(
    store: Store, db_url: str
) -> None:
    assert store.pause(["later"]) == ["later"]
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    with Connection(broker) as conn:
        Queue("later", auto_delete=True)(conn.default_channel).declare()
        conn.Producer().publish({"n": 1}, routing_key="later")
        conn.default_channel.queue_delete("later")
        Queue("later")(conn.default_channel).declare()
        conn.Producer().publish({"n": 2}, routing_key="later")
    c = _consumer(store, ["later"])
    assert store.fetch(["later"], 10, c) == []
    assert [r["name"] for r in store.paused()] == ["later"]


def test_celerys_own_queues_cannot_be_paused(store: Store) -> None:
    for name in ("celery@host.celery.pidbox", "a1b2.reply.celery.pidbox", "celeryev.a1b2"):
        with pytest.raises(exceptions.ConfigurationError, match="remote-control or event"):
            store.pause(["tasks", name])
    assert store.paused() == []


def test_the_commands_pause_resume_and_status(store: Store, db_url: str) -> None:
    _publish(store, "reports", 2)
    _publish(store, "emails", 1)
    done = _run("pause", "reports", "--reason", "deploy", "--url", db_url)
    assert done.exit_code == 0, done.output
    assert done.stdout == (
        "queue 'reports': paused; 2 pending messages wait until `pgskip resume reports`\n"
    )
    done = _run("pause", "reports", "empty", "--url", db_url)
    assert done.stdout.splitlines() == [
        "queue 'empty': paused; 0 pending messages wait until `pgskip resume empty`",
        "queue 'reports': already paused; 2 pending messages wait until `pgskip resume reports`",
    ]
    status = _run("status", "--url", db_url)
    assert status.exit_code == 0, status.output
    paused_lines = [line for line in status.stdout.splitlines() if line.startswith("paused: ")]
    assert len(paused_lines) == 2
    assert paused_lines[0].startswith("paused: 'empty' since ")
    assert paused_lines[1].endswith(": deploy (2 pending messages; `pgskip resume reports`)"), (
        paused_lines[1]
    )
    got = json.loads(_run("status", "--url", db_url, "--json").stdout)
    assert {q["queue"]: q["paused"] for q in got["queues"]} == {"emails": False, "reports": True}
    assert [(p["queue"], p["reason"], p["pending"]) for p in got["paused"]] == [
        ("empty", None, 0),
        ("reports", "deploy", 2),
    ]
    assert datetime.fromisoformat(got["paused"][0]["paused_at"]).tzinfo is not None
    done = _run("resume", "--url", db_url)
    assert done.exit_code == 2 and "name the queues to resume, or pass --all" in done.output
    done = _run("resume", "reports", "emails", "--url", db_url)
    assert done.stdout.splitlines() == [
        "queue 'emails': was not paused",
        "queue 'reports': resumed",
    ]
    assert _run("resume", "--all", "--url", db_url).stdout == "queue 'empty': resumed\n"
    assert _run("resume", "--all", "--url", db_url).stdout == "no queue is paused\n"
    done = _run("pause", "celery@host.celery.pidbox", "--url", db_url)
    assert done.exit_code == 1
    assert "one of Celery's remote-control or event queues" in done.stderr
