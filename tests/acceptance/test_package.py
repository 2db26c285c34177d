"""The release artefacts: ``python -m build`` makes an sdist and, from it, a wheel that installs
with its dependencies into a clean virtualenv and works there (scripts/check-package.sh)."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.acceptance


def test_sdist_and_wheel_build_install_in_a_clean_virtualenv_and_pass_the_smoke_test() -> None:
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "check-package.sh")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "LICENSE in both; METADATA has License-Expression: MIT" in out, out[-4000:]
    assert "kombu_pgskip.pth at the top of the wheel, in RECORD" in out, out[-4000:]
    assert "imports from the wheel, pgskip:// resolves without importing it" in out, out[-4000:]
    assert "the pytest plugin loads" in out, out[-4000:]
