"""Registers the ``pgskip`` URL scheme with kombu in every process of an environment where
kombu-pgskip is installed.

The wheel installs ``kombu_pgskip.pth`` at the top of site-packages; Python's :mod:`site` runs
its one line, ``import _kombu_pgskip_alias; _kombu_pgskip_alias.install()``, at start-up.
:func:`install` puts a finder at the front of :data:`sys.meta_path` that answers for no module
but ``kombu.transport``: that one loads as usual, then ``pgskip`` is added to its
``TRANSPORT_ALIASES`` (``setdefault``: an alias set by the application stays) and the finder
leaves :data:`sys.meta_path`. This module imports only :mod:`sys` and imports neither kombu nor
``kombu_pgskip``: ``kombu_pgskip.transport`` is imported when kombu first resolves the alias.

PYTEST_DONT_REWRITE: pytest marks the modules of a distribution with a pytest plugin for
assertion rewriting, and warns about those imported already; this one is, by the ``.pth``.

Not in effect under ``python -S`` (no :mod:`site`, no ``.pth`` files); ``import kombu_pgskip``
registers the scheme there.
"""

import sys

# Annotations only: importing typing at every start-up would cost more than this whole module.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

#: The module whose import adds the alias.
TRANSPORT_MODULE = "kombu.transport"
#: The URL scheme (``pgskip://``) and the transport class kombu resolves it to; the same as
#: ``kombu_pgskip.TRANSPORT_PATH``.
ALIAS = "pgskip"
TRANSPORT_PATH = "kombu_pgskip.transport:Transport"


def register(transport_module: "ModuleType") -> None:
    """Add the alias to ``transport_module.TRANSPORT_ALIASES`` unless it is there (a kombu
    without that dict is left alone)."""
    aliases = getattr(transport_module, "TRANSPORT_ALIASES", None)
    if isinstance(aliases, dict):
        aliases.setdefault(ALIAS, TRANSPORT_PATH)


class _AliasLoader:
    """The loader ``kombu.transport`` was found with, which registers the alias after the
    module has run and then gives the module back its own loader."""

    def __init__(self, loader: "Any") -> None:
        self._loader = loader

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: "ModuleType") -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        register(module)
        uninstall()

    def __getattr__(self, name: str) -> "Any":
        # get_source, get_filename, is_package, get_resource_reader ...: the real loader's.
        return getattr(self._loader, name)


class _TransportFinder:
    """A :data:`sys.meta_path` finder for ``kombu.transport`` only: it asks the finders after
    it and wraps the loader they return."""

    def find_spec(
        self,
        fullname: str,
        path: "Sequence[str] | None" = None,
        target: "ModuleType | None" = None,
    ) -> "ModuleSpec | None":
        if fullname != TRANSPORT_MODULE:
            return None
        for finder in list(sys.meta_path):
            find_spec = None if finder is self else getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is None:
                continue
            if hasattr(spec.loader, "exec_module"):
                spec.loader = _AliasLoader(spec.loader)  # type: ignore[assignment]
            return spec
        return None


_FINDER = _TransportFinder()


def install() -> None:
    """Register the alias when ``kombu.transport`` is imported (at once if it already is)."""
    module = sys.modules.get(TRANSPORT_MODULE)
    if module is not None:
        register(module)
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Take the finder off :data:`sys.meta_path` (nothing happens if it is not there)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def installed() -> bool:
    """Whether the finder is waiting for ``kombu.transport``."""
    return _FINDER in sys.meta_path
