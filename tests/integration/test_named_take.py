"""An idle consumer on an event loop takes the message a notification named, by its id: one
statement on that message's slot, and nothing more when another consumer took it first; a
notification that named nothing makes the next fetch look for every due message."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue
from kombu.asynchronous import Hub

from kombu_pgskip.fetcher import AsyncFetcher
from tests.integration.test_ack_batching import _broker, _run_until, _stop_heartbeat


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every statement the event loop's fetchers send, in order."""
    sent: list[str] = []
    real = AsyncFetcher._send

    def recorded(self: AsyncFetcher, params: Any, statement: bytes, query: bytes) -> None:
        sent.append(statement.decode())
        real(self, params, statement, query)

    monkeypatch.setattr(AsyncFetcher, "_send", recorded)
    return sent


@contextlib.contextmanager
def _consumers(db_url: str, queue: Queue, n: int) -> Iterator[tuple[list[list[Any]], Hub]]:
    """See :func:`_consumers_as`, as the database's owner."""
    with _consumers_as(db_url, queue, n) as consumers:
        yield consumers


@contextlib.contextmanager
def _consumers_as(url: str, queue: Queue, n: int) -> Iterator[tuple[list[list[Any]], Hub]]:
    """``n`` consumers of ``queue``, each on a transport of its own (as ``n`` workers), all on
    one kombu Hub; heartbeats stopped, so only the consumers' own statements write: (the
    messages each received, the hub)."""
    hub = Hub()
    received: list[list[Any]] = [[] for _ in range(n)]
    conns: list[Connection] = []
    with contextlib.ExitStack() as stack:
        for k in range(n):
            conn = stack.enter_context(
                Connection(_broker(url), transport_options={"polling_interval": 30})
            )
            Consumer(
                conn.channel(),
                [queue],
                callbacks=[lambda body, m, k=k: received[k].append(m)],
                prefetch_count=4,
            ).consume()
            conn.transport.register_with_event_loop(conn.connection, hub)
            stack.callback(conn.transport.unregister_from_event_loop, conn.connection, hub)
            conns.append(conn)
        stack.callback(hub.close)
        _run_until(hub, lambda: False, timeout=0.3)  # each has fetched once
        for conn in conns:
            _stop_heartbeat(conn)
        yield received, hub


def _publish(db_url: str, queue: str, n: int = 1, **kwargs: Any) -> None:
    """``n`` messages to ``queue`` through the default exchange, as Celery sends a task: one
    durable insert each, then its notifications."""
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        for i in range(n):
            producer.publish({"i": i}, exchange="", routing_key=queue, **kwargs)


def _settle(hub: Hub, received: list[list[Any]]) -> None:
    """Ack what was received and run the loop until every statement has come back."""
    for messages in received:
        for m in messages:
            if not m.acknowledged:
                m.ack()
    _run_until(hub, lambda: False, timeout=0.3)


def _statuses(db_url: str) -> list[tuple[str, int]]:
    """Every message's status and deliveries."""
    with psycopg.connect(db_url) as check:
        rows = check.execute("SELECT status::text, attempts FROM pgskip.jobs ORDER BY id")
        return [(str(r[0]), int(r[1])) for r in rows.fetchall()]


def _all(received: list[list[Any]]) -> int:
    return sum(len(r) for r in received)


def test_an_idle_consumer_takes_the_named_message_by_its_id(
    db_url: str, statements: list[str]
) -> None:
    queue = Queue("named_one", routing_key="named_one")
    with _consumers(db_url, queue, 1) as (received, hub):
        _run_until(hub, lambda: False, timeout=0.3)
        for n in (1, 2, 3):
            statements.clear()
            _publish(db_url, "named_one")
            _run_until(hub, lambda n=n: _all(received) == n)  # type: ignore[misc]
            assert _all(received) == n
            _settle(hub, received)
            if n > 1:  # the first fetch after the consumer started looked for everything
                with psycopg.connect(db_url) as check:
                    slot = check.execute("SELECT pgskip.current_slot()").fetchone() or [0]
                taken, *rest = statements
                assert taken == f"pgskip_take_announced_slot_{slot[0]}"
                assert rest == ["pgskip_ack"], "its ack went alone; nothing else was sent"
        bodies = [m.payload for m in received[0]]
        assert bodies == [{"i": 0}] * 3
        assert _statuses(db_url) == [("completed", 1)] * 3, "each taken once"


