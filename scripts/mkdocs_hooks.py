"""What the documentation site (mkdocs.yml) needs beyond MkDocs and its plugins.

* :func:`on_page_markdown`, an MkDocs hook: the changelog page is CHANGELOG.md. That file sits
  at the top of the repository and links to pages as ``docs/<page>.md``, which is right where it
  is read (a repository browser, the sdist) but not from the site's ``changelog.md``; its text
  is put there with those links made relative to ``docs/``. Any other relative link in it stays
  as written, so that ``mkdocs build --strict`` reports it.
* :class:`SphinxRoles`, a griffe extension (mkdocstrings' ``extensions``): the package's
  docstrings are reStructuredText for ``help()`` and Sphinx, the site renders Markdown. It turns
  cross-references (``:class:`~kombu_pgskip.exceptions.NotAConnection```) into links where the
  site documents the target and into code elsewhere, and ``.. code-block::`` directives into
  fenced code blocks.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import griffe

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"

#: ``](docs/...)``: an inline link to a page of the site, written from the repository's root.
_DOCS_LINK = re.compile(r"\]\(docs/")


def changelog_markdown() -> str:
    """CHANGELOG.md as the site's changelog page shows it."""
    return _DOCS_LINK.sub("](", CHANGELOG.read_text(encoding="utf-8"))


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == "changelog.md":
        return changelog_markdown()
    return markdown


#: A Sphinx cross-reference: ``:func:`name```, ``:class:`~package.module.Name```.
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|exc|mod|obj):`(~?)([\w.]+)(\(\))?`")
#: A ``.. code-block:: lang`` directive, its blank line, and its indented body.
_CODE_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)\.\. code-block::[ \t]*(?P<lang>\w*)[ \t]*\n[ \t]*\n"
    r"(?P<body>(?:(?P=indent)[ \t]+\S.*\n|[ \t]*\n)+)",
    re.MULTILINE,
)


def _reference(match: re.Match[str], module: str) -> str:
    tilde, target, call = match.group(1), match.group(2), match.group(3) or ""
    shown = target.rsplit(".", 1)[-1] if tilde else target
    # A bare name is relative to the docstring's module, as Sphinx resolves it there.
    identifier = target if "." in target else f"{module}.{target}"
    # mkdocs-autorefs links an optional reference where the site documents its target and
    # leaves it as plain code elsewhere (Celery's and psycopg's classes, private helpers).
    return f'<autoref optional identifier="{identifier}"><code>{shown}{call}</code></autoref>'


def _fence(match: re.Match[str]) -> str:
    body = textwrap.dedent(match.group("body").rstrip("\n") + "\n")
    indent = match.group("indent")
    lines = [f"```{match.group('lang')}", *body.rstrip("\n").split("\n"), "```"]
    return "".join(f"{indent}{line}\n" if line else "\n" for line in lines) + "\n"


def markdown_docstring(text: str, module: str) -> str:
    """A reStructuredText docstring's cross-references and code blocks, as Markdown."""
    text = _CODE_BLOCK.sub(_fence, text if text.endswith("\n") else text + "\n")
    return _ROLE.sub(lambda m: _reference(m, module), text).rstrip("\n")


class SphinxRoles(griffe.Extension):
    """Docstrings of the package rendered as Markdown (see the module docstring)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value, obj.module.path)
