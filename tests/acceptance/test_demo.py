"""The README's demo command, end to end, as a newcomer runs it (its own throwaway PostgreSQL)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]


def test_demo_processes_exactly_the_committed_orders_and_fires_a_cron_tick() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--orders", "24"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    placed = re.search(r"placed 24 orders: (\d+) committed, (\d+) rolled back", out)
    assert placed, out[-4000:]
    committed, rolled_back = int(placed.group(1)), int(placed.group(2))
    assert committed + rolled_back == 24 and rolled_back > 0
    sent = re.search(r"worker sent exactly (\d+) invoices.*?(\d+) invoice jobs exist", out)
    assert sent and int(sent.group(1)) == committed == int(sent.group(2)), out[-4000:]
    assert "pg_cron fired the periodic task and the worker ran it" in out, out[-4000:]
    assert "stopped and removed the throwaway PostgreSQL" in out
