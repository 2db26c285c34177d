"""Fleet-wide limits of a queue (migration 0025): the limited fetch takes no more than a
queue's limits allow, however many connections race for it; the normal fetch leaves a limited
queue alone; a kombu consumer takes a limited queue's messages as its slots free; `limit`,
`unlimit` and `status` say what they did. Real workers: tests/acceptance/test_limits.py."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from click.testing import CliRunner, Result
from kombu import Connection, Consumer, Message, Queue

from kombu_pgskip import exceptions
from kombu_pgskip.__main__ import main
from kombu_pgskip.envelope import to_row
from kombu_pgskip.store import Store
from tests.helpers import seq_scanned_rows


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.close()


def _publish(
    store: Store, db_url: str, queue: str, n: int = 1, key: str | None = None
) -> list[int]:
    ids = []
    for i in range(n):
        message = {
            "body": json.dumps({"i": i}),
            "headers": {"task": "t", "id": str(uuid.uuid4())},
            "properties": {"priority": 0, "delivery_info": {}},
        }
        ids.append(store.publish(to_row(queue, message, eta_threshold=2, max_message_size=10**6)))
    if key is not None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE pgskip.jobs SET concurrency_key = %s WHERE id = ANY(%s)", (key, ids)
            )
    return ids


def _consumer(store: Store, queues: list[str]) -> uuid.UUID:
    cid = uuid.uuid4()
    store.register_consumer(cid, hostname="test", queues=queues, lease=30)
    return cid


def _running(db_url: str, queue: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pgskip.jobs WHERE queue = %s AND status = 'running'", (queue,)
        ).fetchone()
    return int(row[0]) if row else 0


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def test_a_limited_queue_is_left_to_the_limited_fetch_which_keeps_to_max_running(
    store: Store, db_url: str
) -> None:
    ids = _publish(store, db_url, "reports", 5)
    other = _publish(store, db_url, "emails", 2)
    limit = store.set_limit("reports", max_running=2)
    assert (limit["max_running"], limit["pending"], limit["replaced"]) == (2, 5, False)
    c = _consumer(store, ["reports", "emails"])
    # The normal fetch takes the other queue's messages only.
    assert sorted(r.id for r in store.fetch(["reports", "emails"], 10, c)) == other
    got = store.fetch_limited("reports", 10, c)
    assert [r.id for r in got.rows] == ids[:2]  # in delivery order
    assert (got.limited, got.free, got.tokens, got.more) == (True, 0, None, True)
    again = store.fetch_limited("reports", 10, c)
    assert (again.rows, again.free, again.more) == ([], 0, True)
    # An ack carried by the fetch frees its slot for the same fetch.
    third = store.fetch_limited("reports", 10, c, acks=[got.rows[0].tag])
    assert third.acked == 1 and [r.id for r in third.rows] == [ids[2]]
    # A requeued (or failed) message frees its slot too, and the credit asked for holds.
    store.requeue([got.rows[1].tag], c, max_attempts=5)
    assert len(store.fetch_limited("reports", 1, c).rows) == 1
    assert _running(db_url, "reports") == 2
    # Unlimited: the normal fetch takes the rest; the limited fetch takes nothing.
    assert store.unlimit(["reports", "never"]) == ["reports"]
    gone = store.fetch_limited("reports", 10, c)
    assert (gone.limited, gone.rows, gone.more) == (False, [], False)
    assert len(store.fetch(["reports"], 10, c)) == 2


def test_connections_racing_for_a_limited_queue_never_run_more_than_its_limit(
    db_url: str, store: Store
) -> None:
    _publish(store, db_url, "q", 200)
    store.set_limit("q", max_running=3)
    stores = [Store(db_url) for _ in range(6)]
    high = 0
    errors: list[BaseException] = []
    stop = threading.Event()

    def work(s: Store) -> None:
        c = _consumer(s, ["q"])
        held: list[tuple[int, int]] = []
        try:
            while not stop.is_set():
                got = s.fetch_limited("q", 2, c, acks=held)
                held = [r.tag for r in got.rows]
                if not got.more and not got.rows:
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    with psycopg.connect(db_url, autocommit=True) as watch:
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            row = watch.execute(
                "SELECT count(*) FROM pgskip.jobs WHERE queue = 'q' AND status = 'running'"
            ).fetchone()
            high = max(high, int(row[0]) if row else 0)
    stop.set()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    assert not errors, errors
    assert high == 3
    with psycopg.connect(db_url) as conn:
        done = conn.execute(
            "SELECT count(*) FROM pgskip.jobs WHERE queue = 'q' AND status = 'completed'"
        ).fetchone()
    assert done is not None and done[0] >= 190


def test_a_per_key_limit_runs_at_most_n_of_each_key_and_lets_other_keys_by(
    store: Store, db_url: str
) -> None:
    seven = _publish(store, db_url, "q", 4, key="customer:7")
    eight = _publish(store, db_url, "q", 2, key="customer:8")
    plain = _publish(store, db_url, "q", 1)
    store.set_limit("q", max_running_per_key=1)
    c = _consumer(store, ["q"])
    got = store.fetch_limited("q", 10, c)
    # One of each key, in delivery order, past the waiting messages of customer 7; a message
    # without a key counts against no key.
    assert [r.id for r in got.rows] == [seven[0], eight[0], plain[0]]
    assert got.more
    assert store.fetch_limited("q", 10, c).rows == []
    nxt = store.fetch_limited("q", 10, c, acks=[got.rows[0].tag])
    assert [r.id for r in nxt.rows] == [seven[1]]
    # With a limit on the whole queue as well, both hold.
    store.set_limit("q", max_running=2, max_running_per_key=1)
    assert store.fetch_limited("q", 10, c, acks=[nxt.rows[0].tag]).rows == []
    assert _running(db_url, "q") == 2


def test_the_rate_spends_a_bucket_that_refills_at_the_rate(store: Store, db_url: str) -> None:
    _publish(store, db_url, "q", 30)
    store.set_limit("q", rate=5.0)  # burst 5
    c = _consumer(store, ["q"])
    first = store.fetch_limited("q", 100, c)
    assert len(first.rows) == 5 and first.more and first.tokens is not None
    assert first.tokens < 1 and first.rate == 5.0
    assert store.fetch_limited("q", 100, c).rows == []
    time.sleep(0.45)  # about 2 tokens
    assert len(store.fetch_limited("q", 100, c).rows) == 2
    # The bucket holds at most its burst, however long it idles; an explicit burst.
    store.set_limit("q", rate=100.0, burst=3)
    time.sleep(0.2)
    assert len(store.fetch_limited("q", 100, c).rows) == 3


def test_limits_are_checked_and_celerys_own_queues_refused(store: Store) -> None:
    for name in ("celery@host.celery.pidbox", "celeryev.a1b2"):
        with pytest.raises(exceptions.ConfigurationError, match="remote-control or event"):
            store.set_limit(name, max_running=1)
    with pytest.raises(exceptions.ConfigurationError, match="no limit given"):
        store.set_limit("q")
    with pytest.raises(exceptions.ConfigurationError, match="from 1 to"):
        store.set_limit("q", max_running=0)
    with pytest.raises(exceptions.ConfigurationError, match="give a rate"):
        store.set_limit("q", max_running=1, burst=3)
    assert store.limits() == []


def test_a_paused_limited_queue_takes_nothing(store: Store, db_url: str) -> None:
    _publish(store, db_url, "q", 2)
    store.set_limit("q", max_running=5)
    store.pause(["q"])
    c = _consumer(store, ["q"])
    got = store.fetch_limited("q", 10, c)
    assert (got.limited, got.rows, got.more) == (True, [], False)
    store.resume(["q"])
    assert len(store.fetch_limited("q", 10, c).rows) == 2


def test_a_kombu_consumer_takes_a_limited_queue_as_its_slots_free(
    store: Store, db_url: str
) -> None:
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    store.set_limit("lim", max_running=2)
    received: list[Message] = []
    with Connection(broker) as conn:
        queue = Queue("lim")
        producer = conn.Producer()
        for i in range(5):
            producer.publish({"n": i}, routing_key="lim", declare=[queue])
        transport = conn.transport
        # What the housekeeping thread learns within a renewal, told at once here.
        transport.dispatcher.limits_known({"lim"})
        with Consumer(conn, [queue], callbacks=[lambda body, m: received.append(m)]) as consumer:
            consumer.qos(prefetch_count=10)
            deadline = time.monotonic() + 10
            while len(received) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
            assert len(received) == 2
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.3)
            assert len(received) == 2
            for m in list(received):
                m.ack()
            while len(received) < 4 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
            assert [m.payload["n"] for m in received] == [0, 1, 2, 3]
            assert _running(db_url, "lim") == 2


def test_the_commands_limit_unlimit_and_status(store: Store, db_url: str) -> None:
    _publish(store, db_url, "reports", 2)
    done = _run("limit", "reports", "--max-running", "5", "--rate", "100/m", "--url", db_url)
    assert done.exit_code == 0, done.output
    assert done.stdout == (
        "queue 'reports': limited: at most 5 running, 100/m (burst 2), across every worker "
        "(0 running messages, 2 pending messages; `pgskip unlimit reports`)\n"
    )
    done = _run("limit", "reports", "--per-key", "1", "--url", db_url)
    assert done.stdout.startswith("queue 'reports': limits replaced: 1 running per key, ")
    status = _run("status", "--url", db_url)
    assert status.exit_code == 0, status.output
    (line,) = [x for x in status.stdout.splitlines() if x.startswith("limited: ")]
    assert line.startswith("limited: 'reports': 1 running per key since ")
    assert line.endswith("(0 running messages, 2 pending messages; `pgskip unlimit reports`)")
    got = json.loads(_run("status", "--url", db_url, "--json").stdout)
    assert {q["queue"]: q["limited"] for q in got["queues"]} == {"reports": True}
    (limit,) = got["limits"]
    assert (limit["queue"], limit["max_running"], limit["max_running_per_key"]) == (
        "reports",
        None,
        1,
    )
    assert (limit["rate"], limit["burst"], limit["pending"]) == (None, None, 2)
    for args, message in (
        (["--rate", "fast"], "write it as Celery's rate_limit does"),
        (["--rate", "0/s"], "a rate must be above 0"),
        (["--burst", "3", "--max-running", "1"], "give a rate"),
    ):
        done = _run("limit", "reports", *args, "--url", db_url)
        assert done.exit_code == 1 and message in done.stderr, done.output
    done = _run("limit", "reports", "--url", db_url)
    assert done.exit_code == 2 and "give --max-running, --per-key or --rate" in done.output
    done = _run("limit", "reports", "--max-running", "0", "--url", db_url)
    assert done.exit_code == 2
    done = _run("limit", "celery@host.celery.pidbox", "--max-running", "1", "--url", db_url)
    assert done.exit_code == 1 and "remote-control or event queues" in done.stderr
    done = _run("unlimit", "--url", db_url)
    assert done.exit_code == 2 and "name the queues to unlimit, or pass --all" in done.output
    done = _run("unlimit", "reports", "emails", "--url", db_url)
    assert done.stdout.splitlines() == [
        "queue 'emails': was not limited",
        "queue 'reports': unlimited",
    ]
    assert _run("unlimit", "--all", "--url", db_url).stdout == "no queue is limited\n"


def test_the_limited_fetch_reads_jobs_through_its_indexes_only(store: Store, db_url: str) -> None:
    """The candidates through the dequeue index, the running messages through the index of
    running rows, the picked ones by id: no scan of the whole table, however long it is."""
    from psycopg import sql

    from kombu_pgskip.sql import queries_for

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgskip.jobs (queue, payload, concurrency_key)"
            " SELECT 'q' || (g % 5), '{}', 'k' || (g % 50) FROM generate_series(1, 20000) AS g"
        )
        conn.execute("ANALYZE pgskip.jobs")
    store.set_limit("q1", max_running=100, max_running_per_key=2, rate=1000.0)
    c = _consumer(store, ["q1"])
    assert len(store.fetch_limited("q1", 10, c).rows) == 10
    query = sql.SQL("EXPLAIN (COSTS OFF) ") + queries_for("pgskip")["fetch_limited"]
    with psycopg.connect(db_url) as conn:
        plan = "\n".join(
            str(r[0])
            for r in conn.execute(
                query, {"queue": "q1", "limit": 10, "consumer": c, "window": 1000}
            )
        )
        assert not seq_scanned_rows(conn, plan), plan
    # (the rows are in the current slot, jobs_1)
    assert "using jobs_dequeue_1 on jobs_1" in plan, plan
    assert "using jobs_running_rows_1 on jobs_1" in plan, plan
