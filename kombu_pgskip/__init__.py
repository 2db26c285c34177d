"""kombu-pgskip: a Celery/kombu message broker inside PostgreSQL.

``broker_url = "pgskip://user:password@host:5432/dbname"`` works in every process of an
environment where the package is installed: ``kombu_pgskip.pth`` registers the ``pgskip`` URL
scheme with kombu when ``kombu.transport`` is first imported (``_kombu_pgskip_alias``).
Importing this package registers it too, for processes where ``.pth`` files do not run
(``python -S``) or that use the source tree without installing it.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from .bulk import apply_many, apply_many_in, batch, publish_many
from .exactly_once import completing
from .exceptions import (
    ConfigurationError,
    ConnectionClosed,
    ConnectionFailed,
    ConnectionInAutocommit,
    DeliveryLost,
    DuplicateTask,
    InvalidQueueName,
    InvalidURL,
    MessageTooLarge,
    NotAConnection,
    PermissionDenied,
    PersistentDatabaseError,
    PgSkipError,
    PreconditionFailed,
    SchemaError,
    SchemaNotInstalled,
    SchemaOutdated,
    TransactionAborted,
    TransactionalEnqueueError,
    TransientDatabaseError,
    UnsupportedCanvas,
)
from .migrate import migrate
from .publish import apply_async_in, send_task_in, transaction
from .urls import mask_url

#: The distribution's version: pyproject.toml reads it from here (``tool.setuptools.dynamic``).
__version__ = "0.1.0"

TRANSPORT_PATH = "kombu_pgskip.transport:Transport"
"""The transport's import path, for ``broker_transport`` where the ``pgskip://`` scheme is not
registered: ``broker_transport = "kombu_pgskip.transport:Transport"``."""


def register() -> None:
    """Register the ``pgskip`` scheme with kombu (idempotent; done on import)."""
    TRANSPORT_ALIASES.setdefault("pgskip", TRANSPORT_PATH)


register()

__all__ = [
    "TRANSPORT_PATH",
    "ConfigurationError",
    "ConnectionClosed",
    "ConnectionFailed",
    "ConnectionInAutocommit",
    "DeliveryLost",
    "DuplicateTask",
    "InvalidQueueName",
    "InvalidURL",
    "MessageTooLarge",
    "NotAConnection",
    "PermissionDenied",
    "PersistentDatabaseError",
    "PgSkipError",
    "PreconditionFailed",
    "SchemaError",
    "SchemaNotInstalled",
    "SchemaOutdated",
    "TransactionAborted",
    "TransactionalEnqueueError",
    "TransientDatabaseError",
    "UnsupportedCanvas",
    "apply_async_in",
    "apply_many",
    "apply_many_in",
    "batch",
    "completing",
    "mask_url",
    "migrate",
    "publish_many",
    "register",
    "send_task_in",
    "transaction",
]
