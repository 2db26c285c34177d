"""The consuming side of a transport: fetch for its channels, hand the rows to kombu.

:class:`Dispatcher` runs the cycle "wait, fetch, deliver" for every consuming channel of one
transport, in one of two ways:

* kombu's blocking ``drain_events`` (:meth:`Dispatcher.drain`): a plain kombu consumer, or
  Celery's solo pool;
* callbacks on Celery's event loop (:meth:`Dispatcher.register`): the loop watches the LISTEN
  connection, the self-pipe and each fetch connection, so the worker keeps answering remote
  control and sending heartbeats while every prefork process is busy, and a fetch never
  blocks the loop (its rows are delivered when the reply arrives).

Both ask :class:`~kombu_pgskip.policy.FetchPolicy` when to fetch and how much, and tell it what
each fetch found; the sockets are :class:`~kombu_pgskip.poller.Poller`'s. A channel's fetch is
one statement: ``ack_fetch`` writes its queued acks and takes up to its free prefetch credit
(on the channel's fetch connection, :class:`~kombu_pgskip.fetcher.AsyncFetcher`, or its
transport's consumer connection), plus one for its no-ack queues when they are due, and
before it one per limited queue that is due (``fetch_limited`` on the transport's consumer
connection, carrying the queued acks so that the slots they free count:
:class:`~kombu_pgskip.policy.LimitGate` says which, and when).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from . import policy as fetch_policy
from .envelope import decode_problem, make_tag, parse_tag, to_message
from .policy import Announced, FetchPolicy, LimitGate, Next, Wake
from .poller import Poller, Ready
from .store import START, FetchedRow, fetch_filled, last_positions

if TYPE_CHECKING:
    from .channel import Channel
    from .fetcher import AsyncFetcher
    from .transport import Transport

logger = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, transport: Transport) -> None:
        options = transport.options
        self.transport = transport
        self.options = options
        self.policy = FetchPolicy.of(options)
        self.limits = LimitGate(options.polling_interval)
        #: What notifications named since each queue's last fetch (the event loop's thread).
        self.announced = Announced()
        #: When the timer set for the next limited fetch fires (event loop), if one is set.
        self._limits_timer: float | None = None
        self.poller = Poller(
            transport.url,
            schema=options.schema,
            listen=options.listen,
            **options.connect_kwargs,
        )

    def after_fork(self) -> None:
        """In a forked child: forget the parent's sockets; the next call fetches at once."""
        if self.poller.after_fork():
            self.policy.in_loop = False
            self.policy.drained = False

    def close(self) -> None:
        self.policy.drained = False  # a new connection fetches at once
        self.leave_loop()
        self.poller.close()

    # -- the channels -------------------------------------------------------------------------

    def _channels(self) -> list[Channel]:
        return [c for c in self.transport.channels if not c.closed]

    def consumed_queues(self) -> set[str]:
        queues: set[str] = set()
        for channel in self._channels():
            queues.update(channel._active_queues)
        return queues

    def acks_waiting(self) -> bool:
        return any(len(c.acks) for c in self._channels())

    # -- wake-ups from other threads ----------------------------------------------------------

    def wakeup(self, *, fetch: bool = True) -> None:
        """Wake the consumer thread (any thread); ``fetch=False`` only asks, in the event loop,
        for queued acks to be written soon."""
        poller = self.poller
        if poller.waiting or poller.loop is not None:
            if fetch:
                self.policy.fetch_wanted = True
            poller.wake()

    def consumers_changed(self) -> None:
        """A new consumer, or a larger prefetch window: fetch at once."""
        self.policy.drained = False
        self.wakeup()

    def limits_known(self, names: set[str]) -> None:
        """The queues consumed here that are limited are ``names`` (the background thread's
        housekeeping, any thread): a queue newly limited is fetched at once."""
        if self.limits.known(names):
            self.consumers_changed()

    def settled(self, channel: Channel, delivery_tag: object) -> None:
        """A message ``channel`` delivered was acked or rejected (any thread): if it was of a
        limited queue found at its limit, that queue's next fetch is due (the ack or reject
        itself asks for a fetch, which carries it)."""
        queue = channel.limited_rows.pop(parse_tag(delivery_tag)[0], None)
        if queue is not None:
            self.limits.settled(queue)

    def ack_queued(self, channel: Channel, *, first: bool) -> None:
        """An ack of ``channel`` was queued (on any thread): see ``FetchPolicy.ack_queued``."""
        wake = self.policy.ack_queued(channel.fetch_state, first=first)
        if wake is Wake.FETCH:
            self.wakeup()
        elif wake is Wake.FLUSH:
            self.wakeup(fetch=False)

    # -- notifications ------------------------------------------------------------------------

    def _read_notifications(self) -> tuple[set[str], bool]:
        """Consume the notifications received: (consumed queues that got messages, whether a
        scheduled message was announced)."""
        notes = self.poller.notifications()
        now = time.monotonic()
        if notes.scheduled_in is not None:
            self.policy.scheduled(now, notes.scheduled_in)
        consumed = self.consumed_queues()
        queues = notes.queues & consumed
        if queues:
            self.announced.heard(
                {q: named for q, named in notes.named.items() if q in consumed},
                notes.plain & consumed,
            )
            self.limits.notified(queues)
            self.policy.notified(now)
            for channel in self._channels():
                if channel.no_ack_queues and not channel.no_ack_queues.isdisjoint(queues):
                    channel.fetch_state.noack_due = True
        return queues, notes.scheduled_in is not None

    def _cooldown_left(self) -> float:
        """Seconds until a notified fetch may be sent; in the event loop, a fetch is then set
        for that moment, to take the messages announced meanwhile together."""
        wait = self.policy.cooldown_left(time.monotonic())
        if wait > 0:
            self.poller.call_later_once("cooldown", wait, self.loop_drain)
        return wait

    # -- kombu's blocking drain_events ----------------------------------------------------------

    def drain(self, timeout: float | None) -> None:
        """Deliver the next batch, waiting up to ``timeout`` seconds for one (``TimeoutError``).

        Waits on LISTEN (or sleeps, in poll-only mode) between polls; wakes early for a
        notification on a consumed queue, a scheduled message falling due, or another thread
        (:class:`~kombu_pgskip.policy.DrainCall` says when it fetches).
        """
        policy = self.policy
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        notified = acks_waiting = False
        if policy.drained:
            notified = bool(self._read_notifications()[0])
            acks_waiting = not notified and self.acks_waiting()
        call = policy.drain_call(start, notified=notified, acks_waiting=acks_waiting)
        while True:
            now = time.monotonic()
            promoted = policy.promote_due(now) and self._promote(now) > 0
            if call.should_fetch(now, promoted=promoted):
                delivered = self.deliver_batch()
                policy.limits_at = self.limits.next_at(time.monotonic())
                more = policy.more_due or any(c.fetch_state.starved for c in self._channels())
                call.fetched(time.monotonic(), more_due=more, full_scan_at=policy.full_scan_owed_at)
                if delivered:
                    return
                now = time.monotonic()
            acks_waiting = self.acks_waiting()
            wait = call.wait(now, acks_waiting=acks_waiting, deadline=deadline)
            if wait is None:
                raise TimeoutError()
            woken = self._wait(wait)
            call.woke(time.monotonic(), woken=woken, acks_waiting=acks_waiting)

    def _wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True if woken for a fetch (a notification, once the
        cooldown has passed; another thread), False at the time or when a scheduled message
        announced an earlier due time."""
        poller = self.poller
        listener, opened = poller.ensure_listener()
        if opened:
            # A message that arrived between the last fetch and the LISTEN sent no
            # notification we could see: fetch once more before sleeping (a `celery inspect`
            # reply can arrive within milliseconds of the request).
            return True
        end = time.monotonic() + seconds
        notified = False
        poller.waiting = True
        try:
            while True:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return notified
                ready = poller.wait(remaining)
                if ready is Ready.WOKEN:
                    return True
                if ready is Ready.TIMEOUT or listener is None:
                    return notified
                queues, scheduled = self._read_notifications()
                if scheduled and not queues:
                    return notified  # it moved the promotion: wait anew until then
                if queues:
                    # As in the event loop: a notification's fetch waits until the cooldown
                    # after the previous fetch, and takes what was announced meanwhile too.
                    left = self._cooldown_left()
                    if left <= 0:
                        return True
                    notified = True
                    end = min(end, time.monotonic() + left)
        finally:
            poller.waiting = False

    # -- Celery's event loop (kombu hub) ------------------------------------------------------

    def register(self, loop: Any) -> None:
        """Deliver from ``loop`` instead of blocking ``drain_events`` calls. A notification for
        a consumed queue, a wake-up (credit freed by an ack, a new consumer) and the poll every
        ``polling_interval`` trigger fetches, which run on the loop's thread."""
        self.leave_loop()
        self.policy.in_loop = True
        self.poller.attach(
            loop,
            on_wake=self._on_wake,
            on_notified=self.on_notified,
            on_poll=self._on_poll,
            poll_interval=self.options.polling_interval,
        )
        self._noack_all_due()  # what came while nobody listened
        self.announced.forget()
        self._queue_drain()

    def leave_loop(self) -> None:
        self.policy.in_loop = False
        if self.poller.owned:
            for channel in list(self.transport.channels):
                if channel.fetcher is not None and channel.fetcher.in_flight:
                    self.release(channel)  # nobody will read its reply from this loop
        self.poller.detach()

    def _queue_drain(self) -> None:
        self.poller.call_soon_once("drain", self.loop_drain)

    def _queue_ack_flush(self) -> None:
        self.poller.call_later_once("ack_flush", fetch_policy.ACK_FLUSH_DELAY, self._flush_tick)

    def _on_wake(self) -> None:
        self.poller.drain_wake()
        if self.policy.fetch_wanted:
            self.policy.fetch_wanted = False
            self.policy.wanted_seq += 1
            self.loop_drain()
        else:
            self._queue_ack_flush()

    def _flush_tick(self) -> None:
        """Write acks still waiting ``ACK_FLUSH_DELAY`` after the first was queued: with a
        fetch, which also takes whatever arrived, or on their own where a fetch would find
        nothing (``FetchPolicy.acks_alone``)."""
        now = time.monotonic()
        fetch = False
        for channel in self._channels():
            if len(channel.acks) and not self._send_acks_alone(channel, now):
                fetch = True
        if fetch:
            self.loop_drain()

    def _send_acks_alone(self, channel: Channel, now: float) -> bool:
        """Send ``channel``'s queued acks without a fetch, if a fetch would find nothing; the
        reply comes to :meth:`_on_fetch_readable` as a fetch's does. False: not sent."""
        if not channel._consumers:
            return False  # the loop's drain writes them (Channel.flush_acks)
        fetcher = channel.own_fetcher()
        if (
            fetcher is None
            or fetcher.in_flight
            or not self.policy.acks_alone(channel.fetch_state, now)
            or self.limits.due(list(channel._active_queues), now)
        ):
            return False
        acks = channel.acks
        pairs = acks.take()
        with acks.writing(pairs):
            fetcher.send_acks(pairs, channel.consumer_id)
        acks.sent_with_fetch(pairs)
        self.poller.watch(fetcher, fetcher.fileno(), self._on_fetch_readable, channel)
        return True

    def on_notified(self) -> None:
        """The LISTEN connection is readable."""
        poller = self.poller
        if poller.loop is None or poller.listener is None:
            return
        try:
            queues, scheduled = self._read_notifications()
        except Exception:
            # The server went away: stop watching the dead socket; the error reaches Celery,
            # which reconnects (and registers this transport with its loop again).
            self.leave_loop()
            poller.drop_listener()
            raise
        if scheduled:
            poller.call_later(
                max(0.0, self.policy.next_promote - time.monotonic()), self.loop_drain
            )
        if queues and self._cooldown_left() <= 0:
            self.loop_drain(queues)

    def _on_poll(self) -> None:
        if self.poller.loop is not None:
            self._noack_all_due()  # the fallback poll covers every queue
            self.announced.forget()  # and looks for every due message
            self.loop_drain()

    def _on_fetch_readable(self, channel: Channel) -> None:
        fetcher = channel.fetcher
        if fetcher is None or self.poller.loop is None:
            return
        try:
            result = fetcher.poll()
        except Exception:
            # The fetch failed or its connection went away: as with the LISTEN socket, stop
            # watching and let the error reach Celery, which reconnects. The acks it carried
            # are queued again; the rows of a lost fetch, if it ran, return with this
            # consumer's lease.
            channel.acks.fetch_failed()
            self.poller.unwatch(fetcher)
            channel.fetcher = None
            fetcher.close()
            self.leave_loop()
            raise
        if result is None:
            return
        rows = self._fetched(channel, result)
        if channel.closed:  # closed meanwhile: never delivered
            if rows:
                channel.settle("requeue", [make_tag(r.id, r.delivery) for r in rows])
            return
        if fetcher.urgent:
            # Remote control committed before some of these rows: handled first, as when
            # every fetch began with it (a revoke, then at once the task it names).
            self._deliver_urgent()
        for row in rows:
            self._deliver_row(channel, row)
        after = self.policy.after_loop_fetch(channel.fetch_state, acks_waiting=bool(channel.acks))
        if after is Next.DRAIN or (after is Next.AFTER_COOLDOWN and self._cooldown_left() <= 0):
            self._queue_drain()
        elif after is Next.FULL_SCAN:
            self._queue_full_scan(self.policy.full_scan_at(channel.fetch_state))
        elif after is Next.FLUSH_ACKS:
            self._queue_ack_flush()

    def _queue_full_scan(self, at: float) -> None:
        """Fetch at ``at`` (monotonic s), when a scan from the beginning that a channel owes
        is due."""
        self.poller.call_later_once("full_scan", max(0.0, at - time.monotonic()), self.loop_drain)

    def loop_drain(
        self, only: set[str] | None = None, max_batches: int = 10, *, eager: bool = False
    ) -> None:
        """Promote due messages and deliver, up to ``max_batches`` batches per loop turn
        (from the channels consuming ``only``, if given). A small refill put off by a channel
        is retried, eagerly, ``REFILL_DELAY`` later."""
        poller = self.poller
        if poller.loop is None:
            return
        now = time.monotonic()
        if self.policy.promote_due(now):
            if self._promote(now):
                self._noack_all_due()
            only = None
            # The next scheduled message is promoted when it falls due, not at the poll after.
            poller.call_later(
                max(0.0, self.policy.next_promote - time.monotonic()), self.loop_drain
            )
        for _ in range(max_batches):
            delivered = self.deliver_batch(only, eager=eager)
            self._arm_limits_timer()
            if self.policy.refill_deferred:
                poller.call_later_once("refill", fetch_policy.REFILL_DELAY, self.refill)
            if self.policy.full_scan_owed_at is not None:
                self._queue_full_scan(self.policy.full_scan_owed_at)
            if not delivered or not self.policy.more_due:
                # Nothing, or less than asked for: the queues are drained for now, and what
                # was delivered reaches the pool before any further round trip.
                return
            only = None
        self._queue_drain()  # more to fetch: go on after the loop has served others

    def refill(self) -> None:
        self.loop_drain(eager=True)

    def _arm_limits_timer(self) -> None:
        """Set a timer for when the next limited queue that waits is due (its bucket's next
        token, or the poll), unless one is set for that time or earlier."""
        now = time.monotonic()
        at = self.limits.next_at(now)
        if at is None or (self._limits_timer is not None and now < self._limits_timer <= at):
            return
        self._limits_timer = at
        self.poller.call_later(max(0.0, at - now), self._limits_tick)

    def _limits_tick(self) -> None:
        if self._limits_timer is not None and time.monotonic() >= self._limits_timer - 0.001:
            self._limits_timer = None
        self.loop_drain()

    # -- fetch and deliver --------------------------------------------------------------------

    def deliver_batch(self, only: set[str] | None = None, *, eager: bool = True) -> bool:
        """Fetch and deliver one batch per consuming channel (those consuming ``only``)."""
        delivered = deferred = more = False
        owed: list[float] = []
        # Channels with no-ack consumers first: remote control (a revoke, a rate limit) is
        # handled before task messages published after it, as Celery expects.
        for channel in sorted(self._channels(), key=lambda c: not c.no_ack_queues):
            if not channel._consumers or (
                only is not None and only.isdisjoint(channel._active_queues)
            ):
                channel.flush_acks()
                continue
            # A callback that raises leaves its message running under this consumer: the
            # channel's restore on close, or the sweeper, returns it to the queue.
            for row in self._fetch(channel, eager=eager):
                delivered = True
                self._deliver_row(channel, row)
            state = channel.fetch_state
            deferred = deferred or state.refill_deferred
            more = more or state.more_due
            in_flight = channel.fetcher is not None and channel.fetcher.in_flight
            if state.full_owed and not state.more_due and not in_flight:
                owed.append(self.policy.full_scan_at(state))
        self.policy.refill_deferred = deferred
        self.policy.more_due = more
        self.policy.full_scan_owed_at = min(owed, default=None)
        return delivered

    def _fetch(self, channel: Channel, *, eager: bool) -> list[FetchedRow]:
        """One fetch for ``channel``: its queued acks and up to its free prefetch credit.

        On the channel's fetch connection from the event loop, the rows come later (with the
        reply, :meth:`_on_fetch_readable`) and this returns none.
        """
        state = channel.fetch_state
        state.refill_deferred = state.more_due = False
        if not channel._consumers or not channel._active_queues:
            channel.flush_acks()
            return []
        fetcher = channel.own_fetcher()
        looped = fetcher is not None and self.poller.loop is not None
        if fetcher is not None and fetcher.in_flight:
            if looped:
                return []  # acks wait for the next fetch; the reply brings this one's rows
            return self._wait_fetch(channel, fetcher)  # a blocking wait was interrupted
        qos = channel.qos
        limit = self.policy.limit(
            state,
            credit=qos.can_consume_max_estimate(),
            prefetch_count=qos.prefetch_count,
            eager=eager,
        )
        if limit <= 0:
            if not state.refill_deferred:
                channel.flush_acks()  # no credit: the acks cannot wait for a fetch
            return []
        queues = list(dict.fromkeys(channel._active_queues))
        channel.ensure_registered(queues)
        ack_queues = [q for q in queues if q not in channel.no_ack_queues]
        noack_queues = [q for q in queues if q in channel.no_ack_queues]
        store = self.transport.consumer_store
        max_bytes = self.options.fetch_max_bytes
        out: list[FetchedRow] = []
        now = time.monotonic()
        after = self.policy.scan_after(state, ack_queues, now)
        starts = [state.positions.get(q, START) for q in ack_queues] if after else None
        self.policy.scanning(state, now, after=after)
        if noack_queues and self.policy.fetches_noack(state, with_ack_queues=bool(ack_queues)):
            out += store.fetch(
                noack_queues, limit, channel.consumer_id, no_ack=True, max_bytes=max_bytes
            )
            state.noack_due = fetch_filled(out, limit)  # more may be due
        limited = self.limits.due(ack_queues, now) if len(out) < limit else []
        if limited:
            out += self._fetch_limited(channel, limited, limit - len(out))
        if not ack_queues or len(out) >= limit:
            channel.flush_acks()
        else:
            acks = channel.acks
            pairs = acks.take()
            named = self.announced.sending(queues)
            if fetcher is not None:
                take = None
                if (
                    named is not None
                    and looped
                    and named[0] in ack_queues
                    and starts is None
                    and not state.full_owed
                    and state.sent_wanted_seq == self.policy.wanted_seq
                ):
                    take = named[1:]
                with acks.writing(pairs):
                    fetcher.send(
                        pairs,
                        ack_queues,
                        limit - len(out),
                        channel.consumer_id,
                        self._urgent_queues(),
                        after=starts,
                        named=take,
                    )
                acks.sent_with_fetch(pairs)
                self.policy.sent(state, time.monotonic())
                if not looped:  # kombu's blocking drain_events
                    return out + self._wait_fetch(channel, fetcher)
                self.poller.watch(fetcher, fetcher.fileno(), self._on_fetch_readable, channel)
                return out  # the limited fetches' rows; the reply brings the others'
            with acks.writing(pairs):
                done, rows = store.ack_fetch(
                    pairs,
                    ack_queues,
                    limit - len(out),
                    channel.consumer_id,
                    max_bytes=max_bytes,
                    after=starts,
                )
            acks.written(len(pairs), done)
            out += rows
        self.policy.fetched(
            state,
            took=len(out),
            filled=fetch_filled(out, limit),
            now=time.monotonic(),
            last=last_positions(
                [r for r in out if r.queue not in channel.no_ack_queues and r.queue not in limited]
            ),
        )
        return out

    def _fetch_limited(self, channel: Channel, queues: list[str], credit: int) -> list[FetchedRow]:
        """The limited fetches of ``queues`` for ``channel``, up to ``credit`` messages in all,
        one queue after the other; the first carries the channel's queued acks (the slots they
        free count). What each finds tells :attr:`limits` when the queue is due again."""
        store = self.transport.consumer_store
        acks = channel.acks
        pairs = acks.take()
        taken: list[FetchedRow] = []
        for queue in queues:
            asked = credit - len(taken)
            if asked <= 0:
                break  # the rest stay due: the next fetch, once credit is freed
            with acks.writing(pairs):
                result = store.fetch_limited(queue, asked, channel.consumer_id, acks=pairs)
            if pairs:
                acks.written(len(pairs), result.acked)
                pairs = []
            self.limits.fetched(
                queue,
                time.monotonic(),
                asked=asked,
                took=len(result.rows),
                limited=result.limited,
                more=result.more,
                free=result.free,
                tokens=result.tokens,
                rate=result.rate,
            )
            for row in result.rows:
                channel.limited_rows[row.id] = queue
            taken += result.rows
        return taken

    def _wait_fetch(self, channel: Channel, fetcher: AsyncFetcher) -> list[FetchedRow]:
        """Wait for the fetch in flight (outside an event loop, or at close); its rows. If it
        fails, the acks it carried are queued again."""
        try:
            result = fetcher.wait()
        except BaseException:
            channel.acks.fetch_failed()
            raise
        return [] if result is None else self._fetched(channel, result)

    def _fetched(
        self, channel: Channel, result: tuple[int, list[FetchedRow], int]
    ) -> list[FetchedRow]:
        acked, rows, limit = result
        channel.acks.fetch_returned(acked)
        if not limit:
            return []  # acks alone (AsyncFetcher.send_acks): nothing was fetched
        self.policy.fetched(
            channel.fetch_state,
            took=len(rows),
            filled=fetch_filled(rows, limit),
            now=time.monotonic(),
            last=last_positions(rows),
        )
        return rows

    def release(self, channel: Channel) -> None:
        """Close ``channel``'s fetch connection; a fetch in flight is waited for and its rows
        are put back (never delivered)."""
        fetcher, channel.fetcher = channel.fetcher, None
        if fetcher is None:
            return
        try:
            rows = self._wait_fetch(channel, fetcher) if channel.owned_by_this_process else []
            if rows:
                channel.settle("requeue", [make_tag(r.id, r.delivery) for r in rows])
        except Exception as exc:
            # Not lost: unregistering this consumer (or the sweeper) returns them.
            logger.warning(
                "could not return fetched messages at close (%s); they return to pending "
                "with this consumer's lease",
                exc,
                extra={"action": "fetch_release_failed"},
            )
        finally:
            self.poller.unwatch(fetcher)
            fetcher.close()

    def _urgent_queues(self) -> list[str]:
        """The no-ack queues a task fetch looks into (``FetchPolicy.skips_noack``)."""
        if not self.policy.skips_noack():
            return []
        queues: set[str] = set()
        for channel in self._channels():
            queues.update(channel.no_ack_queues)
        return list(queues)

    def _noack_all_due(self) -> None:
        for channel in self.transport.channels:
            if channel.no_ack_queues:
                channel.fetch_state.noack_due = True

    def _deliver_urgent(self) -> None:
        """Fetch and deliver the no-ack queues now (a task fetch saw a message in one). Should
        a control command raise (``celery control shutdown``), the task fetch's rows are not
        delivered: they stay running under the consumer, whose close returns them."""
        for channel in list(self._channels()):
            if not channel.no_ack_queues or not channel._consumers:
                continue
            channel.fetch_state.noack_due = True
            for row in self._fetch(channel, eager=True):
                self._deliver_row(channel, row)

    def _deliver_row(self, channel: Channel, row: FetchedRow) -> None:
        """Hand a fetched row to its consumer, or fail it if its body cannot be decoded."""
        message = to_message(row)
        problem = decode_problem(message)
        if problem is not None:
            channel.fail_undecodable(row, problem)
            return
        self.transport._deliver(message, row.queue)

    def _promote(self, now: float) -> int:
        """Promote due scheduled messages; returns how many."""
        promoted, next_in = self.transport.store.promote_scheduled()
        if promoted:
            self.announced.forget()  # the messages it made due are not named
            logger.debug("promoted %d scheduled messages", promoted, extra={"action": "promote"})
        self.policy.promoted(now, next_in)
        return int(promoted)