def test_idle_consumers_that_lose_the_race_send_one_statement_each(
    db_url: str, statements: list[str]
) -> None:
    """Every notification wakes every consumer of the queue; the one whose take comes first
    gets the message, and the others find it taken and send nothing more (no look for other
    due messages: the notification named the only one)."""
    queue = Queue("named_race", routing_key="named_race")
    with _consumers(db_url, queue, 3) as (received, hub):
        _publish(db_url, "named_race")  # every consumer has fetched once since it started
        _run_until(hub, lambda: _all(received) == 1)
        _settle(hub, received)
        for n in (2, 3, 4, 5):
            statements.clear()
            _publish(db_url, "named_race")
            _run_until(hub, lambda n=n: _all(received) == n)  # type: ignore[misc]
            _run_until(hub, lambda: False, timeout=0.3)
            assert _all(received) == n, "taken once"
            fetches = [s for s in statements if s != "pgskip_ack"]
            assert len(fetches) == 3 and all(
                s.startswith("pgskip_take_announced_slot_") for s in fetches
            ), fetches
            _settle(hub, received)
        assert _statuses(db_url) == [("completed", 1)] * 5, "each taken once"


def test_a_message_no_notification_named_is_not_left_to_the_poll(
    db_url: str, statements: list[str]
) -> None:
    """A notification from another session that names nothing (the sweeper returning a
    message, a promotion, a publish of several) arrives with a named one: the take of the
    named message is followed by a fetch that looks for every due message, in every slot."""
    queue = Queue("named_mixed", routing_key="named_mixed")
    with _consumers(db_url, queue, 1) as (received, hub):
        _publish(db_url, "named_mixed")
        _run_until(hub, lambda: _all(received) == 1)
        _settle(hub, received)
        with (
            psycopg.connect(db_url, autocommit=True) as one,
            psycopg.connect(db_url, autocommit=True) as other,
        ):
            slot, body = one.execute(
                "SELECT pgskip.current_slot(), payload::text FROM pgskip.jobs"
            ).fetchone() or (0, "")
            returned = other.execute(
                "INSERT INTO pgskip.jobs (queue, payload, slot) VALUES ('named_mixed', %s::json, "
                "%s) RETURNING id",
                (body, slot % 8 + 1),
            ).fetchone()
            assert returned is not None
            with one.transaction():
                named = one.execute(
                    "INSERT INTO pgskip.jobs (queue, payload) VALUES ('named_mixed', %s::json) "
                    "RETURNING id",
                    (body,),
                ).fetchone() or (0,)
                payload = f"named_mixed\x1f{named[0]}\x1f{slot}"
                one.execute("SELECT pg_notify('pgskip:pgskip', %s)", (payload,))
                one.execute("SELECT pg_notify('pgskip:pgskip', 'named_mixed')")
            other.execute("SELECT pg_notify('pgskip:pgskip', 'named_mixed')")
        _run_until(hub, lambda: _all(received) == 3, timeout=5)
        assert _all(received) == 3, "the unnamed message waited for the poll"


def test_a_named_message_of_a_paused_queue_waits_for_its_resume(db_url: str) -> None:
    """The take by id skips what a fetch skips: a message of a paused queue stays pending
    until the queue is resumed, whose notification brings it."""
    from kombu_pgskip.store import Store

    queue = Queue("named_paused", routing_key="named_paused")
    store = Store(db_url)
    try:
        with _consumers(db_url, queue, 1) as (received, hub):
            _publish(db_url, "named_paused")
            _run_until(hub, lambda: _all(received) == 1)
            _settle(hub, received)
            store.pause(["named_paused"])
            _publish(db_url, "named_paused")
            _run_until(hub, lambda: False, timeout=0.5)
            assert _all(received) == 1
            store.resume(["named_paused"])
            started = time.monotonic()
            _run_until(hub, lambda: _all(received) == 2, timeout=5)
            assert _all(received) == 2 and time.monotonic() - started < 5
    finally:
        store.close()


