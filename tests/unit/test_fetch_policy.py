"""The fetch policy, without a database: credit, refills, cooldown, acks riding along, the
blocking ``drain_events`` schedule and promotion times (kombu_pgskip.policy)."""

from __future__ import annotations

import pytest

from kombu_pgskip.options import Options
from kombu_pgskip.policy import (
    ACK_FLUSH_DELAY,
    FULL_SCAN_SPACING,
    Announced,
    ChannelState,
    FetchPolicy,
    Next,
    Wake,
)
from kombu_pgskip.store import Position


def _policy(**options: object) -> FetchPolicy:
    return FetchPolicy.of(Options.from_transport_options(dict(options)))


def test_a_fetch_asks_for_the_free_credit_up_to_the_fetch_limit() -> None:
    policy = _policy(fetch_limit=50)
    state = ChannelState()
    assert policy.limit(state, credit=None, prefetch_count=0, eager=False) == 50
    assert policy.limit(state, credit=8, prefetch_count=8, eager=False) == 8
    assert policy.limit(state, credit=200, prefetch_count=200, eager=False) == 50
    assert not state.refill_deferred and not state.starved


def test_a_small_refill_is_put_off_in_the_event_loop_unless_eager() -> None:
    policy = _policy()
    state = ChannelState()
    # One slot of eight free while seven are held: put off.
    assert policy.limit(state, credit=1, prefetch_count=8, eager=False) == 0
    assert state.refill_deferred and not state.starved
    # Half the window free: fetch now.
    state = ChannelState()
    assert policy.limit(state, credit=4, prefetch_count=8, eager=False) == 4
    assert not state.refill_deferred
    # Eager (the retry REFILL_DELAY later): fetch the one.
    state = ChannelState()
    assert policy.limit(state, credit=1, prefetch_count=8, eager=True) == 1
    # Nothing held: an idle consumer's first fetch is never put off.
    state = ChannelState()
    assert policy.limit(state, credit=1, prefetch_count=1, eager=False) == 1


def test_no_credit_marks_the_channel_starved_and_an_ack_then_fetches_at_once() -> None:
    policy = _policy()
    policy.in_loop = True
    state = ChannelState()
    assert policy.limit(state, credit=0, prefetch_count=4, eager=True) == 0
    assert state.starved
    assert policy.ack_queued(state, first=True) is Wake.FETCH
    # A fetch that took less than its limit: nothing is known to wait any more.
    policy.fetched(state, took=2, filled=False, now=0.0)
    assert not state.starved and not state.more_due
    assert policy.ack_queued(state, first=True) is Wake.FLUSH
    assert policy.ack_queued(state, first=False) is Wake.NONE


def test_outside_an_event_loop_every_ack_asks_for_a_fetch() -> None:
    policy = _policy()
    assert policy.ack_queued(ChannelState(), first=False) is Wake.FETCH


def test_a_filled_fetch_calls_for_another_at_once() -> None:
    policy = _policy()
    state = ChannelState()
    policy.fetched(state, took=100, filled=True, now=0.0)
    assert state.more_due and state.starved
    assert policy.after_loop_fetch(state, acks_waiting=True) is Next.DRAIN


def test_a_notification_during_a_fetch_calls_for_another_after_the_cooldown() -> None:
    policy = _policy(fetch_cooldown=0.01)
    state = ChannelState()
    policy.sent(state, now=100.0)
    policy.fetched(state, took=1, filled=False, now=0.0)
    assert policy.after_loop_fetch(state, acks_waiting=False) is Next.NOTHING
    assert policy.after_loop_fetch(state, acks_waiting=True) is Next.FLUSH_ACKS
    policy.sent(state, now=101.0)
    policy.notified(now=101.001)  # while the fetch was in flight
    policy.fetched(state, took=0, filled=False, now=0.0)
    assert policy.after_loop_fetch(state, acks_waiting=True) is Next.AFTER_COOLDOWN
    assert policy.cooldown_left(101.005) == pytest.approx(0.005)
    assert policy.cooldown_left(101.02) < 0


def test_a_fetch_asked_for_while_one_is_in_flight_follows_it_at_once() -> None:
    """A wake-up that asked for a fetch (a new consumer) while the channel's fetch was in
    flight: that fetch was sent without what it asked for, so another follows its reply."""
    policy = _policy()
    state = ChannelState()
    policy.sent(state, now=1.0)
    policy.wanted_seq += 1  # the wake-up, handled while the fetch is in flight
    policy.fetched(state, took=0, filled=False, now=1.001)
    assert policy.after_loop_fetch(state, acks_waiting=False) is Next.DRAIN
    policy.sent(state, now=1.002)
    policy.fetched(state, took=0, filled=False, now=1.003)
    assert policy.after_loop_fetch(state, acks_waiting=False) is Next.NOTHING


