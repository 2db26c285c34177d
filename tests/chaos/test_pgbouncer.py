"""Scenario 6: scenarios 1 and 5 through PgBouncer in transaction pooling, poll-only mode."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
from kombu import Connection, Queue

from kombu_pgskip import publish_many
from tests.chaos.conftest import PGBOUNCER_OPTIONS
from tests.chaos.pgbouncer import PgBouncer
from tests.chaos.test_concurrency import run_concurrency_scenario
from tests.chaos.test_crash import run_crash_scenario
from tests.helpers import woken

# Scenario 5 through PgBouncer: the same four prefork workers and one queue, with 8,000
# messages. docs/reliability.md has a run of 100,000 (PGSKIP_CHAOS_PGBOUNCER_MESSAGES=100000).
PGBOUNCER_MESSAGES = int(os.environ.get("PGSKIP_CHAOS_PGBOUNCER_MESSAGES", "8000"))


def test_sigkilled_workers_behind_pgbouncer_lose_nothing(
    pgbouncer: PgBouncer, db_url: str, chaos_log: Path, chaos_report: Path
) -> None:
    broker = pgbouncer.url_for(db_url).replace("postgresql://", "pgskip://", 1)
    figures = run_crash_scenario(
        "6-pgbouncer-crash", db_url, broker, chaos_log, chaos_report, env=PGBOUNCER_OPTIONS
    )
    assert figures.lost == 0


def test_four_prefork_workers_behind_pgbouncer_deliver_each_message_once(
    pgbouncer: PgBouncer, db_url: str, chaos_log: Path, chaos_report: Path
) -> None:
    broker = pgbouncer.url_for(db_url).replace("postgresql://", "pgskip://", 1)
    run_concurrency_scenario(
        "6-pgbouncer-concurrency",
        db_url,
        broker,
        chaos_log,
        chaos_report,
        messages=PGBOUNCER_MESSAGES,
        env=PGBOUNCER_OPTIONS,
    )


def test_publish_many_through_pgbouncer_is_one_transaction(
    pgbouncer: PgBouncer, db_url: str
) -> None:
    """publish_many sends its chunks down a pipeline inside one transaction: PgBouncer in
    transaction pooling keeps them on one server connection, all or nothing."""
    broker = pgbouncer.url_for(db_url).replace("postgresql://", "pgskip://", 1)
    options = {"prepared_statements": False, "listen": False}
    with Connection(broker, transport_options=options) as conn:
        producer = conn.Producer()
        bodies = [{"n": n} for n in range(450)]  # five statements of at most 100 rows
        ids = publish_many(producer, bodies, routing_key="bounced", declare=[Queue("bounced")])
        again = publish_many(producer, bodies[:150], routing_key="bounced")
    assert len(ids) == 450 and len(again) == 150
    with psycopg.connect(db_url, autocommit=True) as check:
        rows = check.execute(
            "SELECT count(*), count(DISTINCT xmin::text) FROM pgskip.jobs WHERE queue = 'bounced'"
        ).fetchone()
    assert rows == (600, 2)  # two calls, two transactions


def test_single_publishes_through_pgbouncer_commit_one_by_one(
    pgbouncer: PgBouncer, db_url: str
) -> None:
    """A durable publish sends its insert and its NOTIFY as two transactions down one
    pipeline (notify_after_commit): PgBouncer in transaction pooling may run them on different
    server connections; each message is still written once, in a transaction of its own, and
    its announcement reaches a listener on the server."""
    broker = pgbouncer.url_for(db_url).replace("postgresql://", "pgskip://", 1)
    options = {"prepared_statements": False, "listen": False}
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute('LISTEN "pgskip:pgskip"')
        with Connection(broker, transport_options=options) as conn:
            producer = conn.Producer()
            Queue("bounced-one")(conn.default_channel).declare()
            for n in range(200):
                producer.publish({"n": n}, routing_key="bounced-one")
        heard = woken(listener, 200, timeout=5)
        rows = listener.execute(
            "SELECT count(*), count(DISTINCT xmin::text) FROM pgskip.jobs"
            " WHERE queue = 'bounced-one'"
        ).fetchone()
    assert rows == (200, 200)
    assert heard == ["bounced-one"] * 200