def test_a_named_message_that_expired_is_not_taken(db_url: str) -> None:
    queue = Queue("named_expired", routing_key="named_expired")
    with _consumers(db_url, queue, 1) as (received, hub):
        _publish(db_url, "named_expired")
        _run_until(hub, lambda: _all(received) == 1)
        _settle(hub, received)
        with psycopg.connect(db_url, autocommit=True) as admin, admin.transaction():
            row = admin.execute(
                "INSERT INTO pgskip.jobs (queue, payload, expires_at) "
                "SELECT queue, payload, now() - interval '1 s' FROM pgskip.jobs "
                "RETURNING id, slot"
            ).fetchone() or (0, 0)
            admin.execute(
                "SELECT pg_notify('pgskip:pgskip', %s)",
                (f"named_expired\x1f{row[0]}\x1f{row[1]}",),
            )
        _run_until(hub, lambda: False, timeout=0.5)
        assert _all(received) == 1
        with psycopg.connect(db_url) as check:
            status = check.execute("SELECT status::text FROM pgskip.jobs WHERE id = %s", (row[0],))
            assert status.fetchone() == ("pending",)


def test_notifications_naming_what_a_fetch_would_not_take_take_nothing(
    db_url: str, pg_server_dsn: str
) -> None:
    """Any role that can connect can notify, and a publisher role has every reason to: as the
    role `pgskip grant --publisher` makes, notifications naming a message of a queue the worker
    does not consume, one due in an hour, one scheduled, one completed and an id that does not
    exist make a worker (as the role `pgskip grant --worker` makes) take nothing; a publish
    right after is taken as ever."""
    from tests.safety_support import publisher_role, worker_role

    queue = Queue("named_guarded", routing_key="named_guarded")
    with (
        publisher_role(pg_server_dsn, db_url) as publisher_url,
        worker_role(pg_server_dsn, db_url) as worker_url,
        _consumers_as(worker_url, queue, 1) as (received, hub),
    ):
        _publish(db_url, "named_guarded")
        _run_until(hub, lambda: _all(received) == 1)
        _settle(hub, received)
        with psycopg.connect(db_url, autocommit=True) as owner:
            targets = owner.execute(
                "INSERT INTO pgskip.jobs (queue, payload, status, run_at) VALUES"
                " ('not_consumed', '{}', 'pending', now()),"
                " ('named_guarded', '{}', 'pending', now() + interval '1 hour'),"
                " ('named_guarded', '{}', 'scheduled', now() + interval '1 hour'),"
                " ('named_guarded', '{}', 'completed', now())"
                " RETURNING id, slot"
            ).fetchall()
        targets.append((10**12, targets[0][1]))
        with psycopg.connect(publisher_url, autocommit=True) as attacker:
            who = attacker.execute("SELECT current_user").fetchone() or ("",)
            assert who[0].startswith("publisher_")
            for ident, slot in targets:
                payload = f"named_guarded\x1f{ident}\x1f{slot}"
                attacker.execute("SELECT pg_notify('pgskip:pgskip', %s)", (payload,))
                _run_until(hub, lambda: False, timeout=0.2)
        assert _all(received) == 1, "nothing taken"
        with psycopg.connect(db_url) as check:
            statuses = check.execute(
                "SELECT status::text FROM pgskip.jobs WHERE id = ANY(%s) ORDER BY id",
                ([t[0] for t in targets],),
            ).fetchall()
        assert statuses == [("pending",), ("pending",), ("scheduled",), ("completed",)]
        with Connection(_broker(publisher_url)) as conn:
            Producer(conn.channel()).publish({"i": 1}, exchange="", routing_key="named_guarded")
        _run_until(hub, lambda: _all(received) == 2, timeout=5)
        assert _all(received) == 2
