"""The memory adapters bound to the shipped conformance suites."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timer_adapters_memory import MemoryEventBus, MemoryTimerStore
from timer_core import DueTimeReached, MessageEnvelope, TimerStore
from timer_core.testing import EventPublisherContract, PublisherHarness, TimerStoreContract


class TestMemoryTimerStoreContract(TimerStoreContract):
    """MemoryTimerStore keeps every promise of the TimerStore port."""

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        storage = MemoryTimerStore()
        return lambda: MemoryTimerStore(shared_with=storage)


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
