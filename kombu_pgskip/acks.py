"""The acks of one consumer that wait to be written: one batcher, whoever writes them.

An ack from a task that finished does not cost a statement of its own while its channel
consumes: it is queued here and written with the consumer's next fetch (the same statement,
``ack_fetch``), or on its own by a flush (the event loop's, a ``drain_events`` call's, the
channel's close, at the latest the background thread's next beat). A queued ack lost in a
crash before it is written only causes a redelivery, never a loss.

Acks are fenced: the statement changes only rows this consumer still holds under the same
delivery token, so an ack of a consumer whose lease was taken away changes nothing (and is
logged here).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from .envelope import parse_tag

if TYPE_CHECKING:
    from .store import Store

logger = logging.getLogger(__name__)

Pair = tuple[int, int]  # (message id, delivery token)


class AckBatcher:
    """The queued acks of one consumer (thread-safe: acks come from pool threads).

    A statement that writes acks takes them (:meth:`take`) and writes them inside
    :meth:`writing`, which puts them back, ahead of any queued since, if it fails: the
    consumer may well be alive on its other connections, and an ack dropped there would leave
    its message ``running`` under a lease that keeps being renewed.
    """

    def __init__(self, consumer_id: uuid.UUID) -> None:
        self.consumer_id = consumer_id
        self._lock = threading.Lock()
        # Held by a flush from the moment it takes the acks until they are written or queued
        # again: a close on the consumer thread waits for a flush on the background thread,
        # so that it never returns the messages of acks still being written to the queue.
        self._flushing = threading.Lock()
        self._pending: list[Pair] = []
        self._in_flight: list[Pair] = []  # sent with the fetch whose reply has not arrived

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, delivery_tag: Any) -> bool:
        """Queue the ack of ``delivery_tag``; True if it is the first one waiting."""
        pair = parse_tag(delivery_tag)
        with self._lock:
            self._pending.append(pair)
            return len(self._pending) == 1

    def take(self) -> list[Pair]:
        with self._lock:
            pairs, self._pending = self._pending, []
        return pairs

    @contextmanager
    def writing(self, pairs: list[Pair]) -> Iterator[None]:
        """Around the statement that writes ``pairs``: if it fails, they are queued again.
        Had it committed after all (the reply lost), writing them again changes nothing."""
        try:
            yield
        except BaseException:
            with self._lock:
                self._pending[:0] = pairs
            raise

    @contextmanager
    def flushing(self) -> Iterator[list[Pair]]:
        """Take the queued acks to write them in the block: queued again if it raises. One
        flush at a time: another waits for this one to end (see ``_flushing``)."""
        with self._flushing:
            pairs = self.take()
            with self.writing(pairs):
                yield pairs

    def flush(self, store: Store, bound: float | None = None) -> int:
        """Write the queued acks in one statement on ``store``'s connection; returns how many.
        With ``bound``, in a transaction that waits at most that many seconds for a lock
        (:meth:`~kombu_pgskip.store.Store.bounded`): the background thread's flush, which must
        not hold up the next lease renewal."""
        with self.flushing() as pairs:
            if not pairs:
                return 0
            with nullcontext() if bound is None else store.bounded(bound):
                done = store.ack(pairs, self.consumer_id)
        self.written(len(pairs), done)
        return len(pairs)

    def sent_with_fetch(self, pairs: list[Pair]) -> None:
        """``pairs`` went out with a fetch whose reply comes later: :meth:`fetch_returned`,
        or :meth:`fetch_failed`."""
        self._in_flight = pairs

    def fetch_returned(self, done: int) -> None:
        """The reply of the fetch that carried the acks: ``done`` were still this consumer's."""
        sent, self._in_flight = self._in_flight, []
        self.written(len(sent), done)

    def fetch_failed(self) -> None:
        """The fetch that carried the acks failed, or its connection was lost before its
        reply: queue them again for the next statement. Had the fetch committed after all,
        writing them again changes nothing."""
        with self._lock:
            sent, self._in_flight = self._in_flight, []
            self._pending[:0] = sent

    def written(self, sent: int, done: int) -> None:
        if done < sent:
            logger.warning(
                "ack of %d messages changed nothing: this consumer's lease was taken away and "
                "the messages were handed to another consumer",
                sent - done,
                extra={"action": "ack_fenced", "consumer": str(self.consumer_id)},
            )
