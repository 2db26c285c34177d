"""Consumer leases: the proof, renewed every ``lease_seconds / 3``, that a consumer is alive.

Every consuming channel has a row in ``consumers`` with a lease. :class:`LeaseRenewal` renews
the leases of this process's consumers from the background thread, on a connection of its
own, so that leases stay alive while the consumer thread is busy (a task running in the solo
pool, a slow callback). A consumer that dies stops renewing; once its lease has run out, any
live worker's sweeper (:mod:`~kombu_pgskip.sweeper`) or the pg_cron sweep returns its rows to
``pending``, and its acks, fenced by consumer and delivery token, change nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import uuid

    from .acks import AckBatcher
    from .store import Store

logger = logging.getLogger(__name__)


class Leaseholder(Protocol):
    """A consuming channel, as the renewal sees it."""

    consumer_id: uuid.UUID
    acks: AckBatcher

    def lease_lost(self) -> None: ...


class LeaseRenewal:
    """Renews the leases of the consumers ``holders()`` returns, every ``lease_seconds / 3``.

    Before renewing, it writes the acks each consumer has left waiting: a consumer that stopped
    calling ``drain_events`` would otherwise hold them (and their messages ``running``) for as
    long as it keeps its lease.
    """

    def __init__(self, holders: Callable[[], Sequence[Leaseholder]], lease_seconds: float) -> None:
        self.holders = holders
        self.lease_seconds = lease_seconds
        self.interval = lease_seconds / 3.0

    def __call__(self, store: Store) -> None:
        holders = self.holders()
        if not holders:
            return
        for holder in holders:
            holder.acks.flush(store)
        alive = store.renew_consumers([h.consumer_id for h in holders], self.lease_seconds)
        for holder in holders:
            if holder.consumer_id not in alive:
                logger.warning(
                    "consumer %s was declared dead (lease expired); messages it held were "
                    "returned to the queue and their acks will be ignored",
                    holder.consumer_id,
                    extra={"action": "lease_lost"},
                )
                holder.lease_lost()
