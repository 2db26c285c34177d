"""Consumer leases, and the session lock that outlives no process: the proofs that a consumer lives.

Every consuming channel has a row in ``consumers`` with a lease. :class:`LeaseRenewal` renews the
leases of this process's consumers from the background thread, on a connection of its own that
does nothing else, so that leases stay alive while the consumer thread is busy (a task running in
the solo pool, a slow callback) and while housekeeping waits for a lock on ``jobs``.

The same connection holds a :class:`SessionLock`, a session-level advisory lock whose key every
renewal writes into the consumers' rows. PostgreSQL releases it the moment the session ends: when
the process dies (SIGKILL, a crash, its host gone and its socket closed), the next sweep of any
live worker (:mod:`~kombu_pgskip.sweeper`) finds the lock released, and a sweep
``LOCK_GRACE_S`` (2 s) later, which that worker runs, returns the consumers' rows to ``pending``;
their acks, fenced by consumer and delivery token, change nothing. A process that hangs while
connected keeps its lock: its lease running out is what declares it dead then.

Against false deaths: the lock is taken before a renewal writes its key, on the session that
renews, and taken again (the same key where it is free) on every new session after a reconnect,
which the background thread makes as soon as it sees its session end; the renewal that follows
clears the sweeps' suspicion. The trade-off: if that one session ends while the process lives
(``pg_terminate_backend`` of it, a proxy closing it, a network failure the server notices first)
and the thread cannot reconnect and renew within the grace (the network is still down), its
consumers are taken for dead and their messages handed out again, as a broker does when a
consumer's connection closes: a task in progress may then run twice (its acks are fenced). A
lock lost to a server restart or a failover proves nothing (every session ended): sweep() keeps
the lease rule for a key taken on another server incarnation. Without a session of one's own
(``listen=False``, PgBouncer in transaction pooling) there is no lock, and the lease is the only
rule.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import uuid

    from .acks import AckBatcher
    from .store import Store
    from .urls import Connection

logger = logging.getLogger(__name__)

#: Keys tried before giving up on the lock for this session (each another session holds).
LOCK_ATTEMPTS = 5


class Leaseholder(Protocol):
    """A consuming channel, as the renewal sees it."""

    consumer_id: uuid.UUID
    acks: AckBatcher

    def lease_lost(self) -> None: ...


def new_lock_key() -> int:
    """A random positive key for ``pg_advisory_lock(bigint)`` (positive: sweep() rebuilds it
    from pg_locks' two unsigned halves)."""
    return secrets.randbelow(2**63 - 1) + 1


class SessionLock:
    """The session-level advisory lock of one process's consumers, on one store's connection."""

    def __init__(self) -> None:
        self.key = new_lock_key()
        #: The connection that holds it (None: none does).
        self.connection: Connection | None = None

    def held_on(self, store: Store) -> int | None:
        """The key, held on ``store``'s connection (taken now if that is a new session), or
        None if every key tried is held by another session (the lease is the rule until the
        next call)."""
        conn = store.conn
        if conn is self.connection:
            return self.key
        self.connection = None
        for _ in range(LOCK_ATTEMPTS):
            if store.take_session_lock(self.key):
                self.connection = conn
                return self.key
            # Held by another session: the previous session of this process that the server
            # has not seen end yet, or a stranger's lock with the same key.
            self.key = new_lock_key()
        logger.warning(
            "could not take a session lock for this process's consumers; a dead consumer of "
            "this process is noticed when its lease runs out",
            extra={"action": "session_lock_unavailable"},
        )
        return None

    def forget(self) -> None:
        """The session that held it is gone (or closed): the next call takes it again."""
        self.connection = None


class LeaseRenewal:
    """Renews the leases of the consumers ``holders()`` returns, every ``lease_seconds / 3``.

    :meth:`renew` writes only the ``consumers`` rows, holding the session lock first
    (``session_lock``); :meth:`flush_acks` then writes the acks each consumer has left waiting,
    since a consumer that stopped calling ``drain_events`` would otherwise hold them (and their
    messages ``running``) for as long as it keeps its lease.
    """

    def __init__(
        self,
        holders: Callable[[], Sequence[Leaseholder]],
        lease_seconds: float,
        *,
        session_lock: bool = True,
    ) -> None:
        self.holders = holders
        self.lease_seconds = lease_seconds
        self.interval = lease_seconds / 3.0
        self.lock = SessionLock() if session_lock else None

    def __call__(self, store: Store) -> None:
        """One beat on one connection: :meth:`renew`, then :meth:`flush_acks`."""
        self.renew(store)
        self.flush_acks(store)

    def renew(self, store: Store) -> list[uuid.UUID]:
        """Renew every holder's lease on ``store``; returns the consumers still alive."""
        holders = self.holders()
        key = self.lock.held_on(store) if self.lock is not None else None
        if not holders:
            return []
        alive = store.renew_consumers(
            [h.consumer_id for h in holders], self.lease_seconds, lock_key=key
        )
        for holder in holders:
            if holder.consumer_id not in alive:
                logger.warning(
                    "consumer %s was declared dead (lease expired, or this process's session "
                    "lock was lost); messages it held were returned to the queue and their acks "
                    "will be ignored",
                    holder.consumer_id,
                    extra={"action": "lease_lost"},
                )
                holder.lease_lost()
        return [h.consumer_id for h in holders if h.consumer_id in alive]

    def flush_acks(self, store: Store, bound: float | None = None) -> None:
        """Write the acks every holder has queued, one statement each; with ``bound``, each in
        a transaction that waits at most that many seconds (:meth:`Store.bounded`). Acks whose
        statement or commit fails are queued again."""
        for holder in self.holders():
            holder.acks.flush(store, bound)
