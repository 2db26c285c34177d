"""The system check of the app's settings (``manage.py check``; ``migrate``, ``runserver`` and
``test`` run it too)."""

from __future__ import annotations

from typing import Any

from ...exceptions import ConfigurationError
from . import conf


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``kombu_pgskip.E001``: the database is not PostgreSQL or not in ``DATABASES``;
    ``kombu_pgskip.E002``: the transport options are not valid."""
    from django.core.checks import Error  # type: ignore[import-untyped]

    errors: list[Any] = []
    try:
        problem = conf.database_problem(conf.database_alias())
    except ConfigurationError as exc:
        problem = str(exc)
    if problem is not None:
        errors.append(Error(problem, id="kombu_pgskip.E001"))
    try:
        conf.schema()
    except ConfigurationError as exc:
        errors.append(Error(f"{conf.OPTIONS_SETTING}: {exc}", id="kombu_pgskip.E002"))
    return errors
