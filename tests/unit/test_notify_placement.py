"""Where a store puts the NOTIFY of an insert (Store._notify_placement), on an executor that
records the statements it is given and answers the rule's questions as told (pure logic)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kombu_pgskip.adapters import Query
from kombu_pgskip.executor import Executor, Params, Rows, Step
from kombu_pgskip.store import PUBLISH_MANY_CHUNK, NewMessage, Store
from kombu_pgskip.urls import Connection

DUE = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


class _Owed:
    def __init__(self) -> None:
        self.added: list[tuple[str, str, datetime | None]] = []
        self.named: list[tuple[int, int] | None] = []

    def add(
        self,
        queue: str,
        status: str,
        run_at: datetime | None,
        named: tuple[int, int] | None = None,
    ) -> None:
        self.added.append((queue, status, run_at))
        self.named.append(named)


class _Recording(Executor):
    """Runs nothing: records (how, statement names) and returns one id per message."""

    def __init__(self, *, alone: bool = False, hook: bool = False) -> None:
        self.schema = "pgskip"
        self.where = "a recording executor"
        self.alone = alone
        self.owed = _Owed() if hook else None
        self.ran: list[tuple[str, ...]] = []
        self.params: list[Params] = []
        self.asked_wakes = 0
        self.in_transaction = False
        self._next = 0

    @property
    def conn(self) -> Connection:
        raise AssertionError("no connection here")

    def connect(self) -> None:
        pass

    def close(self) -> None:
        pass

    def exclusive(self) -> nullcontext[None]:
        return nullcontext()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.in_transaction = True
        try:
            yield
        finally:
            self.in_transaction = False

    def _ids(self, params: Params) -> Rows:
        n = params["rows"].count('"queue"') if "rows" in params else 1
        self._next += n
        # with the slot, as insert_message returns it (slot 3 here)
        return [(str(i), "3") for i in range(self._next - n + 1, self._next + 1)]

    def run(self, query: Query, params: Params) -> Rows:
        raise AssertionError("publishing runs named statements")

    def run_direct(self, name: str, query: Query, params: Params) -> Rows:
        self.ran.append(("direct", name))
        self.params.append(params)
        return self._ids(params)

    def flushes_alone(self) -> bool:
        return self.alone and not self.in_transaction

    def run_then(self, first: Step, then: Step) -> tuple[Rows, str | None]:
        self.ran.append(("then", first[0], then[0]))
        self.params.append(then[2])
        return self._ids(first[2]), None

    def wakes(self, announce: Step) -> Any:
        self.asked_wakes += 1
        assert announce[0] == "announce_many"
        return self.owed


def _message(queue: str = "q", *, scheduled: timedelta | None = None) -> NewMessage:
    if scheduled is None:
        return NewMessage(queue, 0, "pending", None, "{}", None, None, None)
    return NewMessage(queue, 0, "scheduled", DUE + scheduled, "{}", None, None, None)


MANY = [_message("a"), _message("b"), _message("a"), _message("c", scheduled=timedelta(hours=2))]
MANY.append(_message("a", scheduled=timedelta(hours=1)))


def test_own_autocommit_session_announces_right_behind_the_insert() -> None:
    executor = _Recording(alone=True)
    store = Store.on(executor)
    assert store.publish(_message()) == 1
    assert store.publish_many(MANY) == [2, 3, 4, 5, 6]
    assert executor.ran == [
        ("then", "insert_noting", "announce"),
        ("then", "insert_many", "announce_many"),
    ]
    # announce_many: each queue with a pending message once, in order; the earliest due time.
    owed = executor.params[1]
    assert owed["queues"] == ["a", "b"] and owed["run_at"] == DUE + timedelta(hours=1)


def test_inside_a_transaction_the_insert_notifies_itself() -> None:
    executor = _Recording(alone=False)
    store = Store.on(executor)
    store.publish(_message())
    store.publish_many(MANY)
    assert executor.ran == [("direct", "publish"), ("direct", "publish_many")]


def test_a_multi_statement_publish_many_notifies_inside_its_transaction() -> None:
    executor = _Recording(alone=True)
    store = Store.on(executor)
    ids = store.publish_many([_message()] * (PUBLISH_MANY_CHUNK + 1))
    assert len(ids) == PUBLISH_MANY_CHUNK + 1
    assert executor.ran == [("direct", "publish_many"), ("direct", "publish")]


def test_with_an_after_commit_hook_the_insert_is_quiet_and_owes_its_notify() -> None:
    executor = _Recording(alone=True, hook=True)
    store = Store.on(executor)
    store.publish(_message("x"))
    store.publish_many(MANY)
    assert executor.ran == [("direct", "insert_message"), ("direct", "insert_many")]
    assert executor.owed is not None
    assert executor.owed.added == [("x", "pending", None)] + [
        (m.queue, m.status, m.run_at) for m in MANY
    ]
    # the single message's id and slot, for the notification that names it
    assert executor.owed.named == [(1, 3)] + [None] * len(MANY)


@pytest.mark.parametrize("hook", [True, False])
def test_notify_after_commit_off_keeps_the_notify_in_the_insert(hook: bool) -> None:
    executor = _Recording(alone=True, hook=hook)
    store = Store.on(executor, notify_after_commit=False)
    store.publish(_message())
    store.publish_many(MANY)
    assert executor.ran == [("direct", "publish"), ("direct", "publish_many")]
    assert executor.asked_wakes == 0


def test_an_executor_without_a_pipeline_streams_as_publish_many() -> None:
    executor = _Recording(alone=True)
    store = Store.on(executor)
    assert store.publish_stream(iter(MANY)) == [1, 2, 3, 4, 5]
    assert executor.ran == [("then", "insert_many", "announce_many")]
