"""The shop's own code: an order and its payment timeout in one ``transaction.atomic()``."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction

from shop.models import Order
from shop.timers import cancel_with, clock, schedule_with, timers
from timer_core import CancelTimer, CommandOutcome, ScheduleTimer

TENANT = "shop"
PAYMENT_WINDOW = timedelta(minutes=30)


class PaymentRefused(Exception):
    """The payment provider said no: the order and its timeout roll back."""


def place_order(
    order_id: str, *, window: timedelta = PAYMENT_WINDOW, refuse: bool = False
) -> Order:
    """Write the order and schedule its payment timeout, both or neither."""
    with transaction.atomic():
        order = Order.objects.create(id=order_id)
        due = clock.now() + window
        schedule_with(ScheduleTimer(TENANT, order_id, due, correlation_id=order_id))
        if refuse:
            raise PaymentRefused(order_id)
    return order


def pay_order(order_id: str) -> CommandOutcome:
    """Mark the order paid and cancel its timeout, both or neither."""
    with transaction.atomic():
        Order.objects.filter(id=order_id, status="unpaid").update(status="paid")
        return cancel_with(CancelTimer(TENANT, order_id))


def extend_payment_window(order_id: str, until: datetime) -> CommandOutcome:
    """Move an order's timeout, nothing else changing: one call, committed on its own."""
    return timers().schedule(TENANT, order_id, until, correlation_id=order_id)
