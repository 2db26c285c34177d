"""``python -m kombu_pgskip <command>`` and the ``kombu-pgskip`` script: the ``pgskip`` commands
of ``celery -A proj pgskip`` without a Celery app, for deploy scripts (see :mod:`kombu_pgskip.cli`).
"""

from __future__ import annotations

from .cli import pgskip as main

__all__ = ["main"]

if __name__ == "__main__":
    main()
