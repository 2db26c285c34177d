"""What the LISTEN connection's notifications on the jobs channel say (``poller.heard``): the
message a publish names, and the queues a notification leaves unknown."""

from __future__ import annotations

from kombu_pgskip.poller import NAME_SEPARATOR, Notifications, heard


def _hear(*notes: tuple[str, int]) -> Notifications:
    """``notes`` as (payload, sender pid), heard in that order."""
    found = Notifications()
    after = None
    for payload, pid in notes:
        after = heard(found, payload, pid, after)
    return found


def _named(queue: str, ident: int, slot: int) -> str:
    return NAME_SEPARATOR.join([queue, str(ident), str(slot)])


def test_a_publish_names_its_message_and_its_plain_notification_adds_nothing() -> None:
    found = _hear((_named("q", 7, 3), 100), ("q", 100))
    assert found.queues == {"q"}
    assert found.named == {"q": [(7, 3)]}
    assert found.plain == set()


def test_a_plain_notification_from_elsewhere_leaves_the_queue_unknown() -> None:
    """Another session (the sweeper returning a message, a promotion), or the same session in
    a later transaction, right after a named one: what is due there is not known."""
    found = _hear((_named("q", 7, 3), 100), ("q", 100), ("q", 200))
    assert found.plain == {"q"} and found.named == {"q": [(7, 3)]}
    found = _hear((_named("q", 7, 3), 100), ("q", 100), ("q", 100))
    assert found.plain == {"q"}
    found = _hear(("q", 200), (_named("q", 7, 3), 100), ("q", 100))
    assert found.plain == {"q"}


def test_messages_named_in_one_transaction_each_count() -> None:
    """PostgreSQL delivers a payload once per transaction: two publishes to a queue inside one
    transaction are heard as named, plain, named. Both are named: the queue has two."""
    found = _hear((_named("q", 7, 3), 100), ("q", 100), (_named("q", 8, 3), 100))
    assert found.named == {"q": [(7, 3), (8, 3)]} and found.plain == set()


def test_a_routed_publish_names_each_queue_s_message() -> None:
    found = _hear((_named("a", 7, 3), 100), ("a", 100), (_named("b", 8, 3), 100), ("b", 100))
    assert found.named == {"a": [(7, 3)], "b": [(8, 3)]} and found.plain == set()
    assert found.queues == {"a", "b"}


def test_a_queue_whose_name_holds_the_separator_is_parsed_from_the_right() -> None:
    odd = f"odd{NAME_SEPARATOR}name"
    found = _hear((_named(odd, 7, 3), 100), (odd, 100))
    assert found.named == {odd: [(7, 3)]} and found.plain == set()
    # a queue name that only looks like a named payload's start is a plain notification
    found = _hear(
        (f"q{NAME_SEPARATOR}x{NAME_SEPARATOR}3", 100),
    )
    assert found.plain == {f"q{NAME_SEPARATOR}x{NAME_SEPARATOR}3"} and found.named == {}
