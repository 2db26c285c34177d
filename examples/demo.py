"""The kombu-pgskip demo: a throwaway PostgreSQL, a real worker, orders, a pg_cron tick.

Run it with ``bash scripts/demo.sh`` (installs what it needs), or ``python -m examples.demo``
from the repo root. By default it starts its own PostgreSQL cluster in a temporary directory
(with pg_cron preloaded) and removes it at the end; ``--url postgresql://...`` uses yours
instead (pg_cron must then be preloaded there for the last step, or pass ``--no-cron``).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


@contextmanager
def database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from kombu_pgskip.testing.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        say(f"started a throwaway PostgreSQL on port {pg.port} (data in {pg.data_dir})")
        yield pg.dsn("postgres")
    say("stopped and removed the throwaway PostgreSQL")


@contextmanager
def worker(broker_url: str) -> Iterator[subprocess.Popen[str]]:
    env = dict(os.environ, PGSKIP_BROKER_URL=broker_url, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "examples.shop", "worker", "-Q", "orders,reports",
         "-P", "threads", "-c", "4", "--loglevel=WARNING", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "-n", "demo@%h"],
        cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        say("worker stopped")


def wait_for(check: object, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():  # type: ignore[operator]
            return time.monotonic() - start
        time.sleep(0.05)
    raise SystemExit(f"[demo] FAILED: timed out after {timeout:.0f}s waiting for {what}")


def place_orders(db_url: str, count: int) -> tuple[set[int], int]:
    """Each order and its invoice job in one transaction; about a third roll back."""
    from examples.shop import send_invoice_email
    from kombu_pgskip import apply_async_in

    committed: set[int] = set()
    rolled_back = 0
    rng = random.Random(7)
    with psycopg.connect(db_url) as conn:
        for i in range(count):
            declined = rng.random() < 1 / 3
            try:
                with conn.transaction():
                    row = conn.execute(
                        "INSERT INTO orders (customer, cents) VALUES (%s, %s) RETURNING id",
                        (f"customer-{i}", rng.randint(500, 50_000)),
                    ).fetchone()
                    assert row is not None
                    order_id = int(row[0])
                    apply_async_in(conn, send_invoice_email, args=(order_id,))
                    if declined:
                        raise LookupError("card declined")
                committed.add(order_id)
            except LookupError:
                rolled_back += 1
    return committed, rolled_back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--url", help="use this PostgreSQL (superuser URL) instead of a throwaway one"
    )
    parser.add_argument("--orders", type=int, default=30)
    parser.add_argument("--no-cron", action="store_true", help="skip the pg_cron tick (~1 min)")
    args = parser.parse_args(argv)

    with database(args.url) as db_url:
        broker_url = db_url.replace("postgresql://", "pgskip://", 1)
        os.environ["PGSKIP_BROKER_URL"] = broker_url
        from examples import shop
        from kombu_pgskip.migrate import migrate

        for label in migrate(db_url):
            say(f"schema: applied {label}")
        shop.create_tables(db_url)

        with worker(broker_url):
            # 1. Transactional enqueue: the job exists if and only if the order commits.
            committed, rolled_back = place_orders(db_url, args.orders)
            say(
                f"placed {args.orders} orders: {len(committed)} committed, "
                f"{rolled_back} rolled back (payment declined)"
            )

            def invoiced() -> set[int]:
                with psycopg.connect(db_url) as conn:
                    return {
                        r[0]
                        for r in conn.execute(
                            "SELECT id FROM orders WHERE invoice_sent_at IS NOT NULL"
                        )
                    }

            took = wait_for(lambda: invoiced() == committed, 60, "the invoices")
            with psycopg.connect(db_url) as conn:
                jobs = conn.execute(
                    "SELECT count(*) FROM pgskip.jobs WHERE task_name = 'shop.send_invoice_email'"
                ).fetchone()
            say(
                f"worker sent exactly {len(invoiced())} invoices, one per committed order, "
                f"in {took:.2f}s; {jobs[0] if jobs else 0} invoice jobs exist "
                "(none for the rolled-back orders)"
            )

            # 2. Periodic task on pg_cron: no celery beat anywhere.
            if not args.no_cron:
                run_cron_tick(db_url, shop.app)
    say("done")
    return 0


def run_cron_tick(db_url: str, app: object) -> None:
    from kombu_pgskip import cron, periodic

    # What `celery -A examples.shop pgskip beat-sync` does: store beat_schedule, install pg_cron.
    result = periodic.beat_sync(app, db_url, "pgskip")
    for change in [*result.changes, *result.cron_changes]:
        say(f"beat-sync: {change}")

    def reports() -> int:
        with psycopg.connect(db_url) as conn:
            row = conn.execute("SELECT count(*) FROM reports").fetchone()
        return int(row[0]) if row else 0

    def ticked() -> bool:
        """pg_cron ran the schema's `fire` job since the sync, and it succeeded."""
        assert result.server is not None and result.run_mark is not None
        prefix = cron.job_prefix(result.server.app_database, "pgskip")
        with cron.cron_session(db_url, result.server) as conn:
            runs = cron.runs_after(conn, prefix, result.run_mark)
        return any(r.job == prefix + "fire" and r.status == cron.SUCCEEDED for r in runs)

    # beat-sync inserted the report's first run at the coming minute itself; pg_cron's tick
    # at that minute fires the schedule from then on.
    say("waiting for the minute: shop.nightly_report's run and pg_cron's tick (up to ~70 s)...")
    took = wait_for(lambda: reports() >= 1 and ticked(), 90, "the pg_cron tick")
    say(f"the worker ran the periodic task; pg_cron's tick fired the schedule ({took:.0f}s)")


if __name__ == "__main__":
    raise SystemExit(main())
