"""Running the documentation's code samples (tests/unit/test_docs_site.py and
tests/integration/test_docs_samples.py).

The convention, for the pages in :data:`SAMPLE_PAGES`:

* every fenced ```` ```python ```` block runs, in the order of the page, in one namespace per
  page (a later block uses what an earlier one defined, as a reader typing them would);
* a block whose first line is a file name comment (``# proj.py``) is that module instead: it
  runs as module ``proj`` and the blocks after it import from it;
* the samples connect to :data:`SAMPLE_DATABASE` (user ``app``, password ``secret``, database
  ``app`` on localhost); the tests run them against their own database by putting its address
  there.

Every page's other samples:

* in ```` ```console ```` blocks, a line ``$ celery -A proj pgskip ...`` or
  ``$ python -m kombu_pgskip ...`` is parsed as the command line it is (the command and its
  options must exist), without running it; such a command line is written nowhere else than in
  a console block (:func:`misplaced_command_lines`);
* a ```` ```sql ```` block of queries (``SELECT``, ``WITH``) runs against a migrated database;
  a block of other statements (``CREATE ROLE``, ``GRANT``: what an operator runs as a
  superuser or the owner) is not run, and a block mixes none of the two
  (:func:`sql_queries`);
* the pages of :data:`PYTEST_SUITE_PAGES` show the files of a pytest suite, every block a
  ``# name.py`` file: the suite runs (:func:`suite_files`);
* :data:`SAMPLES_RUN_ELSEWHERE` names the test that runs a page's samples its own way.
"""

from __future__ import annotations

import re
import shlex
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.helpers import REPO_ROOT

DOCS = REPO_ROOT / "docs"

#: The pages whose samples run, and where: without a database (the unit test) or against the
#: test database (the integration test). A new page with Python samples goes in one of them.
PURE_SAMPLE_PAGES = (
    "moving-from-redis-rabbitmq.md",
    "reference/options.md",
    "faq.md",
    "reliability.md",
)
DATABASE_SAMPLE_PAGES = (
    "getting-started.md",
    "sqlalchemy.md",
    "bulk.md",
    "transactional-enqueue.md",
    "periodic-tasks.md",
    "metrics.md",
    "unique.md",
)
SAMPLE_PAGES = PURE_SAMPLE_PAGES + DATABASE_SAMPLE_PAGES

#: Pages whose Python samples are the files of a pytest suite (conftest.py, test_*.py): the
#: integration test writes them to a directory and runs pytest there.
PYTEST_SUITE_PAGES = ("testing.md",)

#: Pages whose Python samples another test runs, by that test.
SAMPLES_RUN_ELSEWHERE = {
    # Every line of the guide's samples is in the Django project or the shell session that
    # test runs (test_every_line_of_the_guides_python_samples_is_in_what_this_module_runs).
    "django.md": "tests/acceptance/test_django.py",
    # The guide's task runs in a real worker (test_the_guides_task_charges_once).
    "exactly-once.md": "tests/acceptance/test_completing.py",
}

