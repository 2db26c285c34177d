"""The documentation site: it builds with every link checked, its reference pages list
everything the code has, and its samples without a database run (tests/docs_support.py;
the schema reference and the samples that need a database: tests/integration/test_docs_samples.py).

The build needs the ``docs`` extra (mkdocs, mkdocs-material, mkdocstrings); without it the
build test fails, naming the install, rather than skipping.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import click
import pytest
from kombu import Connection

import kombu_pgskip
from kombu_pgskip import cron, exceptions, periodic
from kombu_pgskip.cli import pgskip
from kombu_pgskip.options import Options
from kombu_pgskip.transport import Transport
from tests.docs_support import (
    DOCS,
    PAGES,
    PURE_SAMPLE_PAGES,
    PYTEST_SUITE_PAGES,
    SAMPLE_PAGES,
    SAMPLES_RUN_ELSEWHERE,
    blocks,
    misplaced_command_lines,
    pgskip_command_lines,
    run_samples,
    sql_queries,
    sql_statements,
    suite_files,
)
from tests.helpers import REPO_ROOT

DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _sections(page: str) -> dict[str, str]:
    """The page's ``##`` sections by heading (backticks removed), each with its text."""
    parts = re.split(r"^## (.+)$", _page(page), flags=re.MULTILINE)
    return {
        heading.strip().strip("`"): text
        for heading, text in zip(parts[1::2], parts[2::2], strict=True)
    }


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", heading.lower()).strip("-")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def test_site_builds_with_every_link_and_anchor_checked(tmp_path: Path) -> None:
    missing = [name for name in DOCS_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed: the docs site needs the docs extra "
            '(pip install -e ".[docs]"; scripts/bootstrap.sh installs it)'
        )
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    # The changelog page is CHANGELOG.md, its links made relative to docs/.
    changelog = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    assert "User-visible changes of kombu-pgskip" in changelog
    assert 'href="../metrics/"' in changelog
    # mkdocstrings rendered the public API from the docstrings.
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="kombu_pgskip.apply_async_in"' in api
    assert "Commit: the job exists and idle workers wake at once." in api
    # The docstrings' reStructuredText became Markdown (scripts/mkdocs_hooks.py: SphinxRoles).
    assert ":class:" not in api
    assert "code-block::" not in api


def test_options_table_lists_every_transport_option_with_its_default() -> None:
    rows = re.findall(
        r"^\| `(\w+)` \| `([^`]+)` \|", _page("reference/options.md"), flags=re.MULTILINE
    )
    documented = {name: ast.literal_eval(default) for name, default in rows}
    defaults = {f.name: f.default for f in fields(Options)}
    assert list(documented) == list(defaults)  # every option, once, in the dataclass's order
    assert documented == defaults


def test_cli_reference_names_every_command_option_and_argument() -> None:
    sections = _sections("reference/cli.md")
    by_slug = {_slug(heading): text for heading, text in sections.items()}
    assert "pgskip --version`" in _page("reference/cli.md")
    for name, command in pgskip.commands.items():
        assert name in sections, f"reference/cli.md has no section for `{name}`"
        text = sections[name]
        # Options described once elsewhere on the page count where the section links to them.
        for anchor in re.findall(r"\]\(#([\w-]+)\)", text):
            text += by_slug[anchor]
        for param in command.params:
            if isinstance(param, click.Argument):
                assert f"`{param.human_readable_name}`" in text, (name, param.name)
                continue
            option = max(param.opts, key=len)
            assert re.search(rf"`{re.escape(option)}[ `]", text), f"{name}: {option}"


@pytest.mark.parametrize("page", [p for p in PAGES if pgskip_command_lines(p)])
def test_pgskip_command_lines_of_the_page_parse(page: str) -> None:
    for line, args in pgskip_command_lines(page):
        name, rest = args[0], args[1:]
        command = pgskip.commands.get(name)
        assert command is not None, f"docs/{page}:{line}: no command {name!r}"
        try:
            command.make_context(name, rest, parent=click.Context(pgskip))
        except click.ClickException as exc:
            pytest.fail(f"docs/{page}:{line}: pgskip {' '.join(args)}: {exc.format_message()}")


