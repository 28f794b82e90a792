"""A publisher that watches another: when each event was accepted, and when all were. It
imports only ``timer_core``, so a measuring child on an earlier commit's packages
(``--baseline-ref``) can use it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from timer_core import (
    DueTimeReached,
    EventPublisher,
    MessageEnvelope,
    PublishError,
    SystemClock,
    TimerStore,
    TimerWorker,
)


class WatchedPublisher(EventPublisher):
    """Another publisher's ``publish_many``, noting the wall-clock time each event was
    accepted; ``done`` is set once ``expected`` were."""

    def __init__(self, inner: EventPublisher, expected: int) -> None:
        self.inner = inner
        self.expected = expected
        self.received: list[tuple[float, MessageEnvelope[DueTimeReached]]] = []
        self.done = asyncio.Event()

    @property
    def keeps_call_order(self) -> bool:
        return self.inner.keeps_call_order

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        results = await self.inner.publish_many(envelopes)
        now = time.time()
        self.received += [(now, e) for e, r in zip(envelopes, results, strict=True) if r is None]
        if len(self.received) >= self.expected:
            self.done.set()
        return results

    async def fire_all(self, store: TimerStore, *, batch: int, **options: Any) -> float:
        """Run a ``TimerWorker`` until every expected event was accepted; the seconds taken."""
        worker = TimerWorker(store, self, SystemClock(), batch_size=batch, **options)
        started = time.perf_counter()
        running = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(self.done.wait(), 600)
        finally:
            worker.stop()
            await running
        return time.perf_counter() - started
