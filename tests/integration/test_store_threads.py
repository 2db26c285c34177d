"""A ``Store`` shared by threads: one thread's publish never lands in another's transaction.

``publish_many`` (above one chunk) and ``publish_stream`` write in one transaction of several
statements on the store's connection. A single publish from another thread in the meantime
used to run inside that transaction (psycopg's lock is held per statement, not per
transaction): it returned its id before anything was committed, and the other thread's
rollback then took its message away. The store now holds a lock of its own across such a
transaction, so the other thread's publish waits for it to end and commits on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence

import psycopg
import pytest

from kombu_pgskip.envelope import to_row
from kombu_pgskip.store import PUBLISH_MANY_CHUNK, NewMessage, Store

# How long the thread inside the transaction waits for the other thread's publish to return
# before it rolls back. Long enough for a publish to run when nothing holds it back.
HOLD = 1.5


def _row(queue: str, task_id: str) -> NewMessage:
    message = {
        "body": json.dumps({"x": 1}),
        "headers": {"task": "t", "id": task_id},
        "properties": {"priority": 0, "delivery_info": {}},
    }
    return to_row(queue, message, eta_threshold=60, max_message_size=10**6)


class _Publisher(threading.Thread):
    """Publishes one message on ``store`` once ``start_publish`` is set; records when it
    returned, or what it raised."""

    def __init__(self, store: Store, start_publish: threading.Event) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.start_publish = start_publish
        self.returned = threading.Event()
        self.returned_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.start_publish.wait(30)
        try:
            self.store.publish(_row("single", "single"))
            self.returned_at = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc
        self.returned.set()


def _committed(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT queue, count(*) FROM pgskip.jobs GROUP BY queue").fetchall()
    return {str(queue): int(n) for queue, n in rows}


def test_a_publish_from_another_thread_waits_for_a_streamed_transaction(db_url: str) -> None:
    store = Store(db_url)
    inside = threading.Event()
    other = _Publisher(store, inside)
    other.start()

    def messages() -> Iterator[NewMessage]:
        yield _row("streamed", "s-1")
        inside.set()  # the transaction is open: the other thread publishes now
        other.returned.wait(HOLD)
        yield _row("streamed", "s-2")
        raise RuntimeError("the stream fails: everything it wrote rolls back")

    try:
        with pytest.raises(RuntimeError, match="stream fails"):
            store.publish_stream(messages())
        ended = time.monotonic()
        assert other.returned.wait(30)
        assert other.error is None
        assert other.returned_at is not None and other.returned_at >= ended
        assert _committed(db_url) == {"single": 1}
    finally:
        store.close()


class _PausingStore(Store):
    """Pauses after the first chunk of a multi-chunk ``publish_many`` (instrumentation: the
    statements are the real ones)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.inside = threading.Event()
        self.other: _Publisher | None = None

    def _publish_chunk(self, messages: Sequence[NewMessage]) -> list[int]:
        ids = super()._publish_chunk(messages)
        if not self.inside.is_set():
            self.inside.set()
            assert self.other is not None
            self.other.returned.wait(HOLD)
        return ids


def test_a_publish_from_another_thread_waits_for_publish_many(db_url: str) -> None:
    store = _PausingStore(db_url)
    other = store.other = _Publisher(store, store.inside)
    other.start()
    good = [_row("many", f"m-{i}") for i in range(PUBLISH_MANY_CHUNK)]
    bad = dataclasses.replace(good[0], payload="{not json", task_id="bad")
    try:
        # Two chunks in one transaction; the second fails on the server.
        with pytest.raises(psycopg.errors.InvalidTextRepresentation, match="json"):
            store.publish_many([*good, bad])
        ended = time.monotonic()
        assert store.inside.is_set()
        assert other.returned.wait(30)
        assert other.error is None
        assert other.returned_at is not None and other.returned_at >= ended
        assert _committed(db_url) == {"single": 1}
        assert store.size("single") == 1  # the connection serves the next statement
    finally:
        store.close()


def test_a_forked_child_publishes_while_a_parent_thread_held_the_lock(db_url: str) -> None:
    """A process forked while another of its threads was inside a multi-statement transaction
    (so holding the store's lock) gets fresh locks and a connection of its own: its publish
    neither hangs on the parent's lock nor lands in the parent's transaction."""
    store = Store(db_url)
    store.publish(_row("warm", "warm"))  # the parent's connection is open
    inside, release = threading.Event(), threading.Event()

    def messages() -> Iterator[NewMessage]:
        yield _row("streamed", "s-1")
        inside.set()
        release.wait(30)

    parent = threading.Thread(target=lambda: store.publish_stream(messages()), daemon=True)
    parent.start()
    try:
        assert inside.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 if the publish returned
            code = 1
            try:
                store.publish(_row("from-child", "child"))
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the child's publish hung on the lock its parent's thread held")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert _committed(db_url) == {"warm": 1, "from-child": 1}  # the stream is still open
    finally:
        release.set()
        parent.join(30)
        store.close()
    assert _committed(db_url) == {"warm": 1, "from-child": 1, "streamed": 1}
