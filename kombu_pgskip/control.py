"""Celery's remote control on the pgskip broker: ``inspect scheduled`` lists the stored ETAs too.

A message whose ETA is more than ``eta_threshold`` seconds away waits in the database as
``scheduled`` until it is due (:func:`kombu_pgskip.envelope.to_row`), so no worker holds it in
memory until then, and Celery's own ``scheduled`` command, which lists the worker's timer,
cannot name it. In a Celery worker whose broker is pgskip, the ``scheduled`` command
(``celery -A proj inspect scheduled``, ``app.control.inspect().scheduled()``, Flower) replies
with the ETAs the worker holds, as Celery lists them, followed by those stored for the queues
it consumes:

* in Celery's reply format, ``{"eta": ..., "priority": 6, "request": {...}}``: the request is
  the one the worker builds from the stored message when it receives it (Celery's
  ``Request.info()``: ``id``, ``name``, ``args``, ``kwargs``, ``delivery_info`` ...), and
  ``priority`` is the timer priority Celery's worker gives every ETA task;
* earliest first, at most :data:`STORED_LIMIT` of them; the command takes a ``limit``
  argument (``app.control.inspect()._request("scheduled", limit=5000)``). ``celery -A proj
  pgskip status`` counts them all, per queue;
* each stored message in one worker's reply: of the consumers of a queue whose lease holds,
  the one that registered first lists that queue's stored ETAs, so the replies of all the
  workers name each message once (as with RabbitMQ, where one worker holds each ETA
  message). Which worker runs it is decided when it is due: the first to fetch it. When that
  worker stops, the next oldest consumer of the queue lists them;
* a message is in one list only: a stored message is not in a worker's memory until it is
  promoted and fetched, and a task id already listed from memory is skipped;
* a message whose task the worker does not know, or whose content type it does not accept
  (``accept_content``), is left out, as the worker would refuse it; a body is only decoded if
  its content type is accepted.

The statement runs in the worker's event loop, bounded to :data:`QUERY_SECONDS`: when it
fails or takes longer, the reply lists the ETAs held in memory only and the worker logs a
WARNING saying why.

:func:`install` extends the command; the transport calls it whenever it is created, and it
acts where Celery's worker control module is loaded (a worker, the ``celery`` command). A
worker whose broker is not pgskip is answered by Celery's command unchanged.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Collection
from typing import Any

from .channel import Channel
from .envelope import to_message
from .store import FetchedRow

logger = logging.getLogger(__name__)

#: Most stored ETAs one worker's reply lists, each with its task's args and kwargs.
STORED_LIMIT = 1000
#: Longest the listing's statement may run (and wait for a lock), in the worker's event loop.
QUERY_SECONDS = 0.5
#: The timer priority Celery's worker gives every ETA task (``celery.worker.strategy``:
#: ``call_at(eta, ..., priority=6)``), which its ``scheduled`` command reports.
ETA_PRIORITY = 6

_EXTENDED = "_pgskip_lists_stored_etas"
_lock = threading.Lock()


def install() -> bool:
    """Extend the ``scheduled`` command of Celery's worker (see the module docstring) where
    Celery's worker control module is loaded; idempotent. Returns whether it is extended.

    Nothing is imported: in a process that never loaded ``celery.worker.control`` (a web
    process, a kombu-only program) this does nothing."""
    control = sys.modules.get("celery.worker.control")
    if control is None:
        return False
    with _lock:
        panel: Any = getattr(control, "Panel", None)
        try:
            command = panel.data["scheduled"]
            options = panel.meta["scheduled"]._asdict()
        except (AttributeError, KeyError, TypeError):
            return False  # a Celery whose commands are kept otherwise: leave them as they are
        if getattr(command, _EXTENDED, False):
            return True
        # Registered as Celery registers its own commands: same name, alias and help.
        panel.register(_extended(command), name="scheduled", **options)
        return True


def _extended(celery_scheduled: Callable[..., Any]) -> Callable[..., list[dict[str, Any]]]:
    def scheduled(state: Any, limit: object = None, **kwargs: Any) -> list[dict[str, Any]]:
        held = list(celery_scheduled(state, **kwargs))
        channel = task_channel(state)
        if channel is None:
            return held
        most = parse_limit(limit)
        listed = {str((e.get("request") or {}).get("id")) for e in held if isinstance(e, dict)}
        try:
            stored = stored_etas(state, channel, limit=most, exclude=listed)
        except Exception as exc:
            logger.warning(
                "inspect scheduled: could not list the ETAs waiting in the database (%s); the "
                "reply lists those this worker holds in memory only (celery -A proj pgskip "
                "status counts the stored ones)",
                exc,
                extra={"action": "inspect_scheduled_failed"},
            )
            return held
        return held + stored

    scheduled.__doc__ = celery_scheduled.__doc__
    setattr(scheduled, _EXTENDED, True)
    return scheduled


def parse_limit(limit: object) -> int:
    """The ``limit`` argument of the command: ``None`` for :data:`STORED_LIMIT`, else a whole
    number >= 0 (or a string of its digits)."""
    if limit is None:
        return STORED_LIMIT
    try:
        value = int(str(limit).strip()) if not isinstance(limit, int) else limit
    except ValueError:
        value = -1
    if isinstance(limit, bool) or value < 0:
        raise ValueError(
            f"inspect scheduled: limit={limit!r} is not a whole number >= 0; pass e.g. "
            f"limit=5000 (the default is {STORED_LIMIT})"
        )
    return value


def task_channel(state: Any) -> Channel | None:
    """The pgskip channel the worker of the remote-control ``state`` consumes its task queues
    on, or None (another broker, or not consuming yet)."""
    task_consumer = getattr(getattr(state, "consumer", None), "task_consumer", None)
    channel = getattr(task_consumer, "channel", None)
    return channel if isinstance(channel, Channel) else None


def stored_etas(
    state: Any, channel: Channel, *, limit: int, exclude: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The ETAs stored for the worker's task queues that it lists (``sql/queues.sql``,
    ``stored_etas``), as Celery's ``scheduled`` command lists an ETA task, earliest first;
    those whose task id is in ``exclude`` left out."""
    task_consumer = state.consumer.task_consumer
    queues = list(dict.fromkeys(q.name for q in task_consumer.queues))
    if not queues or limit <= 0:
        return []
    store = channel.store
    with store.bounded(QUERY_SECONDS):
        rows = store.execute(
            "stored_etas",
            {"queues": queues, "consumers": [channel.consumer_id], "limit": limit},
        )
    accept = task_consumer.accept
    if accept is None:  # never decode with everything allowed
        from kombu.serialization import prepare_accept_content

        accept = prepare_accept_content(state.app.conf.accept_content)
    listed = []
    for row_id, queue, redelivered, payload in rows:
        entry = _entry(state, channel, accept, row_id, queue, redelivered, payload)
        if entry is not None and entry["request"]["id"] not in exclude:
            listed.append(entry)
    return listed


