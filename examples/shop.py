"""A small shop whose Celery app uses the pgskip broker: the app the demo runs.

Orders and their jobs live in the same PostgreSQL database. ``send_invoice_email`` is enqueued
inside the order's transaction (see ``examples/demo.py``); ``nightly_report`` is a periodic task
fired by pg_cron, with no ``celery beat`` process.

Run a worker for it yourself::

    export PGSKIP_BROKER_URL=pgskip://postgres@127.0.0.1:5432/shop
    celery -A examples.shop pgskip migrate
    celery -A examples.shop worker -Q orders,reports -P threads
"""

from __future__ import annotations

import os

import psycopg
from celery import Celery
from celery.schedules import crontab

import kombu_pgskip  # noqa: F401  (registers pgskip:// in processes that are not `celery`)
from kombu_pgskip.urls import to_conninfo

BROKER_URL = os.environ.get("PGSKIP_BROKER_URL", "pgskip://postgres@127.0.0.1:5432/postgres")
DATABASE_URL = to_conninfo(BROKER_URL)

app = Celery("shop", broker=BROKER_URL)
app.conf.update(
    task_default_queue="orders",
    task_routes={"shop.nightly_report": {"queue": "reports"}},
    broker_connection_retry_on_startup=True,
    timezone="UTC",
    beat_schedule={
        # pg_cron fires this every minute; a real shop would use crontab(hour=0, minute=0).
        "report-every-minute": {"task": "shop.nightly_report", "schedule": crontab()},
    },
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id               bigserial PRIMARY KEY,
    customer         text NOT NULL,
    cents            integer NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    invoice_sent_at  timestamptz
);
CREATE TABLE IF NOT EXISTS reports (
    id      bigserial PRIMARY KEY,
    orders  integer NOT NULL,
    made_at timestamptz NOT NULL DEFAULT now()
);
"""


def create_tables(url: str = DATABASE_URL) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SCHEMA)


@app.task(name="shop.send_invoice_email")
def send_invoice_email(order_id: int) -> str:
    """Marks the order invoiced; it can rely on the order existing (same transaction)."""
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        updated = conn.execute(
            "UPDATE orders SET invoice_sent_at = now() WHERE id = %s AND invoice_sent_at IS NULL",
            (order_id,),
        ).rowcount
    if updated != 1:
        raise LookupError(f"order {order_id} not found or already invoiced")
    return f"invoice for order {order_id} sent"


@app.task(name="shop.nightly_report")
def nightly_report() -> int:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO reports (orders) SELECT count(*) FROM orders RETURNING orders"
        ).fetchone()
    return int(row[0]) if row else 0
