"""Raw figures below Celery: what PostgreSQL itself allows, and kombu publish / consume.

SQL ceilings (psycopg 3, autocommit, fsync on, the ``raw_bench`` database): one plain table
shaped as pgskip's ``jobs`` (``CREATE TABLE ... (LIKE pgskip.jobs INCLUDING ALL)`` with a
primary key on ``id`` and without the ring's ``slot``: same columns and indexes, no trigger,
no partitions), a real Celery message as payload.

* single-row INSERT, one durable commit each, one connection, through psycopg and through
  libpq itself (as the transport's publish runs);
* SKIP LOCKED dequeue of 100 rows (returning the payloads), then one batched ack statement,
  with 1 and 4 clients (processes);
* the same dequeue with one ack statement per row, 1 and 4 clients; and, to show where that
  time goes, per-row acks with ``synchronous_commit=off``;
* pgskip's own ``fetch`` and ``ack`` statements (``Store.fetch`` / ``Store.ack``) with one ack
  statement per batch: what the transport's SQL allows if acks were batched.

kombu (no Celery): one producer publishing durable messages (``delivery_mode=2``) for a fixed
time; then one consumer with prefetch 100 that acks each message, over those messages.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any

import psycopg

from .brokers import Broker

CEILING_DDL = """
DROP SCHEMA IF EXISTS ceiling CASCADE;
CREATE SCHEMA ceiling;
CREATE TABLE ceiling.jobs (LIKE pgskip.jobs INCLUDING ALL)
  WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02,
        autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0);
