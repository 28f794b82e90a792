"""A Django project schedules payment timeouts inside its own ``transaction.atomic()`` through
``django.db.connection``, on SQLite and on PostgreSQL: rollback leaves no timer, commit fires it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest

from timer_adapters_memory import MemoryEventBus
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import CommandOutcome, Timer, TimerStore

_T = TypeVar("_T")


class DjangoThread:
    """One thread for the Django calls of a test: Django's ORM refuses to run on the event
    loop, and its connections are per thread (closed at the end)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="django")

    async def run(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: call(*args, **kwargs))

    async def close(self) -> None:
        from django.db import connections

        await self.run(connections.close_all)
        self._pool.shutdown()


def store_for(alias: str, location: str) -> TimerStore:
    """The timer store on the same database as Django's ``alias``."""
    if alias == "pg":
        return PostgresTimerStore(location, pool_size=2)
    return SqliteTimerStore(location)


@pytest.fixture(params=["default", "pg"], ids=["sqlite", "postgresql"])
async def shop(
    request: pytest.FixtureRequest, django_databases: dict[str, str]
) -> AsyncIterator[tuple[str, Timer, MemoryEventBus, DjangoThread]]:
    """A running Timer on the database of one Django alias, and a thread for Django calls."""
    alias = request.param
    bus = MemoryEventBus()
    django = DjangoThread()
    async with Timer(
        store_for(alias, django_databases[alias]), bus, polling_interval=60.0
    ) as timer:
        yield alias, timer, bus, django
    await django.close()


class TestDjangoTransactions:
    async def test_rollback_leaves_no_timer_and_commit_fires_it(
        self, shop: tuple[str, Timer, MemoryEventBus, DjangoThread], request: pytest.FixtureRequest
    ) -> None:
        """The refused order leaves neither row nor timer; the committed one fires at once."""
        from tests.django_host.shop.models import Order
        from tests.django_host.shop.orders import PaymentRefused, place_order

        alias, timer, bus, django = shop
        prefix = request.node.callspec.id
        refused, placed = f"{prefix}-refused", f"{prefix}-placed"
        now = datetime.now(UTC)
        with pytest.raises(PaymentRefused):
            await django.run(place_order, refused, now, using=alias, refuse=True)
        await django.run(place_order, placed, now, using=alias)
        # Well before the 60 s poll: the commit woke the worker (data_version / NOTIFY).
        (event,) = await bus.wait_for_published(1, timeout=20)
        assert event.payload.service_call_id == placed
        assert event.correlation_id == placed  # carried on the ScheduleTimer
        assert await timer.get("shop-1", refused) is None
        ids = await django.run(lambda: set(Order.objects.using(alias).values_list("id", flat=True)))
        assert placed in ids and refused not in ids

    async def test_paying_cancels_the_timeout_in_the_same_transaction(
        self, shop: tuple[str, Timer, MemoryEventBus, DjangoThread], request: pytest.FixtureRequest
    ) -> None:
        """An order paid before its timeout cancels the timer with the payment's own writes."""
        from tests.django_host.shop.orders import pay_order, place_order

        alias, timer, _, django = shop
        order = f"{request.node.callspec.id}-paid"
        await django.run(place_order, order, datetime.now(UTC) + timedelta(hours=1), using=alias)
        assert await django.run(pay_order, order, using=alias) is CommandOutcome.CANCELLED
        assert await timer.get("shop-1", order) is None

    async def test_outside_atomic_the_timer_is_refused_not_committed_alone(
        self, shop: tuple[str, Timer, MemoryEventBus, DjangoThread], request: pytest.FixtureRequest
    ) -> None:
        """In Django's autocommit mode scheduling raises instead of committing the timer alone."""
        from django.db import connections

        from timer_adapters_postgres import schedule_in_transaction as in_pg
        from timer_adapters_sqlite import schedule_in_transaction as in_sqlite
        from timer_core import ScheduleTimer, ValidationError

        alias, timer, _, django = shop
        order = f"{request.node.callspec.id}-autocommit"
        schedule = in_pg if alias == "pg" else in_sqlite
        now = datetime.now(UTC)

        def outside_atomic() -> None:
            schedule(connections[alias], ScheduleTimer("shop-1", order, now), now=now)

        with pytest.raises(ValidationError, match="autocommit"):
            await django.run(outside_atomic)
        assert await timer.get("shop-1", order) is None
