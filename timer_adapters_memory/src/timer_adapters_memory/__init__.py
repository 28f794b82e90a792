"""In-memory Timer adapters (store, event bus, command source), a hand-driven ``FakeClock``,
``MemoryTimerClient``, a ``TimerClient`` stand-in for a host's tests, and
``MemoryEventBus.due_events``, a stand-in for ``NatsBroker.due_events``.

They are real adapters: thread-safe, raising :mod:`timer_core.errors` like any other, and
passing the conformance suite in :mod:`timer_core.testing`; tests and demos wire them in
place of SQLite and NATS.
"""

from timer_adapters_memory._bus import MemoryEventBus, MemorySubscription
from timer_adapters_memory._client import MemoryTimerClient
from timer_adapters_memory._clock import FakeClock
from timer_adapters_memory._commands import MemoryCommandSource
from timer_adapters_memory._due_events import (
    MemoryDueEventConsumer,
    MemoryDueEventDelivery,
    MemoryDueEventSettings,
)
from timer_adapters_memory._store import LeasingMemoryTimerStore, MemoryTimerStore

__all__ = [
    "FakeClock",
    "MemoryCommandSource",
    "MemoryDueEventConsumer",
    "MemoryDueEventDelivery",
    "MemoryDueEventSettings",
    "MemoryEventBus",
    "MemoryTimerClient",
    "LeasingMemoryTimerStore",
    "MemoryTimerStore",
    "MemorySubscription",
]
