"""Flower against the pgskip broker, through its HTTP API: workers listed, tasks seen."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.acceptance.conftest import APPS_DIR, wait_until
from tests.helpers import REPO_ROOT, CeleryWorker

pytestmark = pytest.mark.acceptance

pytest.importorskip("flower", reason="flower is in the test extra: pip install -e .[test]")

HOST = socket.gethostname()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Flower:
    def __init__(self, broker_url: str) -> None:
        self.port = _free_port()
        self.log = Path(tempfile.mkstemp(prefix="flower-", suffix=".log")[1])
        env = dict(
            os.environ,
            PGSKIP_BROKER_URL=broker_url,
            PYTHONPATH=str(REPO_ROOT),
            FLOWER_UNAUTHENTICATED_API="true",
        )
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "taskapp", "flower",
                 "--address=127.0.0.1", f"--port={self.port}", "--inspect_timeout=3000"],
                cwd=APPS_DIR, env=env, stdout=fh, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"flower exited:\n{self.log.read_text()}")
        try:
            self.get("/api/workers")
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)


@pytest.fixture
def flower(broker_url: str) -> Iterator[Flower]:
    f = Flower(broker_url)
    try:
        wait_until(f.answers, 30, "flower to serve its API")
        yield f
    finally:
        f.stop()


def test_flower_lists_the_worker_and_sees_its_tasks(broker_url: str, flower: Flower) -> None:
    publisher = Celery("publisher", broker=broker_url, set_as_current=False)
    publisher.conf.task_default_queue = "default"
    me = f"fl1@{HOST}"
    worker = CeleryWorker(
        "taskapp", broker_url, cwd=APPS_DIR, hostname="fl1@%h",
        extra_args=["-E"], without=("gossip", "mingle"),
    )  # fmt: skip
    try:
        with worker:
            # /api/workers?refresh=1 asks the workers by remote control (inspect).
            wait_until(lambda: me in flower.get("/api/workers?refresh=1"), 30, "the worker")
            info = flower.get("/api/workers")[me]
            assert info["stats"]["broker"]["transport"] == "pgskip"
            assert [q["name"] for q in info["active_queues"]] == ["default"]
            ids = [publisher.send_task("taskapp.record", args=(f"f{i}",)).id for i in range(3)]

            def seen_succeeded() -> bool:
                tasks = flower.get("/api/tasks")
                return all(tasks.get(i, {}).get("state") == "SUCCESS" for i in ids)

            # /api/tasks is built from the events Flower receives.
            wait_until(seen_succeeded, 30, "three SUCCESS tasks in flower")
            task = flower.get(f"/api/task/info/{ids[0]}")
            assert task["name"] == "taskapp.record" and task["worker"] == me
    finally:
        publisher.close()
