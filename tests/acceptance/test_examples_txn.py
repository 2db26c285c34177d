"""The transactional-enqueue examples run as a newcomer would run them, against the test database.

Each example places two orders, one of them declined (rolled back), as a subprocess; then a
real worker started on the example's own app sends the invoice of the committed order only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psycopg
import pytest

from tests.helpers import REPO_ROOT, CeleryWorker
from tests.publish_support import broker_url, jobs

pytestmark = [pytest.mark.acceptance]

EXAMPLES = REPO_ROOT / "examples"


@pytest.mark.parametrize(
    ("module", "table"),
    [("orders_psycopg", "orders"), ("orders_sqlalchemy", "shop_orders")],
)
def test_example_commits_one_order_with_its_job_and_the_worker_sends_only_that_invoice(
    db_url: str, module: str, table: str
) -> None:
    env = dict(os.environ, DATABASE_URL=db_url, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, f"{module}.py"],
        cwd=EXAMPLES,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "for alice committed with its invoice job" in proc.stdout
    assert "payment declined for bob: no order, no invoice job" in proc.stdout

    with psycopg.connect(db_url, autocommit=True) as conn:
        orders = conn.execute(f"SELECT id, customer FROM {table}").fetchall()
    assert [o[1] for o in orders] == ["alice"]
    (job,) = jobs(db_url)
    assert job.queue == "orders"
    assert job.task_name == "orders.send_invoice_email"

    with CeleryWorker(
        module,
        broker_url(db_url),
        queues=["orders"],
        cwd=str(EXAMPLES),
        extra_env={"DATABASE_URL": db_url},
    ) as worker:
        deadline = time.monotonic() + 20
        with psycopg.connect(db_url, autocommit=True) as conn:
            while True:
                row = conn.execute(f"SELECT invoice_sent_at FROM {table}").fetchone()
                if row is not None and row[0] is not None:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"invoice never sent; worker log:\n{worker.log_text()[-4000:]}")
                time.sleep(0.05)
        # The task prints after its UPDATE has committed: the line may come a moment later.
        sent = f"invoice for order {orders[0][0]} sent"
        while sent not in worker.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sent in worker.log_text()
