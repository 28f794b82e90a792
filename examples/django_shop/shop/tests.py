"""The shop's tests, run by Django's test runner (``python manage.py test shop``) on a test
database Django migrates, Timer's tables included: orders and their timeouts commit or roll
back together, the ``run_timer`` command expires an unpaid order, and a timeout moved outside
any transaction fires at its new time."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from django.db import connection, connections
from django.test import TransactionTestCase

from shop.models import Order
from shop.orders import PaymentRefused, extend_payment_window, pay_order, place_order
from shop.timers import clock, close_timers, expire_order, timer_database, timer_store
from timer_core import CommandOutcome, Timer

MANAGE = Path(__file__).resolve().parent.parent / "manage.py"


def wait_for(condition: Callable[[], bool], what: str, budget: float = 20.0) -> None:
    """Until ``condition()`` holds (what it means: the order's row changed), or fail."""
    deadline = time.monotonic() + budget
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {budget} s for {what}")
        time.sleep(0.02)


def status(order_id: str) -> str:
    return Order.objects.get(id=order_id).status


def fire_until(condition: Callable[[], bool], what: str) -> None:
    """Run a Timer with the shop's handler on the test database until ``condition()``."""

    def watch() -> None:
        try:
            wait_for(condition, what)
        finally:
            connections.close_all()  # this thread's own, as a finished request's

    async def run() -> None:
        async with Timer(timer_store(), handler=expire_order, polling_interval=60.0):
            await asyncio.to_thread(watch)

    asyncio.run(run())


class TestOrdersAndTheirTimeouts(TransactionTestCase):
    """TransactionTestCase: the shop's transactions really commit, as the Timer (another
    connection, or another process) must see them."""

    @classmethod
    def tearDownClass(cls) -> None:
        close_timers()  # its connections would keep the test database from being dropped
        super().tearDownClass()

    def test_the_migration_made_timers_table(self) -> None:
        """``migrate`` created Timer's tables beside the shop's, through Django's migrations."""
        tables = connection.introspection.table_names()
        assert "shop_order" in tables and "timer_schedules" in tables

    def test_an_unpaid_order_expires_and_a_paid_one_does_not(self) -> None:
        """The timeout scheduled with the order fires and expires it; paying first cancels
        the timeout in the payment's own transaction."""
        place_order("order-1", window=timedelta(milliseconds=200))
        place_order("order-2", window=timedelta(milliseconds=200))
        assert pay_order("order-2") is CommandOutcome.CANCELLED
        fire_until(lambda: status("order-1") == "expired", "order-1 to expire")
        assert status("order-2") == "paid"

    def test_a_refused_order_leaves_no_order_and_no_timer(self) -> None:
        """The rolled-back block leaves neither the row nor its timeout."""
        with self.assertRaises(PaymentRefused):
            place_order("order-3", refuse=True)
        assert not Order.objects.filter(id="order-3").exists()

        async def timer_of_order_3() -> object:
            async with timer_store() as store:
                return await store.get("shop", "order-3")

        assert asyncio.run(timer_of_order_3()) is None

    def test_a_timeout_moved_outside_a_transaction_fires_at_its_new_time(self) -> None:
        """``extend_payment_window`` commits on its own (no atomic block): the Timer sees the
        new due time and expires the order then, not at the old one."""
        place_order("order-4", window=timedelta(hours=1))
        new_due = clock.now() + timedelta(milliseconds=200)
        assert extend_payment_window("order-4", new_due) is CommandOutcome.SCHEDULED
        fire_until(lambda: status("order-4") == "expired", "order-4 to expire")
        assert clock.now() >= new_due

    def test_the_run_timer_command_expires_an_unpaid_order(self) -> None:
        """``manage.py run_timer``, a process beside the web workers, fires the timeout of an
        order placed here and stops cleanly on SIGTERM."""
        vendor, where = timer_database()  # the test database, which the process must use
        env = {**os.environ, ("SHOP_DB" if vendor == "sqlite" else "SHOP_DATABASE_URL"): where}
        process = subprocess.Popen(
            [sys.executable, str(MANAGE), "run_timer", "--polling-interval", "60"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert process.stdout is not None
            assert "firing timers" in process.stdout.readline()
            place_order("order-5", window=timedelta(milliseconds=200))
            wait_for(lambda: status("order-5") == "expired", "order-5 to expire")
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