-- One plain table: jobs' primary key is its partitions' (the parent has none to copy), and
-- its slot column is the ring's.
ALTER TABLE ceiling.jobs ADD PRIMARY KEY (id), DROP COLUMN slot;
"""

INSERT = (
    "INSERT INTO ceiling.jobs (queue, payload, task_name, task_id) "
    "VALUES ('q', %s::json, 'bench.noop', %s)"
)
PREFILL = (
    "INSERT INTO ceiling.jobs (queue, payload, task_name, task_id) "
    "SELECT 'q', %s::json, 'bench.noop', gen_random_uuid()::text FROM generate_series(1, %s)"
)
DEQUEUE = """
WITH picked AS (
    SELECT id FROM ceiling.jobs
     WHERE queue = 'q' AND status = 'pending' AND run_at <= now()
     ORDER BY priority DESC, run_at, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE ceiling.jobs AS j
   SET status = 'running', locked_by = %(me)s, locked_at = now(), attempts = j.attempts + 1
  FROM picked
 WHERE j.id = picked.id
RETURNING j.id, j.payload
"""
ACK_BATCH = (
    "UPDATE ceiling.jobs SET status = 'completed', finished_at = now(), locked_by = NULL "
    "WHERE id = ANY(%(ids)s) AND locked_by = %(me)s AND status = 'running'"
)
ACK_ONE = (
    "UPDATE ceiling.jobs SET status = 'completed', finished_at = now(), locked_by = NULL "
    "WHERE id = %(id)s AND locked_by = %(me)s AND status = 'running'"
)


def sample_payload(pgskip: Broker) -> str:
    """A real Celery message for ``bench.noop``, as pgskip stores it."""
    from .workers import new_queue, publisher_app

    pgskip.reset()
    app = publisher_app(pgskip, new_queue("sample"))
    app.tasks["bench.noop"].apply_async(kwargs={"i": 0})
    app.close()
    with psycopg.connect(pgskip.db_url or "", autocommit=True) as conn:
        row = conn.execute("SELECT payload::text FROM pgskip.jobs LIMIT 1").fetchone()
    pgskip.reset()
    assert row is not None
    return str(row[0])


# -- child processes (spawned: a clean interpreter, no inherited connections) --------------------


def _until(start_at: float) -> None:
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)


def _insert_client(
    start_at: float, url: str, payload: str, seconds: float, options: str
) -> tuple[int, float]:
    with psycopg.connect(url, autocommit=True, options=options) as conn:
        conn.execute(INSERT, (payload, "warm"), prepare=True)
        _until(start_at)
        n = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            conn.execute(INSERT, (payload, str(n)), prepare=True)
            n += 1
        return n, time.perf_counter() - t0


def _dequeue_client(
    start_at: float, url: str, seconds: float, limit: int, per_row: bool, options: str
) -> tuple[int, float]:
    me = uuid.uuid4()
    with psycopg.connect(url, autocommit=True, options=options) as conn:
        _until(start_at)
        n = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            rows = conn.execute(DEQUEUE, {"limit": limit, "me": me}, prepare=True).fetchall()
            if not rows:
                break
            if per_row:
                for r in rows:
                    conn.execute(ACK_ONE, {"id": r[0], "me": me}, prepare=True)
            else:
                conn.execute(ACK_BATCH, {"ids": [r[0] for r in rows], "me": me}, prepare=True)
            n += len(rows)
        return n, time.perf_counter() - t0


def _insert_client_libpq(
    start_at: float, url: str, payload: str, seconds: float, options: str
) -> tuple[int, float]:
    """The same INSERT through libpq itself (one prepared statement, text parameters): what
    the INSERT costs without psycopg's per-call overhead, as the transport's publish runs."""
    from psycopg import pq

    query = INSERT % ("$1", "$2")
    with psycopg.connect(url, autocommit=True, options=options) as conn:
        pgconn = conn.pgconn
        res = pgconn.prepare(b"ceiling_insert", query.encode())
        assert res.status == pq.ExecStatus.COMMAND_OK, res.get_error_message()
        data = payload.encode()
        _until(start_at)
        n = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            res = pgconn.exec_prepared(b"ceiling_insert", [data, str(n).encode()])
            if res.status != pq.ExecStatus.COMMAND_OK:
                raise RuntimeError(res.get_error_message())
            n += 1
        return n, time.perf_counter() - t0


def _publish_client(
    start_at: float, url: str, payload: str, seconds: float, options: str
) -> tuple[int, float]:
    """pgskip's own publish statement (INSERT + NOTIFY) on ``pgskip.jobs``, run as the
    transport runs it (``Store.publish``, through libpq)."""
    from kombu_pgskip.store import NewMessage, Store

    message = NewMessage("q", 0, "pending", None, payload, "bench.noop", "x", None)
    store = Store(url, check=False, options=options)
    store.publish(message)
    _until(start_at)
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        store.publish(message)
        n += 1
    elapsed = time.perf_counter() - t0
    store.close()
    return n, elapsed


def _store_client(start_at: float, url: str, seconds: float, limit: int) -> tuple[int, float]:
    from kombu_pgskip.store import Store

    store = Store(url, check=False)
    me = uuid.uuid4()
    store.register_consumer(me, hostname="bench", queues=["q"], lease=60)
    _until(start_at)
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        rows = store.fetch(["q"], limit, me)
        if not rows:
            break
        store.ack([r.tag for r in rows], me)
        n += len(rows)
    elapsed = time.perf_counter() - t0
    store.close()
    return n, elapsed


def _ready() -> bool:
    import psycopg  # noqa: F401  (imported before the clock starts)

    import kombu_pgskip.store  # noqa: F401

    return True


def _run_clients(target: Any, args_for: list[Any]) -> list[tuple[int, float]]:
    """Run ``target(start_at, *args)`` in one spawned process per client, started together."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(args_for)) as pool:
        pool.starmap(_ready, [()] * len(args_for))  # every child up and imported
        start_at = time.time() + 0.3
        return pool.starmap(target, [(start_at, *a) for a in args_for])


# -- SQL ceilings -----------------------------------------------------------------------------


def sql_ceilings(
    raw_url: str, payload: str, *, seconds: float, prefill: int, quiet: Any, short: bool = False
) -> dict[str, Any]:
    """Every SQL ceiling once; ``quiet()`` is called (and its result kept) before each.

    ``short`` leaves out the figures that only explain others (4-client INSERT, per-row acks
    with asynchronous commit, pgskip's statements with 4 clients).
    """
    out: dict[str, Any] = {"payload_bytes": len(payload)}
    with psycopg.connect(raw_url, autocommit=True) as conn:
        conn.execute(CEILING_DDL)

    def reset(rows: int, table: str = "ceiling.jobs") -> None:
        with psycopg.connect(raw_url, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {table}")
            if rows:
                if table == "ceiling.jobs":
                    conn.execute(PREFILL, (payload, rows))
                else:
                    conn.execute(
                        "INSERT INTO pgskip.jobs (queue, payload, task_name, task_id) "
                        "SELECT 'q', %s::json, 'bench.noop', gen_random_uuid()::text "
                        "FROM generate_series(1, %s)",
                        (payload, rows),
                    )
            conn.execute(f"VACUUM ANALYZE {table}")
            if rows:
                conn.execute("CHECKPOINT")  # no checkpoint of the prefill during the measurement

    def record(name: str, counts: list[tuple[int, float]], clients: int, **extra: Any) -> None:
        rows = sum(c for c, _ in counts)
        elapsed = max(e for _, e in counts)
        out[name] = {
            "rate": rows / elapsed if elapsed > 0 else None,
            "clients": clients,
            "rows": rows,
            "elapsed_s": round(elapsed, 3),
            **extra,
        }

    def go(name: str, target: Any, args: list[tuple[Any, ...]], rows: int, **extra: Any) -> None:
        reset(rows)
        load = quiet()
        counts = _run_clients(target, args)
        record(name, counts, len(args), load=load, **extra)

    sync, async_ = "", "-c synchronous_commit=off"
    go("insert_1c", _insert_client, [(raw_url, payload, seconds, sync)], 0)
    go("insert_1c_libpq", _insert_client_libpq, [(raw_url, payload, seconds, sync)], 0)
    if not short:
        go("insert_1c_async_commit", _insert_client, [(raw_url, payload, seconds, async_)], 0)
        go("insert_4c", _insert_client, [(raw_url, payload, seconds, sync)] * 4, 0)
    # pgskip's publish statement: the INSERT and its NOTIFY, as the transport runs it.
    for clients in (1,) if short else (1, 4):
        reset(0, "pgskip.jobs")
        load = quiet()
        counts = _run_clients(_publish_client, [(raw_url, payload, seconds, sync)] * clients)
        record(f"pgskip_publish_statement_{clients}c", counts, clients, load=load)
    for clients in (1, 4):
        go(
            f"dequeue100_batch_ack_{clients}c",
            _dequeue_client,
            [(raw_url, seconds, 100, False, sync)] * clients,
            prefill,
        )
    for clients in (1, 4):
        go(
            f"dequeue100_row_ack_{clients}c",
            _dequeue_client,
            [(raw_url, seconds, 100, True, sync)] * clients,
            max(prefill // 8, 10_000),
        )
    if not short:
        go(
            "dequeue100_row_ack_1c_async_commit",
            _dequeue_client,
            [(raw_url, seconds, 100, True, async_)],
            prefill,
        )
    # pgskip's own fetch/ack statements, one ack statement per fetched batch.
    for clients in (1,) if short else (1, 4):
        reset(prefill, "pgskip.jobs")
        load = quiet()
        counts = _run_clients(_store_client, [(raw_url, seconds, 100)] * clients)
        record(f"pgskip_store_fetch100_batch_ack_{clients}c", counts, clients, load=load)
    reset(0)
    reset(0, "pgskip.jobs")
    return out


# -- raw kombu --------------------------------------------------------------------------------


def kombu_publish_consume(
    broker: Broker, *, seconds: float, consume_cap: float, consume: bool = True
) -> dict[str, Any]:
    """Publish durable messages for ``seconds``; then consume them (prefetch 100, ack each)."""
    from kombu import Connection, Consumer, Exchange, Producer, Queue

    broker.reset()
    name = f"bench.raw.{uuid.uuid4().hex[:8]}"
    exchange = Exchange(name, "direct", durable=True)
    queue = Queue(name, exchange, routing_key=name, durable=True)
    body = {"i": 0, "pad": "x" * 200}
    out: dict[str, Any] = {}
    try:
        with Connection(broker.publisher_url, transport_options=broker.transport_options) as conn:
            chan = conn.channel()
            queue(chan).declare()
            producer = Producer(chan, exchange=exchange, routing_key=name, serializer="json")
            for _ in range(20):
                producer.publish(body, delivery_mode=2)
            n = 20
            t0 = time.perf_counter()
            end = t0 + seconds
            while time.perf_counter() < end:
                body["i"] = n
                producer.publish(body, delivery_mode=2)
                n += 1
            elapsed = time.perf_counter() - t0
            out["publish_rate"] = (n - 20) / elapsed
            out["published"] = n

        if not consume:
            return out
        got = 0
        first: float | None = None
        last = 0.0

        def on_message(_body: Any, message: Any) -> None:
            nonlocal got, first, last
            message.ack()
            got += 1
            last = time.perf_counter()
            if first is None:
                first = last

        with Connection(broker.url, transport_options=broker.transport_options) as conn:
            chan = conn.channel()
            chan.basic_qos(0, 100, False)
            with Consumer(chan, [queue], callbacks=[on_message], accept=["json"]):
                t0 = time.perf_counter()
                deadline = t0 + consume_cap
                while got < n and time.perf_counter() < deadline:
                    try:
                        conn.drain_events(timeout=1.0)
                    except TimeoutError:
                        continue
                    except Exception as exc:  # socket.timeout on some transports
                        if "timed out" not in str(exc):
                            raise
        out["consumed"] = got
        out["consume_rate"] = got / (last - t0) if got and last > t0 else None
        if got < n:
            out["note"] = f"consumed {got} of {n} within {consume_cap} s"
        return out
    finally:
        broker.delete_queues([name])


def bulk_publish(broker: Broker, *, seconds: float, batch_size: int = 1000) -> dict[str, Any]:
    """pgskip's bulk path: ``publish_many`` of ``batch_size`` messages per durable commit for
    ``seconds``, and ``apply_many`` of Celery tasks (each message built by ``apply_async``)."""
    from kombu import Connection, Exchange, Producer, Queue

    from kombu_pgskip import apply_many, publish_many

    from .workers import publisher_app

    broker.reset()
    name = f"bench.bulk.{uuid.uuid4().hex[:8]}"
    exchange = Exchange(name, "direct", durable=True)
    queue = Queue(name, exchange, routing_key=name, durable=True)
    bodies = [{"i": i, "pad": "x" * 200} for i in range(batch_size)]
    out: dict[str, Any] = {"batch_size": batch_size}
    try:
        with Connection(broker.publisher_url, transport_options=broker.transport_options) as conn:
            chan = conn.channel()
            queue(chan).declare()
            producer = Producer(chan, exchange=exchange, routing_key=name, serializer="json")
            publish_many(producer, bodies[:10], delivery_mode=2)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() < t0 + seconds:
                n += len(publish_many(producer, bodies, delivery_mode=2))
            out["publish_many_rate"] = n / (time.perf_counter() - t0)
            out["publish_many_messages"] = n
        app = publisher_app(broker, name)
        try:
            task = app.tasks["bench.noop"]
            apply_many(task.s(i=-1) for _ in range(10))
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() < t0 + seconds:
                n += len(apply_many(task.s(i=i) for i in range(batch_size)))
            out["apply_many_rate"] = n / (time.perf_counter() - t0)
            out["apply_many_tasks"] = n
        finally:
            app.close()
        return out
    finally:
        broker.delete_queues([name])
