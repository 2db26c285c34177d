"""Celery remote control against the pgskip broker: `celery inspect`, `celery control`, status.

One worker (prefork pool, as in production) serves the whole module; the tests that need a
second worker start their own. Commands are run as a user types them (`celery -A taskapp ...`),
and through ``app.control`` where a test needs the structured reply.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator

import kombu.pools
import psycopg
import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, celery_cli, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = pytest.mark.acceptance

HOST = socket.gethostname()
FAST = {
    "PGSKIP_OPT_LEASE_SECONDS": "3",
    "PGSKIP_OPT_SWEEP_INTERVAL": "1",
    "PGSKIP_CONTROL_QUEUE_EXPIRES": "2",
}


def worker(broker_url: str, name: str, **kwargs: object) -> CeleryWorker:
    return CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, hostname=f"{name}@%h", extra_env=FAST, **kwargs
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def rc_worker(module_broker_url: str) -> Iterator[CeleryWorker]:
    w = worker(module_broker_url, "rc1", pool="prefork", concurrency=2)
    with w:
        yield w


@pytest.fixture
def app(module_broker_url: str, rc_worker: CeleryWorker) -> Iterator[Celery]:
    # Far ETAs go to the worker (not the database) so that `inspect scheduled` has one to show.
    app = Celery("ctl", broker=module_broker_url, set_as_current=False)
    app.conf.task_default_queue = "default"
    app.conf.broker_transport_options = {"eta_threshold": 3600}
    yield app
    # Celery's app.close() drops its connection pool without closing it, and kombu keeps it in
    # a process-wide group: the pooled connection whose reply consumer app.control used would
    # keep its lease heartbeat running (against a database dropped with the module) until the
    # test process exits. kombu's reset() closes every pool and forgets them.
    app.close()
    kombu.pools.reset()


def cli_json(broker: str, *args: str) -> dict[str, object]:
    result = celery_cli(*args, "--json", broker=broker)
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def pidbox_rows(db_url: str) -> list[tuple[str, str]]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT queue, status::text FROM pgskip.jobs WHERE queue LIKE '%%pidbox'"
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


def test_inspect_ping_status_stats_registered_and_active_queues_answer(
    module_broker_url: str, rc_worker: CeleryWorker
) -> None:
    me = f"rc1@{HOST}"
    assert cli_json(module_broker_url, "inspect", "ping") == {me: {"ok": "pong"}}
    status = celery_cli("status", broker=module_broker_url)
    assert status.returncode == 0 and f"{me}: OK" in status.stdout
    assert "1 node online" in status.stdout
    stats = cli_json(module_broker_url, "inspect", "stats")[me]
    assert stats["broker"]["transport"] == "pgskip"  # type: ignore[index]
    assert stats["pool"]["max-concurrency"] == 2  # type: ignore[index]
    registered = cli_json(module_broker_url, "inspect", "registered")[me]
    assert "taskapp.record" in registered  # type: ignore[operator]
    queues = cli_json(module_broker_url, "inspect", "active_queues")[me]
    assert [q["name"] for q in queues] == ["default"]  # type: ignore[attr-defined,index]


def test_inspect_active_reserved_scheduled_then_revoke_and_terminate(
    app: Celery, module_broker_url: str, module_db_url: str
) -> None:
    me = f"rc1@{HOST}"
    inspect = app.control.inspect(destination=[me], timeout=5)
    long = [app.send_task("taskapp.record", args=(f"long{i}", 6.0)) for i in range(3)]
    later = app.send_task("taskapp.record", args=("later",), countdown=120)
    wait_until(lambda: len(runs(module_db_url, "start")) == 2, 20, "two tasks to start")
    active = {t["id"] for t in inspect.active()[me]}
    reserved = {t["id"] for t in inspect.reserved()[me]}
    scheduled = {s["request"]["id"] for s in inspect.scheduled()[me]}
    started = {r.id for r in long} - reserved
    assert active == started and len(active) == 2
    assert reserved == {r.id for r in long} - active
    assert scheduled == {later.id}

    revoke = celery_cli("control", "revoke", later.id, broker=module_broker_url)
    assert revoke.returncode == 0 and "revoked" in revoke.stdout, revoke.stdout + revoke.stderr
    assert later.id in inspect.revoked()[me]

    victim = sorted(active)[0]
    kill = celery_cli("control", "terminate", "SIGKILL", victim, broker=module_broker_url)
    assert kill.returncode == 0 and "terminate" in kill.stdout, kill.stdout + kill.stderr
    wait_until(lambda: len(runs(module_db_url, "finish")) == 2, 30, "the other two to finish")
    finished = {key for key, *_ in runs(module_db_url, "finish")}
    assert len(finished) == 2 and "later" not in finished


def test_rate_limit_add_consumer_and_cancel_consumer(
    app: Celery, module_broker_url: str, module_db_url: str
) -> None:
    me = f"rc1@{HOST}"
    limit = celery_cli("control", "rate_limit", "taskapp.record", "100/m", broker=module_broker_url)
    assert limit.returncode == 0 and "new rate limit set successfully" in limit.stdout

    add = celery_cli("control", "add_consumer", "extra", broker=module_broker_url)
    assert add.returncode == 0 and "add consumer extra" in add.stdout, add.stdout + add.stderr
    queues = app.control.inspect(destination=[me], timeout=5).active_queues()[me]
    assert sorted(q["name"] for q in queues) == ["default", "extra"]
    app.send_task("taskapp.record", args=("on-extra",), queue="extra")
    wait_until(
        lambda: ("on-extra", "finish") in [(k, e) for k, e, *_ in runs(module_db_url)],
        20,
        "the task sent to the added queue",
    )

    cancel = celery_cli("control", "cancel_consumer", "extra", broker=module_broker_url)
    assert cancel.returncode == 0 and "no longer consuming from" in cancel.stdout
    queues = app.control.inspect(destination=[me], timeout=5).active_queues()[me]
    assert [q["name"] for q in queues] == ["default"]


def test_broadcast_revoke_reaches_every_worker_and_the_task_never_runs(
    app: Celery, module_broker_url: str, module_db_url: str
) -> None:
    with worker(module_broker_url, "rc2", concurrency=1):
        task_id = str(uuid.uuid4())
        app.control.revoke(task_id)  # a broadcast: no destination
        both = [f"rc1@{HOST}", f"rc2@{HOST}"]
        revoked = app.control.inspect(destination=both, timeout=5).revoked()
        assert set(revoked) == set(both)
        assert all(task_id in ids for ids in revoked.values())
        app.send_task("taskapp.record", args=("revoked-before",), task_id=task_id)
        app.send_task("taskapp.record", args=("after-it",))
        wait_until(
            lambda: "after-it" in {k for k, *_ in runs(module_db_url, "finish")}, 20, "after-it"
        )
    assert "revoked-before" not in {k for k, *_ in runs(module_db_url)}


def test_control_shutdown_stops_one_worker_and_its_queue_goes_with_it(
    module_broker_url: str, module_db_url: str, rc_worker: CeleryWorker
) -> None:
    with worker(module_broker_url, "rc3", concurrency=1) as other:
        # The worker exits without replying (with any broker), so the command itself reports
        # "No nodes replied"; what matters is that rc3, and only rc3, shuts down.
        celery_cli("control", "shutdown", "-d", f"rc3@{HOST}", broker=module_broker_url)
        wait_until(lambda: not other.is_running(), 20, "rc3 to exit")
        assert "Got shutdown from remote" in other.log_text()
    assert other.returncode == 0
    with psycopg.connect(module_db_url) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM pgskip.queues")}
    assert f"rc3@{HOST}.celery.pidbox" not in names
    assert cli_json(module_broker_url, "inspect", "ping") == {f"rc1@{HOST}": {"ok": "pong"}}


def test_a_dead_workers_pidbox_queue_disappears_and_broadcasts_leave_no_rows_for_it(
    app: Celery, module_broker_url: str, module_db_url: str, rc_worker: CeleryWorker
) -> None:
    dead_queue = f"rc4@{HOST}.celery.pidbox"
    doomed = worker(module_broker_url, "rc4", concurrency=1).start()
    try:
        nodes = {node for reply in app.control.ping(timeout=2) for node in reply}
        assert nodes == {f"rc1@{HOST}", f"rc4@{HOST}"}
    finally:
        doomed.kill9()
    killed = time.monotonic()

    def queue_gone() -> bool:
        with psycopg.connect(module_db_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pgskip.queues WHERE name = %s", (dead_queue,)
            ).fetchone()
        return row == (0,)

    # lease (3 s) + x-expires (2 s) + sweep interval of the live worker (1 s), with slack
    wait_until(queue_gone, 20, "the dead worker's pidbox queue to be swept")
    assert time.monotonic() - killed < 20
    for _ in range(3):
        app.control.broadcast("ping", reply=False)
    assert [q for q, _ in pidbox_rows(module_db_url) if q == dead_queue] == []
    replies = app.control.ping(timeout=2)
    assert [list(r) for r in replies] == [[f"rc1@{HOST}"]]
