"""The README's demo run in the background (``python -m examples.demo``), shared by
``tests/acceptance/test_demo.py`` and the acceptance conftest that starts it early."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

ORDERS = 24


class DemoRun:
    """``python -m examples.demo`` running in the background, its output in a file."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self._out = tempfile.NamedTemporaryFile(prefix="pgskip-demo-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "examples.demo", "--orders", str(ORDERS)],
            cwd=REPO_ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def result(self, timeout: float) -> tuple[int, str]:
        """The demo's exit status and output, once it ended (killed after ``timeout``)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = -1
        return code, Path(self._out.name).read_text(errors="replace")

    def stop(self) -> None:
        """Interrupt it as Ctrl-C would, so that it stops its worker and PostgreSQL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


DEMO_RUN = pytest.StashKey[DemoRun]()