def test_only_notified_fetches_adapt_the_cooldown() -> None:
    policy = _policy(fetch_cooldown=0.01, fetch_cooldown_max=0.08)
    state = ChannelState()
    # Not notified (a poll, an ack flush): an empty fetch says nothing about other workers.
    policy.sent(state, now=1.0)
    policy.fetched(state, took=0, filled=False, now=0.0)
    assert policy.cooldown.value == 0.01
    grown = []
    for i in range(5):
        policy.notified(now=2.0 + i)
        policy.sent(state, now=2.0 + i)
        policy.fetched(state, took=0, filled=False, now=0.0)  # another worker took the message
        grown.append(policy.cooldown.value)
    assert grown == pytest.approx([0.02, 0.04, 0.08, 0.08, 0.08])
    for i in range(40):
        policy.notified(now=10.0 + i)
        policy.sent(state, now=10.0 + i)
        policy.fetched(state, took=3, filled=False, now=0.0)
    assert policy.cooldown.value == 0.01


def test_acks_go_alone_only_while_a_fetch_would_find_nothing() -> None:
    def drained(policy: FetchPolicy) -> ChannelState:
        """A channel whose last fetch, sent at 1.0, took less than it asked for."""
        state = ChannelState()
        policy.sent(state, now=1.0)
        policy.fetched(state, took=1, filled=False, now=1.001)
        return state

    policy = _policy(polling_interval=30.0)
    policy.in_loop = True
    policy.promoted(1.0, next_in=None)
    state = drained(policy)
    assert policy.acks_alone(state, 2.0)
    # A notification since the fetch was sent: its message may be waiting.
    policy.notified(now=1.5)
    assert not policy.acks_alone(state, 2.0)
    # Messages left behind: the limit, the byte budget, no credit, a refill put off.
    for left in ("more_due", "starved", "refill_deferred"):
        state = drained(policy)
        setattr(state, left, True)
        assert not policy.acks_alone(state, 2.0), left
    # A fetch that scanned after its positions and came back short owes one from the start.
    state = drained(policy)
    state.full_owed = True
    assert not policy.acks_alone(state, 2.0)
    # A wake-up asked for a fetch (a new consumer): the fetch it asked for.
    state = drained(policy)
    policy.fetch_wanted = True
    assert not policy.acks_alone(state, 2.0)
    policy.fetch_wanted = False
    # A scheduled message to promote: the fetch that promotes it.
    state = drained(policy)
    policy.scheduled(2.0, due_in=0.5)
    assert policy.acks_alone(state, 2.4) and not policy.acks_alone(state, 2.5)
    # Outside an event loop, polling only, or without a fetch connection: always a fetch.
    for options in ({}, {"listen": False}, {"async_fetch": False}):
        other = _policy(polling_interval=30.0, **options)
        other.in_loop = bool(options)
        other.promoted(1.0, next_in=None)
        assert not other.acks_alone(drained(other), 2.0), options


def test_no_ack_queues_are_skipped_only_in_the_event_loop_with_notifications() -> None:
    state = ChannelState(noack_due=False)
    looped = _policy()
    looped.in_loop = True
    assert looped.skips_noack()
    assert not looped.fetches_noack(state, with_ack_queues=False)
    assert looped.fetches_noack(state, with_ack_queues=True)
    assert looped.fetches_noack(ChannelState(noack_due=True), with_ack_queues=False)
    blocking = _policy()
    assert not blocking.skips_noack() and blocking.fetches_noack(state, with_ack_queues=False)
    for options in ({"listen": False}, {"async_fetch": False}):
        policy = _policy(**options)
        policy.in_loop = True
        assert not policy.skips_noack()


def test_promotion_comes_back_when_the_next_scheduled_message_is_due() -> None:
    policy = _policy(polling_interval=1.0)
    assert policy.promote_due(0.0)
    policy.promoted(10.0, next_in=0.3)
    assert policy.next_promote == pytest.approx(10.3)
    policy.promoted(10.0, next_in=None)  # nothing scheduled: look again after a while
    assert policy.next_promote == pytest.approx(15.0)
    policy.promoted(10.0, next_in=3600.0)
    assert policy.next_promote == pytest.approx(15.0)
    policy.scheduled(11.0, due_in=0.5)  # a scheduled publish announced an earlier due time
    assert policy.next_promote == pytest.approx(11.5)
    assert not policy.promote_due(11.4) and policy.promote_due(11.5)


