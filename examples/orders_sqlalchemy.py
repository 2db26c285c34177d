"""Create an order and enqueue its invoice e-mail in one transaction, with the SQLAlchemy ORM.

``apply_async_in(session, ...)`` writes the job through the session's own connection, so it
commits with ``session.commit()`` (here: the end of ``session.begin()``) and disappears with a
rollback. Flush first when the task needs a database-generated id.

Run it (any database you can write to; the pgskip schema is installed if missing)::

    export DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres
    python orders_sqlalchemy.py                          # places two orders, one declined
    celery -A orders_sqlalchemy worker -Q orders -P threads   # sends the one invoice
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from celery import Celery
from sqlalchemy import String, create_engine, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import kombu_pgskip
from kombu_pgskip import apply_async_in

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

engine = create_engine(DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1))

app = Celery("orders_sqlalchemy", broker=DATABASE_URL.replace("postgresql://", "pgskip://", 1))
app.conf.task_default_queue = "orders"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "shop_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    cents: Mapped[int]
    invoice_sent_at: Mapped[datetime | None]


@app.task(name="orders.send_invoice_email")
def send_invoice_email(order_id: int) -> None:
    with Session(engine) as session, session.begin():
        session.execute(
            update(Order)
            .where(Order.id == order_id)
            .values(invoice_sent_at=datetime.now(timezone.utc))
        )
    print(f"invoice for order {order_id} sent")


class PaymentDeclined(Exception):
    pass


def place_order(customer: str, cents: int, *, card_ok: bool = True) -> int | None:
    """The order and its invoice job commit together, or neither does."""
    try:
        with Session(engine) as session, session.begin():
            order = Order(customer=customer, cents=cents)
            session.add(order)
            session.flush()  # the task needs the order's id
            apply_async_in(session, send_invoice_email, args=(order.id,))
            if not card_ok:
                raise PaymentDeclined(customer)
            order_id = order.id
    except PaymentDeclined:
        print(f"payment declined for {customer}: no order, no invoice job")
        return None
    print(f"order {order_id} for {customer} committed with its invoice job")
    return order_id


def setup() -> None:
    kombu_pgskip.migrate(DATABASE_URL)  # idempotent: installs or upgrades the pgskip schema
    Base.metadata.create_all(engine)


if __name__ == "__main__":
    setup()
    place_order("alice", 4200)
    place_order("bob", 1300, card_ok=False)
