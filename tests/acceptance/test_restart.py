"""A worker keeps working across a PostgreSQL restart, by itself."""

from __future__ import annotations

from collections import Counter

import pytest
from celery import Celery

from kombu_pgskip.migrate import migrate
from kombu_pgskip.testing.embedded import EmbeddedPostgres
from tests.acceptance.conftest import APPS_DIR, runs, wait_until
from tests.helpers import CeleryWorker

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_worker_survives_a_postgresql_restart(restartable_pg: EmbeddedPostgres, mode: str) -> None:
    import sys

    sys.path.insert(0, APPS_DIR)
    import taskapp

    sys.path.remove(APPS_DIR)
    db_url = restartable_pg.dsn("postgres")
    migrate(db_url)
    taskapp.ensure_table(db_url)
    broker = db_url.replace("postgresql://", "pgskip://", 1)

    def finished() -> Counter[str]:
        # The restartable server may be shared between tests: count this test's keys only.
        return Counter(k for k, *_ in runs(db_url, "finish") if k.startswith(mode))

    app = Celery("publisher", broker=broker, set_as_current=False)
    app.conf.task_default_queue = "default"
    try:
        with CeleryWorker("taskapp", broker, cwd=APPS_DIR) as worker:
            for i in range(5):
                app.send_task("taskapp.record", args=(f"{mode}-before{i}",))
            wait_until(lambda: len(finished()) == 5, 20, "tasks before the restart")
            restartable_pg.restart(mode=mode)
            for i in range(5):
                app.send_task("taskapp.record", args=(f"{mode}-after{i}",))
            wait_until(lambda: len(finished()) == 10, 60, "tasks after the restart")
            assert worker.is_running()
            log = worker.log_text()
        assert set(finished().values()) == {1}
        assert "Connection to broker lost" in log or "consumer: Cannot connect" in log, log[-3000:]
    finally:
        app.close()