def test_a_drain_call_fetches_at_once_until_a_fetch_drains_the_queues() -> None:
    policy = _policy(polling_interval=30.0)
    policy.next_promote = 1e9
    call = policy.drain_call(0.0, notified=False, acks_waiting=False)
    assert call.should_fetch(0.0, promoted=False)
    call.fetched(0.001, more_due=False)
    assert policy.drained and policy.poll_at == pytest.approx(30.001)
    # The next call waits for a notification, the poll, or its deadline.
    call = policy.drain_call(1.0, notified=False, acks_waiting=False)
    assert not call.should_fetch(1.0, promoted=False)
    assert call.wait(1.0, acks_waiting=False, deadline=3.0) == pytest.approx(2.0)
    assert call.wait(3.0, acks_waiting=False, deadline=3.0) is None
    call.woke(1.5, woken=True, acks_waiting=False)
    assert call.should_fetch(1.5, promoted=False)
    # A promotion or the poll fetches too.
    call = policy.drain_call(2.0, notified=False, acks_waiting=False)
    assert call.should_fetch(2.0, promoted=True)
    call = policy.drain_call(2.0, notified=False, acks_waiting=False)
    assert call.should_fetch(31.0, promoted=False)


def test_a_drain_call_after_a_filled_fetch_fetches_at_once() -> None:
    policy = _policy(polling_interval=30.0)
    policy.drain_call(0.0, notified=False, acks_waiting=False).fetched(0.0, more_due=True)
    assert not policy.drained
    assert policy.drain_call(1.0, notified=False, acks_waiting=False).should_fetch(
        1.0, promoted=False
    )


def test_a_notified_drain_call_waits_for_the_cooldown() -> None:
    policy = _policy(polling_interval=30.0, fetch_cooldown=0.5, fetch_cooldown_max=0.5)
    policy.next_promote = 1e9
    state = ChannelState()
    policy.sent(state, now=10.0)
    policy.drain_call(10.0, notified=False, acks_waiting=False).fetched(10.0, more_due=False)
    call = policy.drain_call(10.1, notified=True, acks_waiting=False)
    assert not policy.drained, "owed to the notification even if the call times out"
    assert not call.should_fetch(10.1, promoted=False)
    assert call.wait(10.1, acks_waiting=False, deadline=None) == pytest.approx(0.4)
    assert call.should_fetch(10.5, promoted=False)


def test_acks_wait_for_a_notification_while_notifications_come_soon_enough() -> None:
    policy = _policy(polling_interval=30.0, fetch_cooldown=0)
    policy.next_promote = 1e9
    policy.drain_call(0.0, notified=False, acks_waiting=False).fetched(0.0, more_due=False)
    # Acks waiting: the call holds them back up to ACK_FLUSH_DELAY for a notification.
    call = policy.drain_call(1.0, notified=False, acks_waiting=True)
    assert not call.should_fetch(1.0, promoted=False)
    assert call.wait(1.0, acks_waiting=True, deadline=None) == pytest.approx(ACK_FLUSH_DELAY)
    # None came in time: the acks go with a fetch, and the next call sends them at once.
    call.woke(1.0 + ACK_FLUSH_DELAY, woken=False, acks_waiting=True)
    assert not policy.ack_wait_pays
    assert call.should_fetch(1.0 + ACK_FLUSH_DELAY, promoted=False)
    call.fetched(1.01, more_due=False)
    call = policy.drain_call(2.0, notified=False, acks_waiting=True)
    assert call.should_fetch(2.0, promoted=False)
    call.fetched(2.0, more_due=False)
    # A call that holds them back and sees a notification in time learns that waiting pays.
    policy.ack_wait_pays = False
    call = policy.drain_call(3.0, notified=False, acks_waiting=True)
    policy.notified(3.001)
    call.woke(3.001, woken=True, acks_waiting=True)
    assert policy.ack_wait_pays


# -- where a scan starts ---------------------------------------------------------------------

POS = Position(0, "2026-12-02 10:00:00+00", 7)


def _full(policy: FetchPolicy, state: ChannelState, at: float, cost: float) -> None:
    """A fetch from the beginning sent at ``at`` that took ``cost`` seconds and came back
    short, having taken a message at POS."""
    assert not policy.scan_after(state, ["q"], at)
    policy.scanning(state, at, after=False)
    policy.fetched(state, took=1, filled=False, now=at + cost, last={"q": POS})


def test_scans_start_at_the_beginning_while_that_is_cheap() -> None:
    policy = _policy()
    state = ChannelState()
    assert not policy.scan_after(state, ["q"], 0.0)  # nothing taken yet: no position
    for i in range(20):
        # Round trips of half a millisecond, give or take: never worth a position.
        _full(policy, state, at=float(i), cost=0.0005 + 0.0004 * (i % 3))
    assert state.positions == {"q": POS}
    assert not state.full_owed


