"""A durable publish sends its NOTIFY in a transaction of its own, after the insert's.

PostgreSQL takes one lock for the whole cluster when a transaction that notified commits, and
holds it until that commit is flushed and, under synchronous replication, confirmed by a
standby. A publish that notified inside its insert's transaction therefore let only one durable
publish in the cluster commit at a time. These tests make a commit wait for a standby that never
comes (``synchronous_standby_names``) on a private server, and look at who else can notify
meanwhile; they also pin what the split costs (two transaction ids per publish) and what it
keeps (a publish inside a transaction still notifies at that transaction's commit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from celery import Celery

import kombu_pgskip
from kombu_pgskip.bulk import apply_many_in
from kombu_pgskip.envelope import to_row
from kombu_pgskip.migrate import migrate
from kombu_pgskip.publish import apply_async_in
from kombu_pgskip.store import NewMessage, Store, notify_channel, scheduled_channel
from kombu_pgskip.testing.embedded import EmbeddedPostgres, find_bindir
from tests.helpers import plain_notes, woken
from tests.publish_support import Rollback, django_database, make_app


def _row(queue: str = "q", task_id: str = "id-1") -> NewMessage:
    message = {
        "body": json.dumps({"x": 1}),
        "headers": {"task": "t", "id": task_id},
        "properties": {"priority": 0, "delivery_info": {}},
    }
    return to_row(queue, message, eta_threshold=60, max_message_size=10**6)


def _listener(url: str, *, scheduled: bool = False) -> psycopg.Connection[Any]:
    """A session listening on the queues' channel (and the scheduled one) of schema pgskip."""
    listener = psycopg.connect(url, autocommit=True)
    listener.execute(f'LISTEN "{notify_channel("pgskip")}"')
    if scheduled:
        listener.execute(f'LISTEN "{scheduled_channel("pgskip")}"')
    return listener


def _woken_once_each(
    listener: psycopg.Connection[Any],
    queues: list[str],
    started: float,
    counts: list[tuple[str, int]],
) -> None:
    """After a commit: each of ``queues`` woken once, in that order, one announcement of the
    earliest due time (an hour after ``started``), nothing more; ``counts`` jobs per queue."""
    notes = plain_notes(listener, len(queues) + 1)
    notes += plain_notes(listener, 100, timeout=0.5)  # and nothing more
    heard = [n.payload for n in notes if n.channel == notify_channel("pgskip")]
    assert heard == queues
    due = [float(n.payload) for n in notes if n.channel == scheduled_channel("pgskip")]
    assert len(due) == 1 and started + 3600 - 5 < due[0] < time.time() + 3600 + 5
    rows = listener.execute(
        "SELECT queue, count(*) FROM pgskip.jobs GROUP BY queue ORDER BY queue"
    ).fetchall()
    assert rows == counts


@pytest.fixture(scope="module")
def private_url() -> Iterator[str]:
    """A server of this module's own: its commits are made to wait for a standby, and its
    transaction ids are counted, which other tests' sessions must not disturb."""
    try:
        find_bindir()
    except RuntimeError as exc:
        pytest.fail(f"these tests start a PostgreSQL server of their own: {exc}")
    with EmbeddedPostgres(fsync=False, pg_cron=False) as pg:
        url = pg.dsn()
        migrate(url)
        yield url


#: probe commits left waiting for the standby by _require_standby, let go when it is lifted
_probes: list[threading.Thread] = []


def _require_standby(url: str, required: bool, *sessions: psycopg.Connection[Any]) -> None:
    """Make commits wait for a standby named "nobody" (or stop that), and wait until the
    reload reached ``sessions`` (each backend reads the new setting at its next command).

    A backend's own setting is not enough: whether commits wait is a flag in shared memory
    that the checkpointer sets once it has read the new configuration. So, when requiring,
    probe commits (a write from a session of their own) are made until one waits; it stays
    waiting until the requirement is lifted."""
    with psycopg.connect(url, autocommit=True) as conn:
        if required:
            conn.execute("CREATE TABLE IF NOT EXISTS standby_probe (at timestamptz)")
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
        else:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
        conn.execute("SELECT pg_reload_conf()")
        want = "nobody" if required else ""
        deadline = time.monotonic() + 10
        for session in (conn, *sessions):
            while session.execute("SHOW synchronous_standby_names").fetchone() != (want,):
                assert time.monotonic() < deadline, "the reload did not take effect"
                time.sleep(0.05)
        if not required:
            for probe in _probes:
                probe.join(10)
            _probes.clear()
            return
        while True:
            probe_conn = psycopg.connect(url, autocommit=True)
            pid = probe_conn.info.backend_pid

            def write(c: psycopg.Connection[Any] = probe_conn) -> None:
                with c:
                    c.execute("INSERT INTO standby_probe VALUES (now())")

            probe = threading.Thread(target=write, daemon=True)
            probe.start()
            waits = deadline - time.monotonic()
            while probe.is_alive() and time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                if row == ("SyncRep",):
                    _probes.append(probe)
                    return
                time.sleep(0.02)
            probe.join(10)
            assert waits > 0 and time.monotonic() < deadline, "commits never waited for it"


