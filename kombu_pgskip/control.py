"""Celery's remote control on the pgskip broker: ``inspect scheduled`` lists the stored ETAs
too, and ``control revoke`` lasts.

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

``revoke`` (``celery -A proj control revoke ID``, ``app.control.revoke(id)``, Flower) does
what Celery's does, which reaches only the memory of the workers running now: a worker that
starts later would run a message still waiting in the queue. It then marks the messages of
those task ids still waiting in the database (``pending``, or ``scheduled`` for a later ETA)
``failed`` with the error :data:`REVOKED_ERROR` (``sql/queues.sql``, ``revoke_waiting``), so
that no worker takes them, whatever starts later; ``celery -A proj pgskip failed`` lists
them and ``retry-failed`` brings them back. Every worker receives the broadcast; the first to
mark a message stores ``REVOKED`` for its task in the result backend (as Celery's worker does
when it discards a revoked task) and adds to its reply how many it marked. A message already
delivered (running, or held in a worker's memory) is Celery's to discard, as on any broker.
With no worker running, ``celery -A proj pgskip revoke ID`` does the same
(:func:`revoke_waiting`).

:func:`install` extends both commands; the transport calls it whenever it is created, and it
acts where Celery's worker control module is loaded (a worker, the ``celery`` command). A
worker whose broker is not pgskip is answered by Celery's commands unchanged.
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

#: The error of a message marked revoked while it waited (``pgskip failed`` shows it).
REVOKED_ERROR = "revoked before delivery (celery control revoke / pgskip revoke)"

_EXTENDED = "_pgskip_extended"
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
        extended = True
        for name, extend in (("scheduled", _extended), ("revoke", _lasting)):
            try:
                command = panel.data[name]
                options = panel.meta[name]._asdict()
            except (AttributeError, KeyError, TypeError):
                extended = False  # a Celery that keeps its commands otherwise: leave them be
                continue
            if not getattr(command, _EXTENDED, False):
                # Registered as Celery registers its own commands: same name, alias and help.
                panel.register(extend(command), name=name, **options)
        return extended


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


def _lasting(celery_revoke: Callable[..., Any]) -> Callable[..., Any]:
    def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None,
               **kwargs: Any) -> Any:  # fmt: skip
        reply = celery_revoke(state, task_id, terminate=terminate, signal=signal, **kwargs)
        channel = task_channel(state)
        if channel is None:
            return reply
        ids = [str(t) for t in (task_id if isinstance(task_id, (list, tuple, set)) else [task_id])]
        try:
            with channel.store.bounded(QUERY_SECONDS):
                marked = revoke_waiting(channel.store, ids, backend=state.app.backend)
        except Exception as exc:
            logger.warning(
                "revoke: could not mark the messages of %s waiting in the database (%s); "
                "workers running now will not run them, a worker started later might: "
                "celery -A proj pgskip revoke %s",
                ", ".join(ids),
                exc,
                " ".join(ids),
                extra={"action": "revoke_failed"},
            )
            return reply
        if marked and isinstance(reply, dict) and isinstance(reply.get("ok"), str):
            reply = {
                "ok": f"{reply['ok']}; {len(marked)} waiting in the database marked revoked "
                "for good (celery -A proj pgskip failed lists them)"
            }
        return reply

    revoke.__doc__ = celery_revoke.__doc__
    setattr(revoke, _EXTENDED, True)
    return revoke


def revoke_waiting(store: Any, task_ids: Collection[str], *, backend: Any = None) -> list[str]:
    """Mark the messages of ``task_ids`` still waiting in the database (``pending`` or
    ``scheduled``) ``failed`` as revoked (:data:`REVOKED_ERROR`), and, given a Celery result
    ``backend``, store ``REVOKED`` for each of their tasks; returns the task ids marked. A
    message another session is taking at that moment is left to the worker that takes it."""
    if not task_ids:
        return []
    rows = store.execute(
        "revoke_waiting", {"task_ids": sorted(set(task_ids)), "reason": REVOKED_ERROR}
    )
    marked = sorted({str(r[1]) for r in rows if r[1] is not None})
    for task_id in marked if backend is not None else ():
        try:
            backend.mark_as_revoked(task_id, "revoked")
        except NotImplementedError:  # no result backend
            break
        except Exception as exc:
            logger.warning(
                "revoke: the message of task %s was marked revoked, but the result backend "
                "could not store its state (%s)",
                task_id,
                exc,
                extra={"action": "revoke_backend_failed", "task_id": task_id},
            )
    for row_id, task_id, name, queue in rows:
        logger.info(
            "revoked task %s (%s) waiting in queue %r: marked failed, never delivered",
            task_id,
            name,
            queue,
            extra={"action": "revoked_waiting", "message_id": row_id, "task_id": task_id},
        )
    return marked


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