def test_once_a_scan_from_the_beginning_is_slow_fetches_start_after_the_positions() -> None:
    policy = _policy()
    state = ChannelState()
    _full(policy, state, at=0.0, cost=0.001)
    _full(policy, state, at=0.5, cost=0.030)  # one slow scan alone: a hiccup, not a trend
    assert not policy.scan_after(state, ["q"], 0.531)
    _full(policy, state, at=0.6, cost=0.001)
    _full(policy, state, at=0.9, cost=0.018)
    _full(policy, state, at=1.0, cost=0.020)  # dead entries: every scan twenty times the cheapest
    # Until (1 + FULL_SCAN_SPACING) times its duration after it was sent, fetches start after
    # the positions; one that is not for any queue with a position scans from the beginning.
    due = 1.0 + (1 + FULL_SCAN_SPACING) * 0.020
    assert policy.full_scan_at(state) == pytest.approx(due)
    assert policy.scan_after(state, ["q"], 1.03)
    assert not policy.scan_after(state, ["other"], 1.03)
    assert not policy.scan_after(state, ["q"], due)
    # A fetch after the positions that fills its limit owes nothing yet; one that comes back
    # short cannot say the queue is drained: a scan from the beginning is owed, when due.
    policy.scanning(state, 1.03, after=True)
    policy.fetched(state, took=10, filled=True, now=1.031)
    assert not state.full_owed
    assert policy.after_loop_fetch(state, acks_waiting=False) is Next.DRAIN
    policy.scanning(state, 1.032, after=True)
    policy.fetched(state, took=3, filled=False, now=1.033, last={"q": POS._replace(id=9)})
    assert state.full_owed and state.positions["q"].id == 9
    assert policy.after_loop_fetch(state, acks_waiting=False) is Next.FULL_SCAN
    # The scan from the beginning settles it, and its duration sets the next spacing.
    _full(policy, state, at=due, cost=0.002)
    assert not state.full_owed
    assert policy.after_loop_fetch(state, acks_waiting=False) is Next.NOTHING
    assert not policy.scan_after(state, ["q"], due + 0.003)  # cheap again


def test_a_blocking_call_that_owes_a_scan_from_the_beginning_is_not_drained() -> None:
    policy = _policy(polling_interval=30)
    policy.next_promote = 100.0
    call = policy.drain_call(0.0, notified=False, acks_waiting=False)
    call.fetched(0.0, more_due=False, full_scan_at=0.1)
    assert not policy.drained
    assert call.wait(0.0, acks_waiting=False, deadline=None) == pytest.approx(0.1)
    assert call.should_fetch(0.1, promoted=False)


# -- Announced: what an idle consumer may take by id --------------------------------------------


def test_the_one_message_named_since_the_last_fetch_is_taken_by_id() -> None:
    announced = Announced()
    announced.heard({"a": [(7, 3)]}, set())
    assert announced.sending(["a", "b"]) == ("a", 7, 3)
    assert announced.sending(["a", "b"]) is None, "the fetch sent took it: nothing named since"


def test_anything_unnamed_makes_the_next_fetch_look_for_every_due_message() -> None:
    announced = Announced()
    # Two messages named (in one read, or two): which is due first is the fetch's to say.
    announced.heard({"a": [(7, 3), (8, 3)]}, set())
    assert announced.sending(["a"]) is None
    announced.heard({"a": [(7, 3)]}, set())
    announced.heard({"a": [(8, 3)]}, set())
    assert announced.sending(["a"]) is None
    # A notification that named nothing, before or after the named one.
    announced.heard({"a": [(7, 3)]}, {"a"})
    assert announced.sending(["a"]) is None
    announced.heard({}, {"a"})
    announced.heard({"a": [(7, 3)]}, set())
    assert announced.sending(["a"]) is None
    # Messages named in two of the channel's queues.
    announced.heard({"a": [(7, 3)], "b": [(9, 3)]}, set())
    assert announced.sending(["a", "b"]) is None
    # What another channel consumes is not this fetch's concern; it stays for that one.
    announced.heard({"a": [(7, 3)], "c": [(9, 3)]}, set())
    assert announced.sending(["a", "b"]) == ("a", 7, 3)
    assert announced.sending(["c"]) == ("c", 9, 3)


def test_after_forget_the_next_fetch_looks_for_every_due_message() -> None:
    """The poll, a new event loop, a promotion by this consumer: the next fetch looks for
    everything, even if a message is named meanwhile; the one after may take by id again."""
    announced = Announced()
    announced.heard({"a": [(7, 3)]}, set())
    announced.forget()
    announced.heard({"a": [(8, 3)]}, set())
    assert announced.sending(["a"]) is None
    announced.heard({"a": [(9, 3)]}, set())
    assert announced.sending(["a"]) == ("a", 9, 3)