def _entry(
    state: Any, channel: Channel, accept: Any, row_id: int, queue: str, redelivered: bool,
    payload: Any,
) -> dict[str, Any] | None:  # fmt: skip
    """One stored message as Celery's ``scheduled`` lists an ETA task, or None when the
    worker would refuse it (unknown task, content type not accepted, not a task message)."""
    from celery.worker.request import Request

    try:
        raw = payload if isinstance(payload, dict) else json.loads(payload)
        name = (raw.get("headers") or {}).get("task")
        task = state.app.tasks.get(name) if isinstance(name, str) else None
        if task is None:
            logger.debug(
                "inspect scheduled: message %s of queue %r is not a task this worker knows",
                row_id,
                queue,
                extra={"action": "inspect_scheduled_skipped"},
            )
            return None
        row = FetchedRow(id=row_id, queue=queue, payload=raw, redelivered=redelivered, attempts=0)
        message = channel.Message(to_message(row), channel=channel, accept=accept)
        request = Request(message, app=state.app, hostname=state.hostname, task=task)
        eta = request.eta
        return {
            "eta": eta.isoformat() if eta else None,
            "priority": ETA_PRIORITY,
            "request": request.info(),
        }
    except Exception as exc:  # what the worker would reject on receipt: not listed
        logger.debug(
            "inspect scheduled: message %s of queue %r left out (%s)",
            row_id,
            queue,
            exc,
            extra={"action": "inspect_scheduled_skipped"},
        )
        return None