def _exception_classes() -> list[tuple[ModuleType, type[BaseException]]]:
    """The public exception classes of exceptions.py, and of the other modules that define
    errors users meet (a PgSkipError there)."""
    found = []
    # kombu_pgskip.migrate is the function: the module is in sys.modules.
    for module in (exceptions, cron, periodic, sys.modules["kombu_pgskip.migrate"]):
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
                and (module is exceptions or issubclass(obj, exceptions.PgSkipError))
            ):
                found.append((module, obj))
    return found


def test_exceptions_reference_has_every_exception_with_its_default_message() -> None:
    page = _page("reference/exceptions.md")
    headings = re.findall(r"^### `(\w+)`$", page, flags=re.MULTILINE)
    classes = _exception_classes()
    assert sorted(headings) == sorted(cls.__name__ for _, cls in classes)
    text = _one_line(page)
    for module, cls in classes:
        if module is exceptions:
            assert issubclass(cls, exceptions.PgSkipError)
            assert _one_line(cls.default_message()) in text, cls.__name__


def test_api_reference_renders_every_public_name_and_exception() -> None:
    targets = re.findall(r"^::: (\S+)$", _page("reference/api.md"), flags=re.MULTILINE)
    rendered = {id(pkgutil.resolve_name(target)) for target in targets}
    public = {name: getattr(kombu_pgskip, name) for name in kombu_pgskip.__all__}
    for module, cls in _exception_classes():
        if module is exceptions:
            public[cls.__name__] = cls
    assert [name for name, obj in public.items() if id(obj) not in rendered] == []


def test_pgskip_command_lines_are_in_console_blocks_only() -> None:
    misplaced = [
        (page, line, text) for page in PAGES for line, text in misplaced_command_lines(page)
    ]
    assert misplaced == []


def test_every_page_with_python_samples_has_them_run() -> None:
    with_samples = {page for page in PAGES if blocks(page, "python")}
    run = [*SAMPLE_PAGES, *PYTEST_SUITE_PAGES, *SAMPLES_RUN_ELSEWHERE]
    assert sorted(run) == sorted(set(run))  # each page is run one way
    assert with_samples == set(run)
    for page in PYTEST_SUITE_PAGES:
        assert suite_files(page)  # every block is a file of the suite
    for page, test in SAMPLES_RUN_ELSEWHERE.items():
        assert f"docs/{page}" in (REPO_ROOT / test).read_text(encoding="utf-8"), (page, test)


def test_every_sql_block_is_queries_or_an_operators_statements() -> None:
    """The queries run (test_docs_samples.py); the other blocks hold what an operator runs as
    a superuser or the owner, which the tests do not run (sql_queries refuses a mix)."""
    operator = ("CREATE", "ALTER", "DROP", "GRANT", "REVOKE", "COMMENT")
    queries = {(b.page, b.line) for page in PAGES for b in sql_queries(page)}
    assert ("reference/schema.md", blocks("reference/schema.md", "sql")[0].line) in queries
    for page in PAGES:
        for block in blocks(page, "sql"):
            if (page, block.line) not in queries:
                words = [s.split(None, 1)[0].upper() for s in sql_statements(block.text)]
                assert set(words) <= set(operator), (page, block.line, words)


def test_security_guides_grants_are_what_pgskip_grant_runs() -> None:
    from kombu_pgskip.grants import grant_statements

    shown = [b.text for b in blocks("security.md", "sql") if b.text.startswith("GRANT CONNECT")]
    grants = grant_statements("app", "pgskip", workers=["app_worker"], publishers=["app_web"])
    assert shown == ["".join(f"{grant.text()};\n" for grant in grants)]


@pytest.mark.parametrize("page", PURE_SAMPLE_PAGES)
def test_configuration_samples_of_the_page_are_accepted_by_the_transport(page: str) -> None:
    with run_samples(page) as run:
        config = vars(run.modules["celeryconfig"])
        connection = Connection(config["broker_url"], transport=config.get("broker_transport"))
        try:
            assert issubclass(connection.get_transport_cls(), Transport)
        finally:
            connection.release()
        options = Options.from_transport_options(config.get("broker_transport_options", {}))
        for name, value in config.get("broker_transport_options", {}).items():
            assert getattr(options, name) == value
