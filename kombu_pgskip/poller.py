"""The consumer's sockets and wake-ups: the LISTEN connection, a self-pipe, the event loop.

:class:`Poller` owns the file descriptors a consuming transport waits on and the timers it
sets on Celery's event loop; it reports what happened (a wake-up, notifications, a readable
fetch connection) and decides nothing: :mod:`~kombu_pgskip.dispatch` does, by asking
:mod:`~kombu_pgskip.policy`. The way kombu's Redis transport keeps its ``MultiChannelPoller``
apart from its channels.

* The LISTEN connection hears ``pgskip:<schema>`` (a payload per queue a publish wrote to) and
  ``pgskip:<schema>:scheduled`` (the due time of a scheduled message), both sent at commit.
* The self-pipe lets other threads wake the consumer thread: an ack on a pool thread frees
  prefetch credit, a new consumer asks for a fetch.
* In the event loop the poller registers those and each fetch connection's socket with
  kombu's hub, and a poll timer as the fallback for lost notifications.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from . import exceptions
from .store import notify_channel, scheduled_channel
from .urls import connect, mask_url

logger = logging.getLogger(__name__)


@dataclass
class Notifications:
    """What the LISTEN connection heard since it was last read."""

    #: Queues a publish wrote to (or a message returned to, a promotion made due...).
    queues: set[str] = field(default_factory=set)
    #: The messages notifications named (``name_it`` in ``sql/publish.sql``): queue -> their
    #: (id, slot) in the order heard.
    named: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    #: Queues of ``queues`` a notification came for that named no message: what is due there
    #: is not known.
    plain: set[str] = field(default_factory=set)
    #: Seconds until the earliest announced scheduled message is due (None: none announced).
    scheduled_in: float | None = None


#: Separates the queue, the id and the slot in the payload of a notification that names a
#: message (``name_it`` in ``sql/publish.sql``).
NAME_SEPARATOR = "\x1f"


def heard(
    found: Notifications, payload: str, pid: int, after: tuple[int, str] | None
) -> tuple[int, str] | None:
    """Add a notification on the jobs channel, ``payload`` sent by backend ``pid``, to
    ``found``. ``after``: (pid, queue) of the notification heard just before this one, if that
    one named a message. Returns (pid, queue) if this one names a message.

    A publish sends the notification that names its message, then the plain one (the queue
    alone, which is all a worker of an earlier version understands): that plain one, heard
    right after the named one from the same backend (a transaction's notifications are
    delivered together, in the order sent), announces nothing more and is dropped. A plain
    notification from anywhere else (a message returned to its queue, a promotion, a queue
    resumed, a publish of several messages) leaves what is due unknown (``found.plain``).

    PostgreSQL sends a payload once per transaction: in a transaction that published to a queue
    before, a named notification has no plain one of its own behind it. Should the next
    transaction of that session begin with a plain notification of the queue (``publish_many``
    right after), that one is dropped too, and its messages wait for a fetch that something
    else causes, at the latest the poll.
    """
    parts = payload.rsplit(NAME_SEPARATOR, 2)  # a queue's name may hold the separator
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        queue = parts[0]
        found.queues.add(queue)
        found.named.setdefault(queue, []).append((int(parts[1]), int(parts[2])))
        return pid, queue
    if after != (pid, payload):
        found.queues.add(payload)
        found.plain.add(payload)
    return None


class Ready(enum.Enum):
    """Why a blocking :meth:`Poller.wait` returned."""

    WOKEN = "woken"  # another thread wrote to the self-pipe
    NOTIFIED = "notified"  # the LISTEN connection is readable
    TIMEOUT = "timeout"


class Poller:
    """The sockets one transport's consumers wait on, in one process."""

    def __init__(self, url: str, *, schema: str, listen: bool, **connect_kwargs: Any) -> None:
        self.url = url
        self.listen = listen
        self._channels = (notify_channel(schema), scheduled_channel(schema))
        self._connect_kwargs = connect_kwargs
        self._classifying = exceptions.classifying(url_for_messages=mask_url(url))
        self._pid = os.getpid()
        self._listener: psycopg.Connection[Any] | None = None
        # (sender pid, queue) of the last notification read, if it named a message (heard).
        self._named_last: tuple[int, str] | None = None
        self._wake_pair: tuple[socket.socket, socket.socket] | None = None
        #: A blocking wait is in progress (wake-ups are then worth sending).
        self.waiting = False
        # The event loop, the descriptors registered with it (and, for fetch connections,
        # the fetcher each belongs to), the poll timer and the calls queued once.
        self.loop: Any = None
        self._fds: list[int] = []
        self._owners: dict[int, object] = {}
        self._poll_timer: Any = None
        self._queued: set[Hashable] = set()

    # -- process ------------------------------------------------------------------------------

    @property
    def owned(self) -> bool:
        return self._pid == os.getpid()

    def after_fork(self) -> bool:
        """In a forked child, forget the parent's sockets (not ours to use or close); True if
        this is one."""
        if self.owned:
            return False
        self._pid = os.getpid()
        self._listener = None
        self._wake_pair = None
        self.loop, self._fds, self._owners, self._poll_timer = None, [], {}, None
        self._queued.clear()
        self.waiting = False
        return True

    def close(self) -> None:
        self.waiting = False
        self.detach()
        pair, self._wake_pair = self._wake_pair, None
        if pair is not None and self.owned:
            for sock in pair:
                sock.close()
        self.drop_listener()

    # -- the LISTEN connection ----------------------------------------------------------------

    @property
    def listener(self) -> psycopg.Connection[Any] | None:
        return self._listener

    def ensure_listener(self) -> tuple[psycopg.Connection[Any] | None, bool]:
        """The LISTEN connection (None in poll-only mode), and whether it was just opened."""
        if not self.listen:
            return None, False
        if self._listener is None or self._listener.closed:
            conn = connect(self.url, **self._connect_kwargs)
            try:
                with self._classifying:
                    for chan in self._channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(chan)))
            except BaseException:
                _close_quietly(conn)
                raise
            self._listener = conn
            return conn, True
        return self._listener, False

    def drop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and self.owned:
            _close_quietly(listener)

    def notifications(self) -> Notifications:
        """Read what the LISTEN connection has received, without waiting. If the server went
        away (terminated the session, shut down, the network), the connection is dropped (the
        next wait opens another) and a
        :class:`~kombu_pgskip.exceptions.TransientDatabaseError` is raised: kombu and Celery
        reconnect."""
        found = Notifications()
        listener = self._listener
        if listener is None or listener.closed:
            return found
        pgconn = listener.pgconn
        try:
            with self._classifying:
                pgconn.consume_input()
        except BaseException:
            self.drop_listener()
            raise
        jobs, scheduled = self._channels
        while (note := pgconn.notifies()) is not None:
            channel = note.relname.decode()
            payload = note.extra.decode()
            named, self._named_last = self._named_last, None
            if channel == scheduled:
                try:
                    due_in = float(payload) - time.time()
                except ValueError:
                    continue
                if found.scheduled_in is None or due_in < found.scheduled_in:
                    found.scheduled_in = due_in
            elif channel == jobs:
                self._named_last = heard(found, payload, note.be_pid, named)
        return found

    # -- the self-pipe ------------------------------------------------------------------------

    def _ensure_wake_pair(self) -> tuple[socket.socket, socket.socket]:
        if self._wake_pair is None:
            pair = socket.socketpair()
            for sock in pair:
                sock.setblocking(False)
            self._wake_pair = pair
        return self._wake_pair

    def wake(self) -> None:
        """Wake the consumer thread (from any thread), if it waits or runs an event loop."""
        pair = self._wake_pair
        if pair is None or not (self.waiting or self.loop is not None):
            return
        with contextlib.suppress(OSError):  # full (the consumer thread wakes anyway) or closed
            pair[1].send(b"!")

    def drain_wake(self) -> None:
        pair = self._wake_pair
        if pair is None:
            return
        try:
            while pair[0].recv(4096):
                pass
        except OSError:
            pass

    # -- blocking wait ------------------------------------------------------------------------

    def wait(self, seconds: float) -> Ready:
        """Wait up to ``seconds`` for a wake-up or the LISTEN connection to be readable.
        The caller sets :attr:`waiting` around its waits, so that other threads' wake-ups
        are sent."""
        wake = self._ensure_wake_pair()[0]
        listener = self._listener
        fds: list[Any] = [wake] if listener is None else [wake, listener.pgconn.socket]
        readable, _, _ = select.select(fds, [], [], max(0.0, seconds))
        if wake in readable:
            self.drain_wake()
            return Ready.WOKEN
        return Ready.NOTIFIED if readable else Ready.TIMEOUT

    # -- the event loop -----------------------------------------------------------------------

    def attach(
        self,
        loop: Any,
        *,
        on_wake: Callable[[], None],
        on_notified: Callable[[], None],
        on_poll: Callable[[], None],
        poll_interval: float,
    ) -> None:
        """Register the self-pipe, the LISTEN connection and a poll timer with ``loop``."""
        self.detach()
        self.loop = loop
        wake = self._ensure_wake_pair()[0]
        self._add(wake.fileno(), on_wake)
        listener, _ = self.ensure_listener()
        if listener is not None:
            self._add(listener.pgconn.socket, on_notified)
        self._poll_timer = loop.call_repeatedly(poll_interval, on_poll)

    def detach(self) -> None:
        """Leave the event loop: remove every descriptor and timer registered with it."""
        loop, self.loop = self.loop, None
        fds, self._fds = self._fds, []
        self._owners = {}
        self._queued.clear()
        timer, self._poll_timer = self._poll_timer, None
        if timer is not None:
            timer.cancel()  # otherwise every reconnect would leave one more poll timer behind
        if loop is None or not self.owned:
            return
        for fd in fds:
            self._remove(loop, fd)

    def _add(self, fd: int, callback: Callable[..., None], *args: Any) -> None:
        self.loop.add_reader(fd, callback, *args)
        self._fds.append(fd)

    @staticmethod
    def _remove(loop: Any, fd: int) -> None:
        try:
            loop.remove(fd)
        except Exception:
            logger.debug("could not remove fd %s from the event loop", fd, exc_info=True)

    def watch(self, owner: object, fd: int, callback: Callable[..., None], *args: Any) -> None:
        """Call ``callback(*args)`` when ``fd`` (a fetch connection's, ``owner``) is readable."""
        if self.loop is None or self._owners.get(fd) is owner:
            return
        self._add(fd, callback, *args)
        self._owners[fd] = owner

    def unwatch(self, owner: object) -> None:
        for fd, known in list(self._owners.items()):
            if known is owner:
                del self._owners[fd]
                if fd in self._fds:
                    self._fds.remove(fd)
                if self.loop is not None and self.owned:
                    self._remove(self.loop, fd)

    def call_soon_once(self, key: Hashable, callback: Callable[[], None]) -> None:
        """Queue ``callback`` on the loop unless a call under ``key`` is already queued."""
        self.call_later_once(key, None, callback)

    def call_later_once(
        self, key: Hashable, delay: float | None, callback: Callable[[], None]
    ) -> None:
        if self.loop is None or key in self._queued:
            return
        self._queued.add(key)

        def call() -> None:
            self._queued.discard(key)
            callback()

        if delay is None:
            self.loop.call_soon(call)
        else:
            self.loop.call_later(delay, call)

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        if self.loop is not None:
            self.loop.call_later(delay, callback)


def _close_quietly(conn: psycopg.Connection[Any]) -> None:
    """Close ``conn``, ignoring errors (it is already broken)."""
    try:
        conn.close()
    except Exception:
        logger.debug("error closing a broken connection", exc_info=True)
