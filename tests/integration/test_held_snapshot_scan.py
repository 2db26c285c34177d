"""Fetching while another session holds an old snapshot: each queue is scanned after the last
message taken from it once a scan from the beginning grows slow, and a message that becomes
due behind that position is still delivered (kombu_pgskip.policy, ``sql/consume.sql``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import psycopg.sql
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from kombu_pgskip.policy import FetchPolicy
from kombu_pgskip.store import Store

BACKLOG = 60_000


def _broker(url: str) -> str:
    return url.replace("postgresql://", "pgskip://", 1)


def test_a_consumer_drains_past_a_held_snapshot_and_finds_what_falls_behind(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scans: list[bool] = []
    scanning = FetchPolicy.scanning

    def spy(self: FetchPolicy, state: Any, now: float, *, after: bool) -> None:
        scans.append(after)
        scanning(self, state, now, after=after)

    monkeypatch.setattr(FetchPolicy, "scanning", spy)
    queue = Queue("held", Exchange("held"), "held")
    received: list[str] = []
    with Connection(_broker(db_url)) as conn:
        producer = Producer(conn.channel())
        producer.publish("backlog", exchange=queue.exchange, routing_key="held", declare=[queue])
        producer.publish("straggler", exchange=queue.exchange, routing_key="held")
        with psycopg.connect(db_url, autocommit=True) as sql:
            (first, straggler) = sql.execute("SELECT min(id), max(id) FROM pgskip.jobs").fetchone()
            # Copies of the first message kombu wrote, all due before the straggler.
            sql.execute(
                "INSERT INTO pgskip.jobs (queue, payload, run_at)"
                " SELECT queue, payload, run_at FROM pgskip.jobs, generate_series(2, %s)"
                " WHERE id = %s",
                (BACKLOG, first),
            )
            with psycopg.connect(db_url) as holder:
                # A session idle in a REPEATABLE READ transaction: nothing deleted or updated
                # after its snapshot can be removed while it stays open.
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM pgskip.jobs")

                def take(body: Any, message: Any) -> None:
                    received.append(body)
                    message.ack()
                    if len(received) == BACKLOG // 4:
                        # Due an hour ago: behind the position of every message taken so far.
                        sql.execute(
                            "UPDATE pgskip.jobs SET run_at = now() - interval '1 hour'"
                            " WHERE id = %s",
                            (straggler,),
                        )

                channel = conn.channel()
                Consumer(channel, [queue], callbacks=[take], prefetch_count=100).consume()
                while len(received) < BACKLOG + 1:
                    conn.drain_events(timeout=10)
                holder.rollback()
    with psycopg.connect(db_url) as sql:  # the channel's close wrote the last acks
        left = sql.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
    assert sorted(received) == ["backlog"] * BACKLOG + ["straggler"]
    assert left == [("completed", BACKLOG + 1)]
    # The dead entries slowed the scans from the beginning: fetches started after the position
    # of the last message taken, and scans from the beginning still went on between them.
    assert scans.count(True) > 0 and scans.count(False) > 1, scans
    # The straggler came with such a scan, well before the backlog was drained.
    assert received.index("straggler") < BACKLOG - 1_000


def test_settling_a_message_reads_its_own_row_whatever_index_the_plan_takes(db_url: str) -> None:
    """Every message a consumer took left an entry in the index of running rows, dead once it
    was acked and kept while a snapshot is held. An ack (requeue, reject) finds its rows by id,
    through the primary key or, where the planner prefers it, that index, keyed by id
    (migration 0017): either way it reads the rows it names, not the consumer's past."""
    store = Store(db_url)
    me = uuid.uuid4()
    store.register_consumer(me, hostname="test", queues=["q"], lease=60)
    with psycopg.connect(db_url, autocommit=True) as sql, psycopg.connect(db_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")  # the snapshot; no lock on jobs
        sql.execute(
            "INSERT INTO pgskip.jobs (queue, payload)"
            " SELECT 'q', '{}' FROM generate_series(1, 5001)"
        )
        for _ in range(50):
            rows = store.fetch(["q"], 100, me)
            assert store.ack([r.tag for r in rows], me) == len(rows)
        (last,) = store.fetch(["q"], 1, me)
        ids, deliveries = [last.id], [last.delivery]
        with sql.transaction(force_rollback=True):
            # Without the primary key the planner must take the index of running rows.
            # (the rows are in the current slot, jobs_1)
            sql.execute("ALTER TABLE pgskip.jobs_1 DROP CONSTRAINT jobs_1_pkey")
            query = psycopg.sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + store.q["ack"]
            row = sql.execute(
                query, {"ids": ids, "deliveries": deliveries, "consumer": me}
            ).fetchone()
        holder.rollback()
    store.close()
    assert row is not None
    plan = row[0][0]["Plan"]
    text = json.dumps(plan)
    assert "jobs_running_rows" in text, text
    assert plan["Actual Rows"] == 1
    blocks = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert blocks < 50, f"{blocks} blocks read to settle one message: {text}"
