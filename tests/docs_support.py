"""Running the documentation's code samples (tests/unit/test_docs_site.py and
tests/integration/test_docs_samples.py).

The convention, for the pages in :data:`SAMPLE_PAGES`:

* every fenced ```` ```python ```` block runs, in the order of the page, in one namespace per
  page (a later block uses what an earlier one defined, as a reader typing them would);
* a block whose first line is a file name comment (``# proj.py``) is that module instead: it
  runs as module ``proj`` and the blocks after it import from it;
* the samples connect to :data:`SAMPLE_DATABASE` (user ``app``, password ``secret``, database
  ``app`` on localhost); the tests run them against their own database by putting its address
  there;
* in ```` ```console ```` blocks, a line ``$ celery -A proj pgskip ...`` or
  ``$ python -m kombu_pgskip ...`` is parsed as the command line it is (the command and its
  options must exist), without running it.
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
PURE_SAMPLE_PAGES = ("moving-from-redis-rabbitmq.md", "reference/options.md", "faq.md")
DATABASE_SAMPLE_PAGES = ("getting-started.md", "sqlalchemy.md", "bulk.md")
SAMPLE_PAGES = PURE_SAMPLE_PAGES + DATABASE_SAMPLE_PAGES

#: Every page of the site written for it (the others came from the repository's docs/ folder):
#: their console samples are checked, and each one with Python samples is in SAMPLE_PAGES.
NEW_PAGES = (
    "index.md",
    "getting-started.md",
    "moving-from-redis-rabbitmq.md",
    "sqlalchemy.md",
    "bulk.md",
    "faq.md",
    "reference/options.md",
    "reference/cli.md",
    "reference/exceptions.md",
    "reference/api.md",
    "reference/schema.md",
)

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


def pgskip_command_lines(page: str) -> list[tuple[int, list[str]]]:
    """The ``pgskip`` command lines of the page's console blocks: (line, arguments after
    ``pgskip``)."""
    found = []
    for block in blocks(page, "console"):
        for offset, line in enumerate(block.text.splitlines()):
            if not line.startswith("$ "):
                continue
            words = shlex.split(line[2:], comments=True)
            for prefix in _COMMAND_PREFIXES:
                if tuple(words[: len(prefix)]) == prefix:
                    found.append((block.line + offset, words[len(prefix) :]))
    return found


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
    closed, and Celery's current app is the one before.
    """
    from celery import _state

    # The page's own blocks run as a module too: SQLAlchemy and dataclasses look names up in
    # sys.modules[cls.__module__].
    main = types.ModuleType(f"docs_sample_{Path(page).stem.replace('-', '_')}")
    run = PageRun(namespace=vars(main), modules={})
    current_app = getattr(_state._tls, "current_app", None)
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
