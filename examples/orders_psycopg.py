"""Create an order and enqueue its invoice e-mail in one transaction, with psycopg 3.

The job is a row in the same database as the order, written by the same transaction:

* the order commits  -> the job exists, and an idle worker starts it at once;
* the order rolls back (here: the payment is declined) -> no job, no e-mail, no wake-up.

Run it (any database you can write to; the pgskip schema is installed if missing)::

    export DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres
    python orders_psycopg.py                          # places two orders, one declined
    celery -A orders_psycopg worker -Q orders -P threads   # sends the one invoice
"""

from __future__ import annotations

import os

import psycopg
from celery import Celery

import kombu_pgskip
from kombu_pgskip import apply_async_in

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

app = Celery("orders_psycopg", broker=DATABASE_URL.replace("postgresql://", "pgskip://", 1))
app.conf.task_default_queue = "orders"


@app.task(name="orders.send_invoice_email")
def send_invoice_email(order_id: int) -> None:
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute("UPDATE orders SET invoice_sent_at = now() WHERE id = %s", (order_id,))
    print(f"invoice for order {order_id} sent")


class PaymentDeclined(Exception):
    pass


def create_order(conn: psycopg.Connection[tuple[object, ...]], customer: str, cents: int) -> int:
    row = conn.execute(
        "INSERT INTO orders (customer, cents) VALUES (%s, %s) RETURNING id", (customer, cents)
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def place_order(customer: str, cents: int, *, card_ok: bool = True) -> int | None:
    """The order and its invoice job commit together, or neither does."""
    with psycopg.connect(DATABASE_URL) as conn:
        try:
            with conn.transaction():
                order_id = create_order(conn, customer, cents)
                apply_async_in(conn, send_invoice_email, args=(order_id,))
                if not card_ok:
                    raise PaymentDeclined(customer)
        except PaymentDeclined:
            print(f"payment declined for {customer}: no order, no invoice job")
            return None
    print(f"order {order_id} for {customer} committed with its invoice job")
    return order_id


def setup() -> None:
    kombu_pgskip.migrate(DATABASE_URL)  # idempotent: installs or upgrades the pgskip schema
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders ("
            " id serial PRIMARY KEY, customer text NOT NULL, cents int NOT NULL,"
            " invoice_sent_at timestamptz)"
        )


if __name__ == "__main__":
    setup()
    place_order("alice", 4200)
    place_order("bob", 1300, card_ok=False)