def _wait_for_standby_wait(url: str, pid: int) -> None:
    """Until backend ``pid`` waits for the standby's confirmation of its commit."""
    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + 10
        while True:
            event = conn.execute(
                "SELECT wait_event, state, query FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if event is not None and event[0] == "SyncRep":
                return
            assert time.monotonic() < deadline, f"backend {pid} never waited for a standby: {event}"
            time.sleep(0.02)


def _while_a_commit_waits_for_the_standby(
    url: str,
    commit: Callable[[], Any],
    pid: int,
    *,
    others_blocked: bool,
    sessions: Sequence[psycopg.Connection[Any]] = (),
) -> None:
    """Run ``commit`` in a thread while commits wait for a standby that never comes; once
    backend ``pid`` waits for it, another session notifies, and goes through or
    (``others_blocked``) waits for the NOTIFY lock; then the commit is let go."""
    thread = threading.Thread(target=commit)
    _require_standby(url, True, *sessions)
    try:
        thread.start()
        _wait_for_standby_wait(url, pid)
        _another_session_notifies(url, blocked=others_blocked)
    finally:
        _require_standby(url, False)
        thread.join(10)
    assert not thread.is_alive()


def _another_session_notifies(url: str, *, blocked: bool) -> None:
    """A NOTIFY from a new session goes through, or (``blocked``) waits for the NOTIFY lock
    until lock_timeout turns the wait into an error."""
    with psycopg.connect(url, autocommit=True, options="-c lock_timeout=2000") as other:
        if blocked:
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("NOTIFY elsewhere")
        else:
            other.execute("NOTIFY elsewhere")


@pytest.mark.parametrize("after_commit", [True, False], ids=["after-commit", "in-transaction"])
def test_a_publish_waiting_for_its_commit_lets_others_notify(
    private_url: str, after_commit: bool
) -> None:
    store = Store(private_url, notify_after_commit=after_commit)
    listener = _listener(private_url)
    store.publish(_row("warm"))  # connected and prepared before commits have to wait
    assert woken(listener, 1) == ["warm"]
    published: list[Any] = []
    try:
        # Another session notifies (as another publisher's announcement would) while the
        # publish waits for the standby.
        _while_a_commit_waits_for_the_standby(
            private_url,
            lambda: published.append(store.publish(_row("slow"))),
            store.conn.info.backend_pid,
            others_blocked=not after_commit,
            sessions=[store.conn],
        )
        assert len(published) == 1 and published[0] > 0
        # The publish still wakes the queue's consumers once its row is committed.
        assert woken(listener, 1) == ["slow"]
    finally:
        listener.close()
        store.close()


@pytest.mark.parametrize(("after_commit", "per_publish"), [(True, 2), (False, 1)])
def test_transaction_ids_per_publish(
    private_url: str, after_commit: bool, per_publish: int
) -> None:
    store = Store(private_url, notify_after_commit=after_commit)
    try:
        store.publish(_row())
        (before,) = store.conn.execute("SELECT txid_current()").fetchone() or (0,)
        for _ in range(10):
            store.publish(_row())
        (after,) = store.conn.execute("SELECT txid_current()").fetchone() or (0,)
        # The ids between the two txid_current() calls: 10 publishes.
        assert after - before - 1 == 10 * per_publish
    finally:
        store.close()


@pytest.mark.parametrize("after_commit", [True, False], ids=["after-commit", "in-transaction"])
def test_a_publish_many_waiting_for_its_commit_lets_others_notify(
    private_url: str, after_commit: bool
) -> None:
    """One statement's worth of messages follows the rule of a single publish: with
    ``notify_after_commit``, its NOTIFYs go in a transaction of their own right behind the
    insert's (two transaction ids), so its commit does not hold the NOTIFY lock."""
    store = Store(private_url, notify_after_commit=after_commit)
    listener = _listener(private_url)
    store.publish_many([_row("warm")])
    assert woken(listener, 1) == ["warm"]
    published: list[Any] = []
    try:
        (before,) = store.conn.execute("SELECT txid_current()").fetchone() or (0,)
        store.publish_many([_row("warm"), _row("warm")])
        (after,) = store.conn.execute("SELECT txid_current()").fetchone() or (0,)
        assert after - before - 1 == (2 if after_commit else 1)
        assert woken(listener, 1) == ["warm"]
        _while_a_commit_waits_for_the_standby(
            private_url,
            lambda: published.append(
                store.publish_many([_row("slow-a"), _row("slow-b"), _row("slow-a")])
            ),
            store.conn.info.backend_pid,
            others_blocked=not after_commit,
            sessions=[store.conn],
        )
        assert len(published) == 1 and len(published[0]) == 3
        heard = woken(listener, 2)
        assert sorted(heard) == ["slow-a", "slow-b"]
    finally:
        listener.close()
        store.close()


def test_a_publish_inside_a_transaction_notifies_at_its_commit(db_url: str) -> None:
    store = Store(db_url)
    listener = _listener(db_url)
    try:
        with store.conn.transaction():
            row_id = store.publish(_row("in-tx"))
            assert list(listener.notifies(timeout=0.3)) == []
        assert woken(listener, 1) == ["in-tx"]
        with store.conn.transaction():
            store.publish(_row("rolled-back"))
            raise psycopg.Rollback()
        assert list(listener.notifies(timeout=0.3)) == []
        count = store.conn.execute(
            "SELECT count(*) FROM pgskip.jobs WHERE queue = 'rolled-back'"
        ).fetchone()
        assert row_id > 0 and count == (0,)
    finally:
        listener.close()
        store.close()


def test_a_failed_insert_leaves_the_connection_usable(db_url: str) -> None:
    """The insert fails on the server (its payload is not JSON) while its announcement, the
    next transaction in the same round trip, runs anyway: the error is raised, nothing is
    written, and the connection serves the next publish."""
    store = Store(db_url)
    try:
        good = _row(task_id="good")
        store.publish(good)
        bad = dataclasses.replace(good, payload="{not json", task_id="bad")
        with pytest.raises(psycopg.errors.InvalidTextRepresentation, match="json"):
            store.publish(bad)
        assert store.publish(_row(task_id="after")) > 0
        ids = store.conn.execute("SELECT task_id FROM pgskip.jobs ORDER BY id").fetchall()
        assert ids == [("good",), ("after",)]
    finally:
        store.close()


def test_threads_sharing_a_store_can_publish_and_query_at_once(db_url: str) -> None:
    """The publish's pipeline holds the connection's lock from the first statement sent to
    the last reply read, so another thread's statements never land inside it."""
    store = Store(db_url)
    errors: list[BaseException] = []

    def publisher() -> None:
        try:
            for _ in range(200):
                store.publish(_row("shared"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                store.size("shared")
                store.route("no-such-exchange", "k")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publisher), threading.Thread(target=reader)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert store.size("shared") == 200
    finally:
        store.close()


def test_a_failed_announcement_costs_only_its_wake_up(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The announcement's prepared statement is deallocated behind the store's back: that
    publish's NOTIFY fails, which is logged and not raised (the message is committed; raising
    would make Celery publish it again), and the next publish prepares it again."""
    store = Store(db_url)
    listener = _listener(db_url)
    try:
        store.publish(_row("first"))
        store.conn.execute("DEALLOCATE pgskip_announce")
        with caplog.at_level("WARNING", logger="kombu_pgskip.store"):
            store.publish(_row("unannounced"))
        assert any("NOTIFY failed" in r.getMessage() for r in caplog.records)
        store.publish(_row("third"))
        # The insert's statement, this time: the first try fails and is sent again; the
        # failed try's announcement ran anyway (a wake-up too many, which costs one fetch).
        store.conn.execute("DEALLOCATE pgskip_insert_noting")
        store.publish(_row("fourth"))
        heard = woken(listener, 4)
        assert heard == ["first", "third", "fourth", "fourth"]
        rows = store.conn.execute("SELECT queue FROM pgskip.jobs ORDER BY id").fetchall()
        assert rows == [("first",), ("unannounced",), ("third",), ("fourth",)]
    finally:
        listener.close()
        store.close()


# -- apply_async_in on Django: the NOTIFY after the caller's commit -----------------------------


class _DjangoEnqueuer(threading.Thread):
    """Django's connections are per thread: this thread owns one on ``url`` and runs
    ``apply_async_in`` transactions on it when asked (``run_transaction``)."""

    def __init__(self, url: str, app: Celery) -> None:
        super().__init__(daemon=True)
        self.url, self.app = url, app
        self.jobs: queue.Queue[tuple[str, bool, bool] | None] = queue.Queue()
        self.done: queue.Queue[BaseException | None] = queue.Queue()
        self.backend_pid = 0

    def run(self) -> None:
        from django.db import connections, transaction

        with django_database(self.url) as alias:
            conn = connections[alias]
            with conn.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                self.backend_pid = cur.fetchone()[0]
            self.done.put(None)
            while (job := self.jobs.get()) is not None:
                queue_name, wait_for_standby, many = job
                try:
                    if wait_for_standby:  # the reload reached this session (read per command)
                        deadline = time.monotonic() + 10
                        while True:
                            with conn.cursor() as cur:
                                cur.execute("SHOW synchronous_standby_names")
                                if cur.fetchone() == ("nobody",):
                                    break
                            assert time.monotonic() < deadline, "the reload did not take effect"
                            time.sleep(0.05)
                    task = self.app.tasks["txn.add"]
                    with transaction.atomic(using=alias):
                        if many:
                            apply_many_in(conn, [task.s(1, 2), task.s(3, 4)], queue=queue_name)
                        else:
                            apply_async_in(conn, task, (1, 2), queue=queue_name)
                    self.done.put(None)
                except BaseException as exc:  # reported to the test
                    self.done.put(exc)

    def run_transaction(
        self, queue_name: str, *, wait_for_standby: bool = False, many: bool = False
    ) -> None:
        self.jobs.put((queue_name, wait_for_standby, many))

    def finished(self, timeout: float = 30) -> None:
        error = self.done.get(timeout=timeout)
        if error is not None:
            raise error


@pytest.mark.parametrize("many", [False, True], ids=["apply_async_in", "apply_many_in"])
@pytest.mark.parametrize("after_commit", [True, False], ids=["after-commit", "in-transaction"])
def test_a_django_transaction_that_enqueues_lets_others_notify_while_it_commits(
    private_url: str, after_commit: bool, many: bool
) -> None:
    """With Django's after-commit hook, a transaction that enqueues with ``apply_async_in``
    or ``apply_many_in`` no longer holds PostgreSQL's NOTIFY lock through its commit (here
    held open by a standby that never confirms); with ``notify_after_commit`` off it does, as
    before."""
    app = make_app(private_url, broker_transport_options={"notify_after_commit": after_commit})
    listener = _listener(private_url)
    enqueuer = _DjangoEnqueuer(private_url, app)
    enqueuer.start()
    try:
        enqueuer.finished()  # connected
        enqueuer.run_transaction("django-warm")  # schema checked, before commits wait
        enqueuer.finished()
        assert woken(listener, 1) == ["django-warm"]
        _require_standby(private_url, True)
        try:
            enqueuer.run_transaction("django-slow", wait_for_standby=True, many=many)
            _wait_for_standby_wait(private_url, enqueuer.backend_pid)
            _another_session_notifies(private_url, blocked=not after_commit)
        finally:
            _require_standby(private_url, False)
        enqueuer.finished()
        # Either way the job's consumers are woken once it is committed.
        assert woken(listener, 1) == ["django-slow"]
    finally:
        enqueuer.jobs.put(None)
        enqueuer.join(30)
        listener.close()
        app.close()


def test_a_django_rollback_or_rolled_back_savepoint_wakes_nobody(db_url: str) -> None:
    from django.db import connections, transaction

    app = make_app(db_url)
    task = app.tasks["txn.add"]
    listener = _listener(db_url)
    try:
        with django_database(db_url) as alias:
            conn = connections[alias]
            with transaction.atomic(using=alias):
                apply_async_in(conn, task, (1, 2), queue="kept")
                with contextlib.suppress(Rollback), transaction.atomic(using=alias):
                    apply_async_in(conn, task, (1, 2), queue="savepoint-rolled-back")
                    raise Rollback
                apply_async_in(conn, task, (1, 2), queue="kept-too")
                # Nothing before the commit.
                assert list(listener.notifies(timeout=0.3)) == []
            # The announcements ran on Django's connection and left nothing prepared there.
            with conn.cursor() as cur:
                cur.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'pgskip%%'")
                assert cur.fetchall() == []
            with contextlib.suppress(Rollback), transaction.atomic(using=alias):
                apply_async_in(conn, task, (1, 2), queue="rolled-back")
                raise Rollback
        heard = woken(listener, 2)
        assert heard == ["kept", "kept-too"]
        assert list(listener.notifies(timeout=0.3)) == []
        queues = listener.execute("SELECT queue FROM pgskip.jobs ORDER BY id").fetchall()
        assert queues == [("kept",), ("kept-too",)]
    finally:
        listener.close()
        app.close()


def test_a_django_transaction_wakes_each_queue_once_after_its_commit(db_url: str) -> None:
    """Every job of one ``atomic()`` block owes its queue a NOTIFY; they go in one statement
    after the commit, one per queue however many jobs it got, plus the earliest due time of
    the scheduled ones. What a savepoint wrote is announced only if the savepoint was kept,
    whether or not an outer level wrote to the same queue."""
    from django.db import connections, transaction

    app = make_app(db_url)
    task = app.tasks["txn.add"]
    listener = _listener(db_url, scheduled=True)
    try:
        with django_database(db_url) as alias:
            conn = connections[alias]
            started = time.time()
            with transaction.atomic(using=alias):
                for n in range(3):
                    apply_async_in(conn, task, (n, n), queue="a")
                apply_many_in(conn, [task.s(1, 1), task.s(2, 2)], queue="b")
                apply_async_in(conn, task, (1, 1), queue="b", countdown=7200)
                apply_async_in(conn, task, (1, 1), queue="a", countdown=3600)
                with contextlib.suppress(Rollback), transaction.atomic(using=alias):
                    apply_async_in(conn, task, (1, 2), queue="a")  # a is woken anyway
                    apply_many_in(conn, [task.s(1, 1)], queue="gone")
                    apply_async_in(conn, task, (1, 1), queue="gone", countdown=60)
                    raise Rollback
                with transaction.atomic(using=alias):  # a savepoint, released
                    apply_async_in(conn, task, (1, 2), queue="c")
                apply_many_in(conn, [task.s(1, 1)], queue="a")
                assert list(listener.notifies(timeout=0.3)) == []
        _woken_once_each(listener, ["a", "b", "c"], started, [("a", 5), ("b", 3), ("c", 1)])
    finally:
        listener.close()
        app.close()


def test_a_failed_notify_after_a_django_commit_is_logged_not_raised(
    private_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The job is committed when the NOTIFY after it fails (here: another session's commit
    holds the NOTIFY lock past this session's lock_timeout): a warning, no exception out of
    the caller's ``atomic()``, and the job stays for the workers' next poll."""
    from django.db import connections, transaction

    app = make_app(private_url)
    blocker = psycopg.connect(private_url, autocommit=True)
    blocker.execute("CREATE TABLE IF NOT EXISTS written (x int)")

    def hold() -> None:
        # A transaction that writes and notifies: its commit waits for the standby while it
        # holds the NOTIFY lock (one that only notifies writes no WAL and would not wait).
        with blocker.transaction():
            blocker.execute("INSERT INTO written VALUES (1)")
            blocker.execute("NOTIFY held")

    holding = threading.Thread(target=hold, daemon=True)
    try:
        with django_database(private_url) as alias:
            conn = connections[alias]
            with conn.cursor() as cur:
                # This session's commits do not wait for the standby that the blocker's does.
                cur.execute("SET synchronous_commit = local")
                cur.execute("SET lock_timeout = '300ms'")
            _require_standby(private_url, True, blocker)
            try:
                holding.start()  # its commit waits for the standby, holding the NOTIFY lock
                _wait_for_standby_wait(private_url, blocker.info.backend_pid)
                with (
                    caplog.at_level("WARNING", logger="kombu_pgskip.publish"),
                    transaction.atomic(using=alias),
                ):
                    result = apply_async_in(conn, app.tasks["txn.add"], (1, 2), queue="unwoken")
            finally:
                _require_standby(private_url, False)
                holding.join(10)
        assert any(
            r.getMessage().startswith("the NOTIFY after the caller's commit failed")
            and getattr(r, "action", None) == "announce_failed"
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        found = blocker.execute(
            "SELECT queue FROM pgskip.jobs WHERE task_id = %s", (result.id,)
        ).fetchall()
        assert found == [("unwoken",)]
    finally:
        blocker.close()
        app.close()


# -- kombu_pgskip.transaction on psycopg 3: the NOTIFY after the block's commit ----------------


@pytest.mark.parametrize(
    "ours", [True, False], ids=["kombu_pgskip.transaction", "conn.transaction"]
)
def test_a_psycopg_transaction_that_enqueues_lets_others_notify_while_it_commits(
    private_url: str, ours: bool
) -> None:
    """Enqueued inside ``kombu_pgskip.transaction(conn)``, the job's NOTIFY waits for the
    commit, so a commit held open by a standby that never confirms does not hold PostgreSQL's
    NOTIFY lock; inside a plain ``conn.transaction()`` it does."""
    app = make_app(private_url)
    task = app.tasks["txn.add"]
    listener = _listener(private_url)
    conn = psycopg.connect(private_url, autocommit=True)
    errors: list[BaseException] = []

    def enqueue(queue_name: str) -> None:
        try:
            with kombu_pgskip.transaction(conn) if ours else conn.transaction():
                apply_async_in(conn, task, (1, 2), queue=queue_name)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        enqueue("pg-warm")  # schema checked before commits have to wait
        assert woken(listener, 1) == ["pg-warm"]
        _while_a_commit_waits_for_the_standby(
            private_url,
            lambda: enqueue("pg-slow"),
            conn.info.backend_pid,
            others_blocked=not ours,
            sessions=[conn],
        )
        assert errors == []
        # Either way the job's consumers are woken once it is committed.
        assert woken(listener, 1) == ["pg-slow"]
    finally:
        listener.close()
        conn.close()
        app.close()


@dataclasses.dataclass
class _Psycopg:
    """A psycopg connection (not in autocommit mode: the NOTIFY after the commit must not leave
    a transaction open on it), a task to enqueue, and a session listening to both channels."""

    conn: psycopg.Connection[Any]
    task: Any
    listener: psycopg.Connection[Any]


@pytest.fixture
def on_psycopg(db_url: str) -> Iterator[_Psycopg]:
    app = make_app(db_url)
    listener = _listener(db_url, scheduled=True)
    conn = psycopg.connect(db_url)
    try:
        yield _Psycopg(conn, app.tasks["txn.add"], listener)
    finally:
        listener.close()
        conn.close()
        app.close()


def test_kombu_pgskip_transaction_wakes_each_queue_once_for_what_it_kept(
    on_psycopg: _Psycopg,
) -> None:
    """After the commit, one NOTIFY per queue however many jobs it got, and one for the
    earliest due time; what a nested block rolled back is not announced. A plain
    ``conn.transaction()`` inside keeps its jobs' NOTIFY in the transaction (it may roll back
    without our knowing), so its kept job wakes its queue at the commit itself."""
    conn, task, listener = on_psycopg.conn, on_psycopg.task, on_psycopg.listener
    started = time.time()
    with kombu_pgskip.transaction(conn):
        for n in range(3):
            apply_async_in(conn, task, (n, n), queue="a")
        apply_many_in(conn, [task.s(1, 1), task.s(2, 2)], queue="b")
        apply_async_in(conn, task, (1, 1), queue="b", countdown=7200)
        apply_async_in(conn, task, (1, 1), queue="a", countdown=3600)
        with contextlib.suppress(Rollback), kombu_pgskip.transaction(conn):
            apply_async_in(conn, task, (1, 2), queue="gone")
            apply_async_in(conn, task, (1, 2), queue="a")  # a is woken anyway
            raise Rollback
        with kombu_pgskip.transaction(conn):  # a savepoint, released
            apply_async_in(conn, task, (1, 2), queue="c")
            apply_many_in(conn, [task.s(1, 1)], queue="a")
        with contextlib.suppress(Rollback), conn.transaction():
            apply_async_in(conn, task, (1, 2), queue="plain-gone")
            raise Rollback
        with conn.transaction():
            apply_async_in(conn, task, (1, 2), queue="plain-kept")
        assert list(listener.notifies(timeout=0.3)) == []
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    # One statement after the commit: the released block's queues merged into the outer's.
    _woken_once_each(
        listener,
        ["plain-kept", "a", "b", "c"],
        started,
        [("a", 5), ("b", 3), ("c", 1), ("plain-kept", 1)],
    )
    # Nothing of ours is left prepared in the caller's session.
    prepared = conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pgskip%%'"
    ).fetchall()
    assert prepared == []


def test_kombu_pgskip_transaction_rolled_back_writes_and_wakes_nothing(
    on_psycopg: _Psycopg,
) -> None:
    conn, task, listener = on_psycopg.conn, on_psycopg.task, on_psycopg.listener
    with pytest.raises(ValueError, match="declined"), kombu_pgskip.transaction(conn):
        apply_async_in(conn, task, (1, 2), queue="raised")
        raise ValueError("payment declined")
    with kombu_pgskip.transaction(conn):
        apply_async_in(conn, task, (1, 2), queue="psycopg-rollback")
        raise psycopg.Rollback()
    with kombu_pgskip.transaction(conn, force_rollback=True):
        apply_async_in(conn, task, (1, 2), queue="forced")
    assert list(listener.notifies(timeout=0.5)) == []
    assert listener.execute("SELECT count(*) FROM pgskip.jobs").fetchone() == (0,)


def test_kombu_pgskip_transaction_inside_an_open_transaction_notifies_at_its_commit(
    on_psycopg: _Psycopg,
) -> None:
    """Entered while the connection is already in a transaction, the block is a savepoint
    whose commit is the caller's later ``conn.commit()``: the NOTIFY stays inside and wakes the
    queue then."""
    conn, listener = on_psycopg.conn, on_psycopg.listener
    conn.execute("SELECT 1")  # psycopg opened a transaction
    with kombu_pgskip.transaction(conn):
        apply_async_in(conn, on_psycopg.task, (1, 2), queue="later")
    assert list(listener.notifies(timeout=0.3)) == []
    conn.commit()
    assert woken(listener, 1) == ["later"]


def test_kombu_pgskip_transaction_refuses_what_is_not_a_psycopg_connection() -> None:
    from kombu_pgskip.exceptions import NotAConnection

    not_a_connection = object()
    with (
        pytest.raises(NotAConnection, match=r"psycopg 3 connection or cursor, got builtins"),
        kombu_pgskip.transaction(not_a_connection),
    ):
        pass


# -- apply_async_in on a SQLAlchemy Session: the NOTIFY after the session's commit ------------


def _engine(url: str, dbapi: str, **kwargs: Any) -> Any:
    import sqlalchemy as sa

    return sa.create_engine(url.replace("postgresql://", f"postgresql+{dbapi}://", 1), **kwargs)


@pytest.mark.parametrize(
    ("dbapi", "session"),
    [("psycopg", True), ("psycopg2", True), ("psycopg", False)],
    ids=["session-psycopg", "session-psycopg2", "connection"],
)
def test_a_sqlalchemy_transaction_that_enqueues_lets_others_notify_while_it_commits(
    private_url: str, dbapi: str, session: bool
) -> None:
    """Enqueued through a ``Session``, the job's NOTIFY waits for the session's commit, so a
    commit held open by a standby that never confirms does not hold PostgreSQL's NOTIFY
    lock; through a bare ``Connection`` (no after-commit event in Core) it does."""
    from sqlalchemy.orm import Session

    app = make_app(private_url)
    task = app.tasks["txn.add"]
    listener = _listener(private_url)
    engine = _engine(private_url, dbapi, pool_size=1)
    errors: list[BaseException] = []

    def enqueue(queue_name: str) -> None:
        try:
            if session:
                with Session(engine) as s, s.begin():
                    apply_async_in(s, task, (1, 2), queue=queue_name)
            else:
                with engine.begin() as conn:
                    apply_async_in(conn, task, (1, 2), queue=queue_name)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        enqueue("sa-warm")  # schema checked, and the pool's one connection opened
        assert woken(listener, 1) == ["sa-warm"]
        with engine.connect() as probe:
            pid = (
                probe.connection.dbapi_connection.info.backend_pid
                if dbapi == "psycopg"
                else (probe.connection.dbapi_connection.get_backend_pid())
            )
        _while_a_commit_waits_for_the_standby(
            private_url, lambda: enqueue("sa-slow"), pid, others_blocked=not session
        )
        assert errors == []
        assert woken(listener, 1) == ["sa-slow"]
    finally:
        listener.close()
        engine.dispose()
        app.close()


@pytest.mark.parametrize("dbapi", ["psycopg", "psycopg2"])
def test_a_sqlalchemy_session_wakes_each_queue_once_for_what_it_kept(
    db_url: str, dbapi: str
) -> None:
    """After the session's commit, one statement: one NOTIFY per queue, and one for the
    earliest due time. A savepoint rolled back (``begin_nested()``) takes its wake-ups with
    its jobs; one released hands them to the level around it. The connection goes back to
    the pool with no transaction open, and a rolled-back session wakes nobody."""
    from sqlalchemy.orm import Session

    app = make_app(db_url)
    task = app.tasks["txn.add"]
    listener = _listener(db_url, scheduled=True)
    engine = _engine(db_url, dbapi, pool_size=1)
    started = time.time()
    try:
        with Session(engine) as s:
            with s.begin():
                for n in range(3):
                    apply_async_in(s, task, (n, n), queue="a")
                apply_many_in(s, [task.s(1, 1), task.s(2, 2)], queue="b")
                apply_async_in(s, task, (1, 1), queue="a", countdown=3600)
                with s.begin_nested():
                    apply_async_in(s, task, (1, 2), queue="c")
                    with contextlib.suppress(Rollback), s.begin_nested():
                        apply_async_in(s, task, (1, 2), queue="gone")
                        raise Rollback
                    with s.begin_nested():
                        apply_async_in(s, task, (1, 2), queue="d", countdown=7200)
                assert list(listener.notifies(timeout=0.3)) == []
            with contextlib.suppress(Rollback), s.begin():
                apply_async_in(s, task, (1, 2), queue="rolled-back")
                raise Rollback
        _woken_once_each(
            listener, ["a", "b", "c"], started, [("a", 4), ("b", 2), ("c", 1), ("d", 1)]
        )
        # The pool's connection: nothing left open on it by the NOTIFY after the commit.
        states = listener.execute(
            "SELECT state FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = '' AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
        ).fetchall()
        assert states == [("idle",)]
    finally:
        listener.close()
        engine.dispose()
        app.close()


@pytest.mark.parametrize("dbapi", ["psycopg", "psycopg2"])
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_session_joined_to_the_caller_s_transaction_notifies_at_that_commit(
    db_url: str, dbapi: str, outcome: str
) -> None:
    """A ``Session`` bound to a connection whose transaction the caller began (as test
    fixtures do): the session's commit releases a savepoint only, and the NOTIFY sent then
    runs inside the caller's transaction, so it wakes the queue at that transaction's commit
    and never if it rolls back."""
    from sqlalchemy.orm import Session

    app = make_app(db_url)
    task = app.tasks["txn.add"]
    listener = _listener(db_url)
    engine = _engine(db_url, dbapi)
    try:
        with engine.connect() as conn:
            outer = conn.begin()
            with Session(bind=conn, join_transaction_mode="create_savepoint") as s, s.begin():
                apply_async_in(s, task, (1, 2), queue="joined")
            assert list(listener.notifies(timeout=0.3)) == []
            if outcome == "commit":
                outer.commit()
            else:
                outer.rollback()
        heard = woken(listener, 1)
        assert heard == (["joined"] if outcome == "commit" else [])
        count = listener.execute("SELECT count(*) FROM pgskip.jobs").fetchone()
        assert count == ((1,) if outcome == "commit" else (0,))
    finally:
        listener.close()
        engine.dispose()
        app.close()


def test_a_savepoint_the_session_does_not_know_keeps_its_notify_inside(db_url: str) -> None:
    """A savepoint opened on the session's connection itself, which the session does not
    track: what is enqueued inside it notifies inside the transaction, so rolling that
    savepoint back drops the wake-up with the job."""
    from sqlalchemy.orm import Session

    app = make_app(db_url)
    task = app.tasks["txn.add"]
    listener = _listener(db_url)
    engine = _engine(db_url, "psycopg")
    try:
        with Session(engine) as s, s.begin():
            savepoint = s.connection().begin_nested()
            apply_async_in(s, task, (1, 2), queue="core-savepoint")
            savepoint.rollback()
            apply_async_in(s, task, (1, 2), queue="kept")
        notes = plain_notes(listener, 1)
        notes += plain_notes(listener, 100, timeout=0.5)
        assert [n.payload for n in notes] == ["kept"]
        assert listener.execute("SELECT queue FROM pgskip.jobs").fetchall() == [("kept",)]
    finally:
        listener.close()
        engine.dispose()
        app.close()
