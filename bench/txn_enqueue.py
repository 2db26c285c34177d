"""Transactional enqueue from many processes: ``python -m bench.txn_enqueue``.

Each of ``N`` processes runs Django transactions back to back for ``--seconds``: inside
``transaction.atomic()``, one ``INSERT`` of a business row and ``--jobs`` calls of
``apply_async_in`` (the jobs' rows; one by default). Transactions committed per second, all
processes together, for ``notify_after_commit`` on (the NOTIFYs go after the commit, through
Django's ``on_commit``) and off (the NOTIFY inside the transaction, which holds PostgreSQL's
cluster-wide NOTIFY lock through the commit's flush), alternating in every round, for each
process count of ``--procs`` and each ``--commit-delays`` setting. ``commit_delay``
(microseconds, with ``commit_siblings = 0``) makes every commit's WAL flush wait that much
longer, as storage with a flush of milliseconds (network block storage, synchronous replication)
does; 0 is this machine's disk as it is.

``--driver psycopg`` runs the same on a psycopg 3 connection: ``kombu_pgskip.transaction(conn)``
(the NOTIFYs after the commit) against a plain ``conn.transaction()`` (the NOTIFY inside).
``--driver sqlalchemy`` (or ``sqlalchemy-psycopg2``) on a SQLAlchemy ``Session`` over psycopg
(psycopg2), ``with session.begin():``, with ``notify_after_commit`` on (the NOTIFYs from the
session's ``after_commit`` event) and off.

Runs its own EmbeddedPostgres (fsync on). Prints a table and writes the figures as JSON to
``--out``; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import psycopg

from .common import REPO, code_state, log, machine_info, median


def _enqueuer(
    url: str,
    driver: str,
    after_commit: bool,
    jobs: int,
    seconds: float,
    start_at: float,
    out: Any,
) -> None:  # pragma: no cover - runs in a child process
    from kombu_pgskip import apply_async_in
    from tests.publish_support import make_app

    app = make_app(url, broker_transport_options={"notify_after_commit": after_commit})
    task = app.tasks["txn.add"]

    def run(transaction_block: Any, execute: Any, conn: Any) -> None:
        with transaction_block():  # connected, schema checked
            apply_async_in(conn, task, (1, 2), queue="bench")
        while time.time() < start_at:
            time.sleep(0.001)
        n = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            with transaction_block():
                execute("INSERT INTO orders (note) VALUES ('order')")
                for _ in range(jobs):
                    apply_async_in(conn, task, (1, 2), queue="bench")
            n += 1
        out.put((n, time.perf_counter() - t0))

    if driver == "django":
        from django.db import connections, transaction

        from tests.publish_support import django_database

        with django_database(url) as alias:
            conn = connections[alias]

            def execute(statement: str) -> None:
                with conn.cursor() as cur:
                    cur.execute(statement)

            run(lambda: transaction.atomic(using=alias), execute, conn)
    elif driver.startswith("sqlalchemy"):
        import sqlalchemy as sa
        from sqlalchemy.orm import Session

        dbapi = "psycopg2" if driver == "sqlalchemy-psycopg2" else "psycopg"
        engine = sa.create_engine(url.replace("postgresql://", f"postgresql+{dbapi}://", 1))
        with Session(engine) as session:
            run(session.begin, lambda statement: session.execute(sa.text(statement)), session)
        engine.dispose()
    else:  # psycopg 3: kombu_pgskip.transaction() against a plain conn.transaction()
        import kombu_pgskip

        with psycopg.connect(url) as pg:
            block = (lambda: kombu_pgskip.transaction(pg)) if after_commit else pg.transaction
            run(block, pg.execute, pg)
    app.close()


def _round(
    url: str, driver: str, procs: int, after_commit: bool, jobs: int, seconds: float
) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # every process imported and connected
    children = [
        ctx.Process(
            target=_enqueuer, args=(url, driver, after_commit, jobs, seconds, start_at, out)
        )
        for _ in range(procs)
    ]
    for child in children:
        child.start()
    results = [out.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE pgskip.jobs, orders")
    return sum(n for n, _ in results) / max(elapsed for _, elapsed in results)


def _set_commit_delay(url: str, delay_us: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET commit_delay = {int(delay_us)}")
        conn.execute("ALTER SYSTEM SET commit_siblings = 0")
        conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 10
        while conn.execute("SHOW commit_delay").fetchone() != (str(int(delay_us)),):
            if time.monotonic() > deadline:
                raise RuntimeError("commit_delay did not take effect")
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    from kombu_pgskip.migrate import migrate
    from kombu_pgskip.testing.embedded import EmbeddedPostgres

    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(prog="python -m bench.txn_enqueue")
    parser.add_argument("--procs", type=ints, default=[1, 4, 8])
    parser.add_argument("--commit-delays", type=ints, default=[0, 2000])
    parser.add_argument("--jobs", type=int, default=1, help="apply_async_in per transaction")
    parser.add_argument(
        "--driver",
        choices=["django", "psycopg", "sqlalchemy", "sqlalchemy-psycopg2"],
        default="django",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "txn_enqueue"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "meta": {"machine": machine_info(), "code": code_state(), "argv": vars(args)},
        "rates": {},
    }
    with EmbeddedPostgres(fsync=True, pg_cron=False) as pg:
        url = pg.dsn()
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, note text)")
        for delay in args.commit_delays:
            _set_commit_delay(url, delay)
            for rnd in range(args.rounds):
                for procs in args.procs:
                    for after_commit in (True, False):
                        rate = _round(
                            url, args.driver, procs, after_commit, args.jobs, args.seconds
                        )
                        key = f"commit_delay={delay} procs={procs} after_commit={after_commit}"
                        report["rates"].setdefault(key, []).append(round(rate, 1))
                        log(f"round {rnd + 1}: {key}: {rate:,.0f} transactions/s")
    print(f"\n{args.driver}, {args.jobs} job(s) per transaction")
    print("| commit_delay (us) | processes | NOTIFY after the commit | NOTIFY inside |")
    print("|---|---|---|---|")
    for delay in args.commit_delays:
        for procs in args.procs:
            cells = []
            for after_commit in (True, False):
                rates = report["rates"][
                    f"commit_delay={delay} procs={procs} after_commit={after_commit}"
                ]
                cells.append(f"{median(rates):,.0f} ({', '.join(f'{r:,.0f}' for r in rates)})")
            print(f"| {delay} | {procs} | {cells[0]} | {cells[1]} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"txn-enqueue-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    log(f"figures written to {path}")


if __name__ == "__main__":
    main()
