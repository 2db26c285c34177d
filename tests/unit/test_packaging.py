"""The distribution's metadata: one version, an SPDX license with its text, and exactly the
dependencies the code imports, libpq's binary build as an extra."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from typing import Any

import pytest

import kombu_pgskip
from tests.helpers import REPO_ROOT

tomllib = pytest.importorskip("tomllib")


def _project() -> dict[str, Any]:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f))


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def test_the_version_is_written_once_in_the_package() -> None:
    data = _project()
    assert "version" not in data["project"] and data["project"]["dynamic"] == ["version"]
    version = data["tool"]["setuptools"]["dynamic"]["version"]
    assert version == {"attr": "kombu_pgskip.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", kombu_pgskip.__version__)
    assert importlib.metadata.version("kombu-pgskip") == kombu_pgskip.__version__


def test_the_license_is_an_spdx_expression_with_its_text_shipped() -> None:
    project = _project()["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert (REPO_ROOT / "LICENSE").read_text().startswith("MIT License\n")
    # PEP 639: no License :: classifier next to a license expression
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_dependencies_are_what_the_code_imports_and_libpq_binary_is_an_extra() -> None:
    project = _project()["project"]
    imported: set[str] = set()
    for path in (REPO_ROOT / "kombu_pgskip").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported - set(sys.stdlib_module_names) if m != "kombu_pgskip"}
    # imported only by an optional feature (kombu_pgskip.metrics), which its extra installs
    optional = {"prometheus_client": "metrics", "django": "django"}
    for module, extra in optional.items():
        assert module in third_party
        assert _name(module) in {_name(r) for r in project["optional-dependencies"][extra]}
    assert {_name(r) for r in project["dependencies"]} == third_party - set(optional)
    assert not [r for r in project["dependencies"] if "[" in r]
    assert project["optional-dependencies"]["binary"] == ["psycopg[binary]>=3.1.18"]
