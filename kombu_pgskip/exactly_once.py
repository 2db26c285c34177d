"""Finish a task's message in the task's own transaction: its work and its completion commit
together, or neither does.

.. code-block:: python

    @app.task(bind=True, acks_late=True)
    def charge(self, invoice_id):
        with kombu_pgskip.completing(self) as conn:
            conn.execute("UPDATE invoices SET paid = true WHERE id = %s", (invoice_id,))

:func:`completing` opens a transaction (on a psycopg 3 connection of its own to the broker's
database, or in the caller's transaction on the connection given: psycopg 3 or 2, SQLAlchemy,
Django, as :func:`~kombu_pgskip.apply_async_in` takes them) and, before the block runs, marks
the message the task was delivered from as done in that transaction: ``finished_at`` set on
its row, fenced by the delivery's token (``sql/consume.sql``, ``finish_in_transaction``), which
also locks the row until the transaction ends. Then:

* **committed**: the work and the mark are durable together. The worker's ack then completes
  the message as usual; if the worker dies before it (``kill -9`` right after the commit, a
  lost connection, a lease that runs out), every path that would return the message to its
  queue completes it instead (migration 0022), so the task never runs again;
* **rolled back** (the block raised, or the caller's transaction rolled back later): nothing
  of it is left, the message is as it was delivered, and the exception reaches Celery as any
  task's (``autoretry_for``, ``self.retry()``, ``FAILURE``). A worker that dies inside the
  block leaves no work behind either, and its message is delivered again;
* **the delivery is no longer this worker's** (its lease ran out and the message went to
  another worker, or it was settled): :class:`~kombu_pgskip.exceptions.DeliveryLost` is raised
  before the block runs, the transaction rolls back, and the other delivery does the work.

The task must acknowledge late (``acks_late=True``): with Celery's default early ack the
message is completed before the task starts, and its completion could not commit with the
work. A task run eagerly (``apply()``, ``task_always_eager``, tests) has no message: the block
runs in its transaction and nothing is marked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import exceptions
from .adapters import Adapter, adapt, pyformat_text
from .envelope import parse_tag
from .options import app_broker
from .sql import queries_in, raw_queries_in
from .urls import connect


def delivery_of(task: Any) -> tuple[int, int] | None:
    """(row id, delivery token) of the message ``task`` (bound: ``self``) runs from, or None
    when it runs without one (eagerly, or called directly)."""
    request = getattr(task, "request", None)
    if request is None or getattr(request, "is_eager", False):
        return None
    if getattr(request, "called_directly", False):
        return None
    properties = getattr(request, "properties", None) or {}
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    if tag is None:
        return None
    try:
        return parse_tag(tag)
    except ValueError:
        raise exceptions.ConfigurationError(
            f"completing(): task {getattr(task, 'name', task)!r} was not delivered by the pgskip "
            f"broker (delivery tag {tag!r}): it finishes messages of a pgskip:// broker only"
        ) from None


def _check_acks_late(task: Any) -> None:
    if not getattr(task, "acks_late", False):
        raise exceptions.ConfigurationError(
            f"completing(): task {getattr(task, 'name', task)!r} acknowledges early, so its "
            "message is completed before it runs and could not commit with its work: declare "
            "it with @app.task(acks_late=True) (or task_acks_late = True)"
        )


@contextmanager
def completing(task: Any, conn: object = None) -> Iterator[Any]:
    """Run the block in a transaction that also marks ``task``'s message done (see the module
    docstring); yields the connection the block's work goes through.

    ``task`` is the bound task (``self`` in ``@app.task(bind=True, acks_late=True)``).
    Without ``conn``, a psycopg 3 connection to the broker's database is opened for the block,
    in a transaction committed when the block ends (rolled back if it raises), and closed.
    With ``conn`` (an open psycopg 3 or 2 connection, SQLAlchemy ``Connection`` or
    ``Session``, or Django's ``connection`` inside ``transaction.atomic()``), the mark goes into
    the caller's transaction, which the caller commits or rolls back; nothing is committed
    here."""
    _check_acks_late(task)
    delivery = delivery_of(task)
    url, schema = app_broker(task.app)
    if conn is not None:
        _finish(adapt(conn), schema, delivery, task)
        yield conn
        return
    if url is None:
        raise exceptions.ConfigurationError(
            "completing(): the Celery app has no broker_url; pass the connection to use"
        )
    own = connect(url, autocommit=False, pin_search_path=False)
    try:
        with own.transaction():
            _finish(adapt(own), schema, delivery, task)
            yield own
    finally:
        own.close()


def _finish(adapter: Adapter, schema: str, delivery: tuple[int, int] | None, task: Any) -> None:
    """Check that the connection is in a transaction and mark the delivered message done in it
    (nothing to mark without a delivery), or raise
    :class:`~kombu_pgskip.exceptions.DeliveryLost`."""
    adapter.check()
    if delivery is None:
        return
    row_id, token = delivery
    query = queries_in("consume.sql", schema)["finish_in_transaction"]
    text = pyformat_text(raw_queries_in("consume.sql")["finish_in_transaction"], schema)
    rows = adapter.run(query, text, {"id": row_id, "delivery": token})
    if not rows:
        raise exceptions.DeliveryLost(
            f"completing(): message {row_id} of task {getattr(task.request, 'id', '?')} is no "
            "longer this worker's delivery (its lease ran out and another worker took it, or it "
            "was settled): the transaction is rolled back, so that its work is done once"
        )
