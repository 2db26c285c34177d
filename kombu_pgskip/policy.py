"""When a worker fetches, and how much: the fetch policy, one state object and no I/O.

The transport delivers in one of two ways: kombu's blocking ``drain_events`` (a plain kombu
consumer, Celery's solo pool) or callbacks on Celery's event loop (a prefork worker). Both ask
the same :class:`FetchPolicy` what to do and tell it what happened; the sockets, timers and
statements are :mod:`~kombu_pgskip.poller`'s and :mod:`~kombu_pgskip.dispatch`'s. The rules:

* **Credit.** A fetch asks for at most the consumer's free prefetch credit (and
  ``fetch_limit``). In the event loop, a small refill (less than half the window free while
  the rest is held) is put off for ``REFILL_DELAY``: acks freeing more credit meanwhile make
  one larger fetch instead of one statement per finished task.
* **More due.** A fetch that filled its limit (or stopped at its byte budget) may have left
  due messages behind: the next one goes at once, not at a notification or the poll. One that
  left messages for lack of credit marks the channel *starved*: the next ack fetches at once.
* **Cooldown.** Every notification wakes every worker listening on the queue. A notified fetch
  waits until ``fetch_cooldown`` after the previous fetch was sent, so that while tasks stream
  in one fetch takes the messages of that moment together; the cooldown adapts to what
  notified fetches find (:class:`Cooldown`). An idle worker fetches at once.
* **Acks ride along.** Queued acks wait (``ACK_FLUSH_DELAY`` at most) for a fetch to carry
  them; outside an event loop they stop waiting when notifications lately came further apart
  than that (:class:`DrainCall`).
* **Where a scan starts.** A fetch scans its queues from the beginning, where every message
  taken while another session holds an old snapshot leaves a dead index entry that cannot be
  removed (``sql/consume.sql``, ``due``). Once two such scans in a row take more than twice the
  cheapest one the channel has seen, and ``FULL_SCAN_EXCESS`` more at least, fetches scan each queue
  after the last message they took there instead; a scan from the beginning, which finds what
  became due behind those positions, goes out only once ``FULL_SCAN_SPACING`` times its
  duration has passed, so that such scans take at most a twentieth of the time. A channel never
  goes idle on a scan from its positions that came back short: one from the beginning follows,
  when due.
* **Limited queues** (``pgskip limit``) are fetched one by one, each by a statement of its own
  (:class:`LimitGate` says which, and when): at once while the last fetch took all it asked
  for; once one found the queue at its limit, again when this process settles one of its
  messages, when its bucket's next token is due, or ``polling_interval`` later (another
  worker may have freed a slot: nothing tells this one); once one found it drained, at a
  notification for it or ``polling_interval`` later. Never in a loop of empty fetches.
* **No-ack queues** (remote control, events) are fetched when due: a notification for one,
  the poll, a promotion, a new consumer, or a task fetch that saw a message waiting in one.
  Only in the event loop with notifications and task fetches that tell; elsewhere, every time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .options import Options
    from .store import Position

#: Seconds the event loop waits before a small refill (less than half the prefetch window free
#: while the rest is still held): acks freeing more credit meanwhile make one larger fetch.
REFILL_DELAY = 0.001

#: Seconds an ack may wait for a fetch to carry it when nothing asks for a fetch sooner (a
#: notification, or credit freed while messages were left behind for lack of it). While tasks
#: stream in, the next notification's fetch writes it; on an idle worker a flush this much
#: later does (a fetch, or the acks alone: :meth:`FetchPolicy.acks_alone`). Unwritten acks
#: only delay a row's ``completed``: a crash meanwhile redelivers, never loses.
ACK_FLUSH_DELAY = 0.005

#: A channel scans its queues from the beginning again once this many times the duration of its
#: last such scan has passed since it ended, and in between from where its last fetch of each
#: queue stopped: scans from the beginning take at most 1 / (1 + FULL_SCAN_SPACING) of the time,
#: and a message due behind the positions waits at most that long. A channel has one fetch in
#: flight at a time, so while such a scan walks the dead entries a held snapshot keeps, no
#: message reaches the worker: the share of the time these scans take is about the share of the
#: drain rate they cost (docs/performance.md, "Held snapshots and table size"). Twenty of them
#: come to a few seconds after minutes of a held snapshot.
FULL_SCAN_SPACING = 19.0

#: Seconds early a timer set for a scan from the beginning may fire and still send one.
FULL_SCAN_EARLY = 0.001

#: Fetches scan after their positions only while the last two scans from the beginning each took
#: more than twice the cheapest one the channel has seen, and at least this many seconds more:
#: dead entries slow every scan down, whereas a round trip alone, or a busy machine's hiccup,
#: does not.
FULL_SCAN_EXCESS = 0.002

#: How much longer than ``polling_interval`` the worker waits, at most, before looking for
#: scheduled messages to promote when none is known to be due.
PROMOTE_HORIZON = 5


class Cooldown:
    """How long a notified fetch waits after the previous fetch was sent (``fetch_cooldown``),
    adapted to what the worker's notified fetches find.

    Every notification wakes every worker listening on the queue, and with several workers
    most of them find the message already taken. A notified fetch that comes back empty
    doubles the wait (up to ``ceiling``); one that takes rows shortens it by a tenth (down to
    ``base``). The two steps balance where about one notified fetch in eight comes back empty,
    so a lone worker, whose fetches almost never do, stays at ``base``. Only notified fetches
    count: an ack flush or a poll finding nothing says nothing about other workers. An idle
    worker is unaffected whatever the value: its previous fetch is older than any cooldown.
    """

    GROW = 2.0
    SHRINK = 0.9

    def __init__(self, base: float, ceiling: float) -> None:
        self.base = base
        self.ceiling = max(base, ceiling)
        self.value = base

    def observe(self, took: int) -> None:
        """A notified fetch came back with ``took`` rows."""
        if took:
            self.value = max(self.base, self.value * self.SHRINK)
        else:
            self.value = min(self.ceiling, self.value * self.GROW)


@dataclass
class LimitedQueue:
    """When the limited fetch of one queue goes next (:class:`LimitGate`)."""

    #: Not before this (monotonic s); 0: at the next fetch.
    retry_at: float = 0.0
    #: A notification for the queue (a new message) makes it due at once: it was drained.
    on_notify: bool = False
    #: Its last fetch found it at its limit: a message of it settled here makes it due.
    on_settle: bool = False


class LimitGate:
    """Which limited queues (``pgskip limit``, migration 0025) the next fetch takes from, and
    when the next is due: one state object, no I/O.

    The normal fetch skips a limited queue whatever this object knows (the SQL does), so what
    it holds decides only when the limited fetches go, never whether a limit holds. It learns
    the limited queues from the housekeeping thread (:meth:`known`) and from each limited
    fetch (one that finds no limits any more drops the queue).
    """

    def __init__(self, polling_interval: float) -> None:
        self.polling_interval = polling_interval
        self.queues: dict[str, LimitedQueue] = {}

    def known(self, names: set[str]) -> bool:
        """The limited queues are ``names`` (of those this process consumes); True if one is
        new here (a fetch is owed: the normal fetch no longer takes its messages)."""
        new = names - self.queues.keys()
        for name in self.queues.keys() - names:
            del self.queues[name]
        for name in new:
            self.queues[name] = LimitedQueue()
        return bool(new)

    def due(self, queues: list[str], now: float) -> list[str]:
        """Which of ``queues`` (a channel's) to fetch now, in that order."""
        return [
            q for q in queues if (state := self.queues.get(q)) is not None and now >= state.retry_at
        ]

    def next_at(self, now: float) -> float | None:
        """When the earliest queue that waits beyond ``now`` is due (monotonic s); None: none
        does. (One due already waits for credit, which a settle frees and fetches with.)"""
        waiting = [s.retry_at for s in list(self.queues.values()) if s.retry_at > now]
        return min(waiting, default=None)

    def notified(self, queues: set[str]) -> None:
        """Notifications for ``queues`` arrived: those that were drained are due."""
        for name in queues:
            state = self.queues.get(name)
            if state is not None and state.on_notify:
                state.retry_at, state.on_notify = 0.0, False

    def settled(self, queue: str) -> bool:
        """A message of ``queue`` that this process took was settled (its slot freed); True
        if that makes the queue due."""
        state = self.queues.get(queue)
        if state is None or not state.on_settle:
            return False
        state.retry_at, state.on_settle = 0.0, False
        return True

    def fetched(
        self,
        queue: str,
        now: float,
        *,
        asked: int,
        took: int,
        limited: bool,
        more: bool,
        free: int | None,
        tokens: float | None,
        rate: float | None,
    ) -> None:
        """A limited fetch of ``queue`` at ``now`` asked for ``asked`` messages and took
        ``took``; what it found: see :class:`~kombu_pgskip.store.LimitedFetch`."""
        if not limited:
            self.queues.pop(queue, None)  # the normal fetch takes it again
            return
        state = self.queues.setdefault(queue, LimitedQueue())
        poll = now + self.polling_interval
        if took >= asked:
            # Stopped by the prefetch credit: due again at the next fetch, which freed
            # credit brings (the channel counts as starved).
            state.retry_at, state.on_notify, state.on_settle = 0.0, False, False
        elif not more:
            state.retry_at, state.on_notify, state.on_settle = poll, True, False
        elif free is not None and free <= 0:
            state.retry_at, state.on_notify, state.on_settle = poll, False, True
        elif tokens is not None and rate and tokens < 1.0:
            token = now + (1.0 - tokens) / rate
            state.retry_at, state.on_notify, state.on_settle = min(poll, token), False, True
        else:
            # Every message looked at waits for a slot of its key (or another session holds
            # it locked): a settle here, or the poll.
            state.retry_at, state.on_notify, state.on_settle = poll, False, True


class Announced:
    """Which message each queue's notifications named since a fetch of it was last sent: an
    idle consumer takes the one named message by its id rather than looking for due messages
    (``AsyncFetcher.send``). No I/O.

    Only as long as nothing else can have become due unseen: a notification that named no
    message (a message returned to its queue, a promotion, a queue resumed, a publish of
    several), a second message named, or a fetch that looks for everything being owed (the
    poll, a new consumer, the consumer's own promotion of scheduled messages:
    :meth:`forget`) make the next fetch of the queue look for every due message.
    """

    def __init__(self) -> None:
        #: queue -> (id, slot) of the one message named since its last fetch was sent; None:
        #: what is due there is not known.
        self._named: dict[str, tuple[int, int] | None] = {}
        #: The next fetch sent looks for every due message, whatever was named.
        self._forgotten = False

    def heard(self, named: Mapping[str, list[tuple[int, int]]], plain: Iterable[str]) -> None:
        """Notifications named ``named`` (queue -> (id, slot) of each message) and announced
        something unnamed in the queues ``plain``."""
        for queue, messages in named.items():
            one = len(messages) == 1 and queue not in self._named
            self._named[queue] = messages[0] if one else None
        for queue in plain:
            self._named[queue] = None

    def forget(self) -> None:
        """The next fetch looks for every due message."""
        self._named.clear()
        self._forgotten = True

    def sending(self, queues: Iterable[str]) -> tuple[str, int, int] | None:
        """A fetch of ``queues`` is sent: (queue, id, slot) of the one message named for
        them since their last fetch, if it may take that one alone; None: it looks for every
        due message."""
        seen = [(q, self._named.pop(q)) for q in queues if q in self._named]
        forgotten, self._forgotten = self._forgotten, False
        if forgotten or len(seen) != 1:
            return None
        queue, named = seen[0]
        return None if named is None else (queue, *named)


@dataclass
class ChannelState:
    """What the policy knows of one consuming channel."""

    #: Its last fetch filled its limit (or its byte budget): more may be due right now.
    more_due: bool = False
    #: Messages may be waiting that its last fetch left for lack of prefetch credit.
    starved: bool = False
    #: Its no-ack queues are to be fetched at its next fetch.
    noack_due: bool = True
    #: Its last fetch was put off as a small refill (:meth:`FetchPolicy.limit`).
    refill_deferred: bool = False
    #: :attr:`FetchPolicy.wake_seq` when its fetch in flight was sent, and whether a
    #: notification had come since the fetch before (then what it finds adapts the cooldown).
    sent_wake_seq: int = 0
    notified_fetch: bool = False
    #: :attr:`FetchPolicy.wanted_seq` when its fetch in flight was sent.
    sent_wanted_seq: int = 0
    #: Where its next fetch of each queue may start: the last message it took there.
    positions: dict[str, Position] = field(default_factory=dict)
    #: Its fetch in flight scans after ``positions`` (else from the beginning).
    scans_after: bool = False
    #: When its last scan from the beginning was sent, and how long it took (monotonic s).
    full_sent: float = float("-inf")
    full_cost: float = 0.0
    full_floor: float = float("inf")
    #: The shorter of its last two scans from the beginning: one slow scan (a busy machine's
    #: hiccup) does not make the next fetches start after their positions; two in a row do.
    full_recent: float = 0.0
    #: Its last fetch scanned after the positions and came back short: one from the beginning
    #: is owed (at :meth:`FetchPolicy.full_scan_at`) before it may wait for a wake-up.
    full_owed: bool = False


class Next(enum.Enum):
    """What the event loop does once a fetch's rows are delivered."""

    DRAIN = "drain"  # the fetch filled its limit: more may be due now
    FULL_SCAN = "full_scan"  # a scan from the beginning is owed, at full_scan_at()
    AFTER_COOLDOWN = "after_cooldown"  # a notification came while it was in flight
    FLUSH_ACKS = "flush_acks"  # acks came in while it was in flight
    NOTHING = "nothing"


class Wake(enum.Enum):
    """What a queued ack asks of the consumer thread."""

    FETCH = "fetch"  # fetch now, carrying the ack
    FLUSH = "flush"  # write the acks within ACK_FLUSH_DELAY (event loop)
    NONE = "none"  # an earlier ack already asked


@dataclass
class FetchPolicy:
    """The fetch decisions of one transport (all its channels), and the state they read."""

    fetch_limit: int
    polling_interval: float
    listen: bool
    async_fetch: bool
    cooldown: Cooldown
    #: Registered with Celery's event loop (else kombu's blocking ``drain_events``).
    in_loop: bool = False
    #: Counts notifications for consumed queues: one that arrives while a fetch is in flight
    #: (its snapshot may predate the message) calls for another fetch after it.
    wake_seq: int = 0
    #: When the last fetch was sent (monotonic seconds).
    last_fetch: float = 0.0
    #: When to promote scheduled messages next.
    next_promote: float = 0.0
    #: A wake-up asked for a fetch (not only for acks to be written).
    fetch_wanted: bool = False
    #: Counts the fetches such wake-ups asked for (a new consumer, a larger prefetch window):
    #: one asked while a channel's fetch is in flight (sent without what it asked for) calls
    #: for another right after it.
    wanted_seq: int = 0
    #: What the last batch over every channel found: a channel filled its limit; a channel put
    #: a small refill off; the earliest scan from the beginning a channel owes (monotonic s).
    more_due: bool = False
    refill_deferred: bool = False
    full_scan_owed_at: float | None = None
    #: ``drain_events``: the last batch drained the queues, so the next call waits for a
    #: notification before fetching; when to fetch for want of one; whether, lately, a
    #: notification came within ACK_FLUSH_DELAY of a call that had acks to write (then they
    #: wait to ride along); when the current call first read a notification.
    drained: bool = False
    poll_at: float = 0.0
    #: When the next limited queue that waits is due (:class:`LimitGate`; None: none waits).
    limits_at: float | None = None
    ack_wait_pays: bool = True
    notified_at: float | None = None

    @classmethod
    def of(cls, options: Options) -> FetchPolicy:
        return cls(
            fetch_limit=options.fetch_limit,
            polling_interval=options.polling_interval,
            listen=options.listen,
            async_fetch=options.async_fetch,
            cooldown=Cooldown(options.fetch_cooldown, options.fetch_cooldown_max),
        )

    # -- one channel's fetch ------------------------------------------------------------------

    def limit(
        self, state: ChannelState, *, credit: int | None, prefetch_count: int, eager: bool
    ) -> int:
        """How many messages the channel's next fetch asks for; 0: none now.

        ``credit`` is the free prefetch credit (None: no prefetch limit). Unless ``eager``, a
        small refill is put off while the consumer still holds at least half its window
        (``state.refill_deferred``); no credit at all marks the channel starved.
        """
        limit = self.fetch_limit
        if credit is not None:
            limit = min(credit, limit)
            window = min(prefetch_count, self.fetch_limit)
            held = prefetch_count - credit
            if not eager and 0 < limit < max(1, window // 2) and held > 0:
                state.refill_deferred = True
                return 0
        if limit <= 0:
            state.starved = True
            return 0
        return limit

    def skips_noack(self) -> bool:
        """Whether a fetch may leave the no-ack queues out unless they are due: only in the
        event loop, notified, with task fetches that tell whether a message waits in one
        (fetching them every time costs the loop a round trip per fetch)."""
        return self.in_loop and self.listen and self.async_fetch

    def fetches_noack(self, state: ChannelState, *, with_ack_queues: bool) -> bool:
        """Whether the channel's fetch takes its no-ack queues now. A channel that also
        consumes with acks takes both every time: its own fetch of those does not say whether
        a no-ack queue has a message waiting."""
        return state.noack_due or with_ack_queues or not self.skips_noack()

    def full_scan_at(self, state: ChannelState) -> float:
        """When the channel's next scan from the beginning is due (monotonic s)."""
        return state.full_sent + (1.0 + FULL_SCAN_SPACING) * state.full_cost

    def scan_after(self, state: ChannelState, queues: list[str], now: float) -> bool:
        """Whether the channel's fetch of ``queues`` (sent at ``now``) scans after their
        positions; False: from the beginning. A queue with no position is scanned from its
        beginning either way."""
        floor = state.full_floor
        if state.full_recent <= floor + max(floor, FULL_SCAN_EXCESS):
            return False
        if not any(q in state.positions for q in queues):
            return False
        return now < self.full_scan_at(state) - FULL_SCAN_EARLY

    def scanning(self, state: ChannelState, now: float, *, after: bool) -> None:
        """The channel's fetch goes out at ``now``; ``after``: it scans after the positions."""
        state.scans_after = after
        if not after:
            state.full_sent = now

    def sent(self, state: ChannelState, now: float) -> None:
        """The channel's fetch was sent (on a fetch connection) at ``now``."""
        state.notified_fetch = state.sent_wake_seq != self.wake_seq
        state.sent_wake_seq = self.wake_seq
        state.sent_wanted_seq = self.wanted_seq
        self.last_fetch = now

    def fetched(
        self,
        state: ChannelState,
        *,
        took: int,
        filled: bool,
        now: float,
        last: Mapping[str, Position] | None = None,
    ) -> None:
        """The channel's fetch came back at ``now`` with ``took`` rows; ``filled``: it stopped
        at its limit or byte budget, so due messages may be left behind; ``last``: the
        position of the last message it took from each queue."""
        state.more_due = state.starved = filled
        if state.scans_after:
            state.full_owed = state.full_owed or not filled
        else:
            cost = max(0.0, now - state.full_sent)
            state.full_recent = min(state.full_cost, cost)
            state.full_cost = cost
            state.full_floor = min(state.full_floor, cost)
            state.full_owed = False
        if last:
            state.positions.update(last)
        if state.notified_fetch:
            state.notified_fetch = False
            self.cooldown.observe(took)

    def after_loop_fetch(self, state: ChannelState, *, acks_waiting: bool) -> Next:
        if state.more_due or state.sent_wanted_seq != self.wanted_seq:
            return Next.DRAIN  # more may be due, or a fetch was asked for while it was in flight
        if state.sent_wake_seq != self.wake_seq:
            # A notification arrived after the statement was sent (its message may have
            # committed after the fetch's snapshot): fetch again once cooled down.
            return Next.AFTER_COOLDOWN
        if state.full_owed:
            return Next.FULL_SCAN
        if acks_waiting:
            return Next.FLUSH_ACKS  # their flush may have fired while the fetch ran
        return Next.NOTHING

    def ack_queued(self, state: ChannelState, *, first: bool) -> Wake:
        """An ack was queued (it freed prefetch credit). Outside an event loop, or when the
        last fetch left messages behind for lack of credit, the consumer fetches at once
        (with the ack). Otherwise the first queued ack asks the loop to write it within
        ``ACK_FLUSH_DELAY``, and a notification's fetch usually carries it before that, so a
        stream of short tasks costs one statement per notification, not two."""
        if not self.in_loop or state.starved:
            return Wake.FETCH
        return Wake.FLUSH if first else Wake.NONE

    def acks_alone(self, state: ChannelState, now: float) -> bool:
        """Whether the channel's queued acks, due to be written (``ACK_FLUSH_DELAY``), go on
        their own rather than with a fetch (``AsyncFetcher.send_acks``): in the event loop,
        with notifications and a fetch connection, when its last fetch left nothing behind (not
        for lack of credit or byte budget, not as a small refill put off, not scanning after
        its positions), no notification for a consumed queue came since it was sent, no
        wake-up asked for a fetch (a new consumer, a larger prefetch window) and no scheduled
        message is to be promoted. A fetch would then find nothing: whatever makes a message
        due announces it (a publish, a requeue, a promotion, a queue resumed, the sweeper
        returning a dead consumer's messages), and the poll stays the backstop. (A take by id
        looks for nothing else, but it is sent only when every message announced since the
        fetch before it was named, and that one left nothing behind: :class:`Announced`.)"""
        return (
            self.in_loop
            and self.listen
            and self.async_fetch
            and not self.fetch_wanted
            and state.sent_wake_seq == self.wake_seq
            and not (state.more_due or state.starved or state.refill_deferred)
            and not state.full_owed
            and not self.promote_due(now)
        )

    # -- notifications, promotion -------------------------------------------------------------

    def notified(self, now: float) -> None:
        """A notification for a consumed queue arrived."""
        self.wake_seq += 1
        if self.notified_at is None:
            self.notified_at = now

    def cooldown_left(self, now: float) -> float:
        """Seconds until a notified fetch may be sent (the cooldown after the previous one)."""
        return self.last_fetch + self.cooldown.value - now

    def promote_due(self, now: float) -> bool:
        return now >= self.next_promote

    def promoted(self, now: float, next_in: float | None) -> None:
        """Scheduled messages were promoted; the next falls due in ``next_in`` s (None: none
        is scheduled)."""
        horizon = self.polling_interval * PROMOTE_HORIZON
        delay = horizon if next_in is None else min(max(next_in, 0.0), horizon)
        self.next_promote = now + delay

    def scheduled(self, now: float, due_in: float) -> None:
        """A scheduled message was published, due in ``due_in`` s."""
        self.next_promote = min(self.next_promote, now + due_in)

    # -- kombu's blocking drain_events --------------------------------------------------------

    def drain_call(self, now: float, *, notified: bool, acks_waiting: bool) -> DrainCall:
        """Begin a ``drain_events`` call at ``now``. ``notified``: notifications for consumed
        queues came in since the last wait."""
        return DrainCall(self, now, notified=notified, acks_waiting=acks_waiting)


class DrainCall:
    """One ``drain_events`` call: when it fetches, how long it waits.

    Once a fetch has taken less than it asked for (the queues are drained), the next one is
    sent for a notification (once the cooldown has passed), a scheduled message falling due, a
    wake-up from another thread, or the poll, as in the event loop: not at the start of every
    call. The acks of the batch just delivered ride along with that fetch, or with one sent
    ``ACK_FLUSH_DELAY`` after the call began; when notifications have lately come further apart
    than that, they go at once, with a fetch.
    """

    def __init__(
        self, policy: FetchPolicy, now: float, *, notified: bool, acks_waiting: bool
    ) -> None:
        self.policy = policy
        self.fetch_at: float | None = now  # None: at a wake-up or the poll
        self.learning = False  # whether this call tells if holding its acks back pays
        if policy.drained:
            self.fetch_at = None
            if notified:
                policy.drained = False  # owed to the notification even if this call times out
                self.fetch_at = now + max(0.0, policy.cooldown_left(now))
            elif acks_waiting:
                self.learning = True
                if not policy.ack_wait_pays:
                    # Lately no notification came within ACK_FLUSH_DELAY of a call: messages
                    # come further apart than that, so the acks go at once, with a fetch.
                    self.fetch_at = now
        self.ack_due = now + ACK_FLUSH_DELAY
        policy.notified_at = None

    def should_fetch(self, now: float, *, promoted: bool) -> bool:
        limits_at = self.policy.limits_at
        if promoted or now >= self.policy.poll_at or (limits_at is not None and now >= limits_at):
            self.fetch_at = now
        return self.fetch_at is not None and now >= self.fetch_at

    def fetched(self, now: float, *, more_due: bool, full_scan_at: float | None = None) -> None:
        """A batch was fetched and delivered at ``now``; ``more_due``: a channel filled its
        limit or was starved of credit; ``full_scan_at``: when a scan from the beginning that a
        channel owes is due (the queues are not known to be drained before it)."""
        policy = self.policy
        policy.drained = policy.listen and not more_due and full_scan_at is None
        policy.poll_at = now + policy.polling_interval
        self.fetch_at = full_scan_at

    def wait(self, now: float, *, acks_waiting: bool, deadline: float | None) -> float | None:
        """How long to wait for a wake-up; None: the call's ``timeout`` has passed."""
        policy = self.policy
        wait = min(policy.poll_at, policy.next_promote) - now
        if policy.limits_at is not None:
            wait = min(wait, policy.limits_at - now)
        if self.fetch_at is not None:
            wait = min(wait, self.fetch_at - now)
        if acks_waiting:
            wait = min(wait, self.ack_due - now)
        if deadline is not None:
            if now >= deadline:
                return None
            wait = min(wait, deadline - now)
        return max(0.0, wait)

    def woke(self, now: float, *, woken: bool, acks_waiting: bool) -> None:
        """The wait ended at ``now``; ``woken``: for a fetch (not at its time)."""
        if self.learning and (self.policy.notified_at is not None or now >= self.ack_due):
            # Did a notification come while the acks could wait for its fetch? (When it came,
            # not when the cooldown let its fetch go.)
            notified_at = self.policy.notified_at
            self.policy.ack_wait_pays = notified_at is not None and notified_at <= self.ack_due
            self.learning = False
        if woken or (acks_waiting and now >= self.ack_due):
            self.fetch_at = now  # a fetch carries the waiting acks too
