"""The memory adapters bound to the shipped conformance suites."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_core import DueTimeReached, MessageEnvelope, TimerStore
from timer_core.testing import (
    EventPublisherContract,
    FindsDueByTenantContract,
    PublisherHarness,
    TimerCensusContract,
    TimerStoreContract,
    TimerStoreLeaseContract,
)


class TestMemoryTimerStoreContract(TimerStoreContract, FindsDueByTenantContract):
    """MemoryTimerStore keeps every promise of the TimerStore port."""

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        storage = MemoryTimerStore()
        return lambda: MemoryTimerStore(shared_with=storage)


class TestMemoryTimerCensusContract(TimerCensusContract):
    """MemoryTimerStore keeps the promises of the census and look-up capabilities."""

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        return MemoryTimerStore


class TestMemoryTimerStoreLeaseContract(TimerStoreLeaseContract):
    """MemoryTimerStore in its leasing mode keeps the lease promise, on a fake clock."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock(datetime(2030, 1, 1, tzinfo=UTC))

    @pytest.fixture
    def make_leasing_store(self, clock: FakeClock) -> Callable[[float], TimerStore]:
        storage = MemoryTimerStore()
        return lambda lease_s: MemoryTimerStore(shared_with=storage, lease_s=lease_s, clock=clock)

    @pytest.fixture
    def let_time_pass(self, clock: FakeClock) -> Callable[[float], Awaitable[None]]:
        async def advance(seconds: float) -> None:
            clock.advance(seconds)

        return advance


class TestMemoryEventBusContract(EventPublisherContract):
    """MemoryEventBus keeps every promise of the EventPublisher port."""

    @pytest.fixture
    def make_publisher(self) -> PublisherHarness:
        bus = MemoryEventBus()

        async def published() -> list[MessageEnvelope[DueTimeReached]]:
            return bus.published

        async def break_broker() -> None:
            bus.set_unavailable(True)

        return PublisherHarness(publisher=bus, published=published, break_broker=break_broker)
