"""The README's demo command, end to end, as a newcomer runs it (its own throwaway PostgreSQL).

The demo waits for pg_cron's next minute tick (up to a minute), as does
``test_cron_tick.py``; so that the suite does not wait twice, the demo is started in the
background at the first acceptance test (``conftest.pytest_runtest_setup``) and this test
collects its outcome. Run alone, this test starts it itself.
"""

from __future__ import annotations

import re

import pytest

from tests.demo_support import DEMO_RUN, ORDERS, DemoRun

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

TIMEOUT = 240


def test_demo_processes_exactly_the_committed_orders_and_fires_a_cron_tick(
    request: pytest.FixtureRequest,
) -> None:
    run = request.config.stash.get(DEMO_RUN, None) or DemoRun()
    try:
        code, out = run.result(TIMEOUT)
    finally:
        run.stop()
    assert code == 0, out[-4000:]
    placed = re.search(rf"placed {ORDERS} orders: (\d+) committed, (\d+) rolled back", out)
    assert placed, out[-4000:]
    committed, rolled_back = int(placed.group(1)), int(placed.group(2))
    assert committed + rolled_back == ORDERS and rolled_back > 0
    sent = re.search(r"worker sent exactly (\d+) invoices.*?(\d+) invoice jobs exist", out)
    assert sent and int(sent.group(1)) == committed == int(sent.group(2)), out[-4000:]
    tick = "the worker ran the periodic task; pg_cron's tick fired the schedule"
    assert tick in out, out[-4000:]
    assert "stopped and removed the throwaway PostgreSQL" in out
