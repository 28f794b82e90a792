"""A small FastAPI service embedding Timer without a broker: orders with a payment timeout.

``POST /orders`` writes the order and its payment timeout in one transaction (the timer
exists if and only if the order does); ``POST /orders/{id}/pay`` marks it paid and cancels
the timeout in another. When a timeout comes due, the Timer that the app's lifespan runs
calls :func:`expire_unpaid` in a thread, which expires the order if it is still unpaid; the
timer is marked fired only once that returned, so a crash in between calls it again.

Run it with ``ORDERS_DB=orders.db uvicorn orders_service:app``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from timer_adapters_sqlite import (
    SqliteTimerStore,
    cancel_in_transaction,
    migrate,
    schedule_in_transaction,
)
from timer_core import (
    CancelTimer,
    CommandOutcome,
    DueTimeReached,
    MessageEnvelope,
    ScheduleTimer,
    Timer,
)

TENANT = "shop"


class NewOrder(BaseModel):
    """What a client sends to place an order."""

    amount_cents: int


class OrderView(BaseModel):
    """An order as the API shows it."""

    id: str
    amount_cents: int
    status: str
    pay_by: datetime


def expiry_handler(engine: sa.Engine) -> Callable[[MessageEnvelope[DueTimeReached]], None]:
    """The Timer's handler: expire the order of a payment timeout if it is still unpaid."""

    def expire_unpaid(event: MessageEnvelope[DueTimeReached]) -> None:
        with engine.begin() as connection:
            # Idempotent: a second call for the same timeout (at least once) changes nothing.
            connection.execute(
                sa.text(
                    "UPDATE orders SET status = 'expired' WHERE id = :id AND status = 'unpaid'"
                ),
                {"id": event.payload.service_call_id},
            )

    return expire_unpaid


def create_app(db_path: str, *, payment_window: timedelta = timedelta(minutes=15)) -> FastAPI:
    """The service on the SQLite file ``db_path``: its orders and its timers in one file."""
    migrate(db_path)  # the timer table, so the first request can schedule in its transaction
    engine = sa.create_engine(f"sqlite:///{db_path}")
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, amount_cents INTEGER "
            "NOT NULL, status TEXT NOT NULL, pay_by TEXT NOT NULL)"
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The Timer runs as long as the app: it fires due timeouts, including those that
        # came due while the service was down.
        async with Timer(SqliteTimerStore(db_path), handler=expiry_handler(engine)) as timer:
            app.state.timer = timer
            yield

    app = FastAPI(title="orders", lifespan=lifespan)

    @app.post("/orders", status_code=201)
    def place_order(order: NewOrder) -> OrderView:
        """The order and its payment timeout, in one transaction."""
        now = datetime.now(UTC)
        view = OrderView(
            id=str(uuid.uuid4()),
            amount_cents=order.amount_cents,
            status="unpaid",
            pay_by=now + payment_window,
        )
        with engine.begin() as connection:
            connection.execute(
                sa.text("INSERT INTO orders VALUES (:id, :amount_cents, :status, :pay_by)"),
                {**view.model_dump(), "pay_by": view.pay_by.isoformat()},
            )
            timeout = ScheduleTimer(TENANT, view.id, view.pay_by, correlation_id=view.id)
            schedule_in_transaction(connection, timeout, now=now)
        return view

    @app.post("/orders/{order_id}/pay")
    def pay_order(order_id: str) -> OrderView:
        """Paid in time: the order is paid and its timeout cancelled, in one transaction."""
        with engine.begin() as connection:
            paid = connection.execute(
                sa.text("UPDATE orders SET status = 'paid' WHERE id = :id AND status = 'unpaid'"),
                {"id": order_id},
            ).rowcount
            if paid:
                outcome = cancel_in_transaction(connection, CancelTimer(TENANT, order_id))
                assert outcome is CommandOutcome.CANCELLED
        view = get_order(order_id)
        if not paid:
            raise HTTPException(409, f"order {order_id} is {view.status}, it cannot be paid")
        return view

    @app.get("/orders/{order_id}")
    def get_order(order_id: str) -> OrderView:
        """One order."""
        with engine.connect() as connection:
            row = connection.execute(
                sa.text("SELECT id, amount_cents, status, pay_by FROM orders WHERE id = :id"),
                {"id": order_id},
            ).one_or_none()
        if row is None:
            raise HTTPException(404, f"no order {order_id}")
        return OrderView(**row._mapping)

    return app


def __getattr__(name: str) -> FastAPI:
    # `uvicorn orders_service:app` builds the app on first use, so importing the module
    # (as the tests do) creates no database in the working directory.
    if name == "app":
        return create_app(os.environ.get("ORDERS_DB", "orders.db"))
    raise AttributeError(name)
