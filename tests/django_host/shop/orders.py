"""The shop's own code: an order and its payment timeout in one ``transaction.atomic()``."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connections, transaction

from tests.django_host.shop.models import Order
from timer_adapters_postgres import cancel_in_transaction as cancel_in_pg
from timer_adapters_postgres import schedule_in_transaction as schedule_in_pg
from timer_adapters_sqlite import cancel_in_transaction as cancel_in_sqlite
from timer_adapters_sqlite import schedule_in_transaction as schedule_in_sqlite
from timer_core import CancelTimer, CommandOutcome, ScheduleTimer


class PaymentRefused(Exception):
    """The payment provider said no: the order and its timeout roll back."""


def place_order(order_id: str, due_at: datetime, *, using: str, refuse: bool = False) -> None:
    """Insert the order and schedule its timeout with Django's own connection, atomically."""
    connection = connections[using]
    schedule = schedule_in_pg if connection.vendor == "postgresql" else schedule_in_sqlite
    with transaction.atomic(using=using):
        Order.objects.using(using).create(id=order_id)
        timeout = ScheduleTimer("shop-1", order_id, due_at, correlation_id=order_id)
        schedule(connection, timeout, now=datetime.now(UTC))
        if refuse:
            raise PaymentRefused(order_id)


def pay_order(order_id: str, *, using: str) -> CommandOutcome:
    """Mark the order paid and cancel its timeout, atomically."""
    connection = connections[using]
    cancel = cancel_in_pg if connection.vendor == "postgresql" else cancel_in_sqlite
    with transaction.atomic(using=using):
        Order.objects.using(using).filter(id=order_id).update(status="paid")
        return cancel(connection, CancelTimer("shop-1", order_id))
