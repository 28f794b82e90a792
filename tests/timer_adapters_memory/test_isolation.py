"""The memory store bound to the shipped isolation suite (issue 42)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timer_adapters_memory import MemoryTimerStore
from timer_core import TimerStore
from timer_core.testing import LeasingIsolationContract, TimerIsolationContract


class TestMemoryIsolation(TimerIsolationContract):
    """A Timer on the memory store keeps one timer's and one tenant's trouble their own."""

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        storage = MemoryTimerStore()
        return lambda: MemoryTimerStore(shared_with=storage)


class TestLeasingMemoryIsolation(LeasingIsolationContract):
    """The memory store in its leasing mode gives back the claims of held-back timers."""

    @pytest.fixture
    def make_store(self) -> Callable[[], TimerStore]:
        storage = MemoryTimerStore()
        return lambda: MemoryTimerStore(shared_with=storage, lease_s=300.0)