#: Every page of the site (relative to docs/).
PAGES = tuple(sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")))

#: The database the samples name, after the scheme (``pgskip://``, ``postgresql+psycopg://``).
SAMPLE_DATABASE = "app:secret@localhost:5432/app"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MODULE_COMMENT = re.compile(r"#\s*([A-Za-z_]\w*)\.py\s*$")
_COMMAND_PREFIXES = (("celery", "-A", "proj", "pgskip"), ("python", "-m", "kombu_pgskip"))


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: its language, text, and first line in the page."""

    page: str
    language: str
    text: str
    line: int

    @property
    def module(self) -> str | None:
        """The module this block is (its first line is ``# name.py``), or None."""
        first = self.text.split("\n", 1)[0]
        match = _MODULE_COMMENT.fullmatch(first.strip())
        return match.group(1) if match else None


def blocks(page: str, language: str) -> list[Block]:
    """The fenced blocks of ``page`` (relative to docs/) in ``language``, in page order."""
    text = (DOCS / page).read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        if match.group(1) == language:
            line = text.count("\n", 0, match.start()) + 2
            found.append(Block(page, language, match.group(2), line))
    return found


def _command_words(line: str) -> list[str] | None:
    """The words after ``pgskip`` when ``line`` is a pgskip command line, else None."""
    words = shlex.split(line, comments=True)
    for prefix in _COMMAND_PREFIXES:
        if tuple(words[: len(prefix)]) == prefix:
            return words[len(prefix) :]
    return None


def pgskip_command_lines(page: str) -> list[tuple[int, list[str]]]:
    """The ``pgskip`` command lines of the page's console blocks: (line, arguments after
    ``pgskip``)."""
    found = []
    for block in blocks(page, "console"):
        for offset, line in enumerate(block.text.splitlines()):
            if not line.startswith("$ "):
                continue
            words = _command_words(line[2:])
            if words is not None:
                found.append((block.line + offset, words))
    return found


def misplaced_command_lines(page: str) -> list[tuple[int, str]]:
    """Lines of the page's blocks other than console blocks that are ``pgskip`` command lines
    (which the console check would not see): (line, text)."""
    text = (DOCS / page).read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        if match.group(1) == "console":
            continue
        first = text.count("\n", 0, match.start()) + 2
        for offset, line in enumerate(match.group(2).splitlines()):
            stripped = line.strip().removeprefix("$ ")
            if stripped.startswith(("celery -A proj pgskip", "python -m kombu_pgskip")):
                found.append((first + offset, line))
    return found


_QUERY = re.compile(r"(SELECT|WITH|TABLE|SHOW)\b", re.IGNORECASE)


def sql_statements(sql: str) -> list[str]:
    """The statements of ``sql``, without ``--`` comments (a sample has no ``;`` in literals)."""
    lines = [line.split("--", 1)[0] for line in sql.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def sql_queries(page: str) -> list[Block]:
    """The page's ```` ```sql ```` blocks of queries, to run. A block of other statements (an
    operator's ``CREATE ROLE`` or ``GRANT``) is left out; one that mixes queries with other
    statements is an error, so that no query goes unrun."""
    queries = []
    for block in blocks(page, "sql"):
        kinds = {bool(_QUERY.match(s)) for s in sql_statements(block.text)}
        if kinds == {True, False}:
            raise ValueError(f"docs/{page}:{block.line}: queries and other statements in one block")
        if kinds == {True}:
            queries.append(block)
    return queries


def suite_files(page: str) -> dict[str, str]:
    """The files of the pytest suite a page of :data:`PYTEST_SUITE_PAGES` shows: module name
    (``conftest``, ``test_orders``, ...) to text, each block's ``# name.py`` line kept."""
    files: dict[str, str] = {}
    for block in blocks(page, "python"):
        if block.module is None:
            raise ValueError(f"docs/{page}:{block.line}: a suite's block starts with # name.py")
        if block.module in files:
            raise ValueError(f"docs/{page}:{block.line}: {block.module}.py shown twice")
        files[block.module] = block.text
    return files


def documented_tables(page: str) -> dict[str, list[str]]:
    """The tables a schema page describes, by its ``## `name``` sections, each with the
    backticked names of the first column of its Markdown tables, in order."""
    text = (DOCS / page).read_text(encoding="utf-8")
    parts = re.split(r"^## `(\w+)`$", text, flags=re.MULTILINE)
    tables = {}
    for name, section in zip(parts[1::2], parts[2::2], strict=True):
        section = re.split(r"^## ", section, flags=re.MULTILINE)[0]
        tables[name] = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    return tables


def sample_address(db_url: str) -> str:
    """What replaces :data:`SAMPLE_DATABASE` so that the samples reach ``db_url``'s database."""
    parts = urlsplit(db_url)
    if not parts.netloc or parts.query:
        raise ValueError(f"the samples need a plain postgresql:// URL, not {db_url!r}")
    return parts.netloc + parts.path


@dataclass
class PageRun:
    """What running a page's samples left: the page's namespace and the modules it defined."""

    namespace: dict[str, Any]
    modules: dict[str, types.ModuleType]

    def values(self) -> Iterator[Any]:
        yield from self.namespace.values()
        for module in self.modules.values():
            yield from vars(module).values()


@contextmanager
def run_samples(page: str, address: str | None = None) -> Iterator[PageRun]:
    """Run the Python samples of ``page`` (see the module docstring); yields what they left.

    ``address`` replaces :data:`SAMPLE_DATABASE` in them. Afterwards the modules are removed
    from ``sys.modules``, the connections, engines and Celery apps the samples left open are
    closed, Celery's current app is the one before, and the samples' ``@app.task`` functions
    are no longer added to every app finalized later (Celery's shared tasks: two pages that
    both define ``proj.send_invoice_email`` would otherwise collide in the next app).
    """
    from celery import _state

    # The page's own blocks run as a module too: SQLAlchemy and dataclasses look names up in
    # sys.modules[cls.__module__].
    main = types.ModuleType(f"docs_sample_{Path(page).stem.replace('-', '_')}")
    run = PageRun(namespace=vars(main), modules={})
    current_app = getattr(_state._tls, "current_app", None)
    finalizers = set(_state._on_app_finalizers)
    sys.modules[main.__name__] = main
    try:
        for block in blocks(page, "python"):
            code = block.text if address is None else block.text.replace(SAMPLE_DATABASE, address)
            compiled = compile(code, f"docs/{page}:{block.line}", "exec")
            if block.module is not None:
                module = types.ModuleType(block.module)
                module.__file__ = f"docs/{page}"
                sys.modules[block.module] = module
                run.modules[block.module] = module
                exec(compiled, vars(module))
            else:
                exec(compiled, run.namespace)
        yield run
    finally:
        for name in [main.__name__, *run.modules]:
            sys.modules.pop(name, None)
        _close(run)
        _state._tls.current_app = current_app
        _state._on_app_finalizers.intersection_update(finalizers)


def _close(run: PageRun) -> None:
    import psycopg
    from celery import Celery

    sqlalchemy = sys.modules.get("sqlalchemy.engine")
    for value in list(run.values()):
        if isinstance(value, Celery):
            if value._pool is not None:  # the broker connections .delay() opened
                value._pool.force_close_all()
            value.close()
        elif isinstance(value, psycopg.Connection):
            value.close()
        elif sqlalchemy is not None and isinstance(value, sqlalchemy.Engine):
            value.dispose()
