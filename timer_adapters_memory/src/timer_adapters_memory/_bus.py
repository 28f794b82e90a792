"""An event bus held in process memory: publish, subscribe, and inspect what was published."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from timer_adapters_memory._waits import DEFAULT_TIMEOUT_S, within
from timer_core import (
    Clock,
    DecodeError,
    DueTimeReached,
    EventPublisher,
    MessageEnvelope,
    PublishError,
    SystemClock,
)
from timer_core.codec import decode_event, encode_envelope

if TYPE_CHECKING:
    from timer_adapters_memory._due_events import (
        DueEventSettingsLike,
        MemoryDueEventConsumer,
        _Durable,
    )

__all__ = ["MemoryEventBus", "MemorySubscription"]

log = logging.getLogger(__name__)

Event = MessageEnvelope[DueTimeReached]


class MemorySubscription:
    """The envelopes a :class:`MemoryEventBus` accepted after :meth:`MemoryEventBus.subscribe`.

    Iterate it with ``async for`` (ends after :meth:`close`) or ``await`` :meth:`get`.
    """

    def __init__(self, bus: MemoryEventBus) -> None:
        self._bus = bus
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._closed = False

    async def get(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Event:
        """The next envelope, waiting for one; raises ``EOFError`` once closed and empty, and
        :class:`~timer_core.errors.WaitTimedOut` when none came within ``timeout`` real
        seconds (None: wait forever). ``async for`` waits without a timeout."""
        if self._closed and self._queue.empty():
            raise EOFError("subscription closed")
        envelope = await within(self._queue.get(), timeout, self._bus._nothing_published)
        if envelope is None:
            raise EOFError("subscription closed")
        return envelope

    def close(self) -> None:
        """Stop receiving; envelopes already queued can still be read."""
        if not self._closed:
            self._closed = True
            self._bus._unsubscribe(self)
            self._deliver(None)

    def _deliver(self, envelope: Event | None) -> None:
        try:
            same_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            self._queue.put_nowait(envelope)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, envelope)

    def __aiter__(self) -> MemorySubscription:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.get(timeout=None)
        except EOFError:
            raise StopAsyncIteration from None


class MemoryEventBus(EventPublisher):
    """An in-memory, thread-safe :class:`~timer_core.ports.EventPublisher` with a broker's habits.

    Every envelope goes through the wire codec, so what is kept is exactly what a consumer
    would decode. An envelope whose id was already accepted is acknowledged and dropped, like
    JetStream's duplicate window (unless ``deduplicate=False``). Failures are injected with
    :meth:`fail_next`, :meth:`fail_when` and :meth:`set_unavailable`; they come back as
    :class:`~timer_core.errors.PublishError` results, never as exceptions from
    :meth:`publish_many`.

    A host's consumer of ``DueTimeReached`` is tested with :meth:`due_events`, the stand-in
    for ``NatsBroker.due_events``: durable consumers whose deliveries are acked, nak'd
    (redelivered after a delay on ``clock``) and terminated as JetStream's are. Events are
    published on ``<subject_prefix>.events.<tenantId>.<serviceCallId>``. Every wait
    (:meth:`wait_for_published`, :meth:`MemorySubscription.get`) has a timeout and fails with
    :class:`~timer_core.errors.WaitTimedOut` instead of hanging.
    """

    def __init__(
        self,
        *,
        deduplicate: bool = True,
        clock: Clock | None = None,
        subject_prefix: str = "timer",
    ) -> None:
        self._deduplicate = deduplicate
        self.clock: Clock = clock or SystemClock()
        """The clock nak delays are counted on (a ``FakeClock`` in tests moves them by hand)."""
        self.subject_prefix = subject_prefix
        self._lock = threading.Lock()
        self._published: list[Event] = []
        self._attempts: list[Event] = []
        self._seen: set[str] = set()
        self._duplicates = 0
        self._failures_left = 0
        self._fail_when: Callable[[Event], bool] | None = None
        self._unavailable = False
        self._subscribers: list[MemorySubscription] = []
        self._durables: dict[str, _Durable] = {}

    @property
    def published(self) -> list[Event]:
        """The accepted envelopes, in the order the bus accepted them (a copy)."""
        with self._lock:
            return list(self._published)

    @property
    def publish_attempts(self) -> list[Event]:
        """Every envelope offered to the bus, failed and duplicate ones included (a copy)."""
        with self._lock:
            return list(self._attempts)

    @property
    def duplicates(self) -> int:
        """How many offered envelopes were dropped as duplicates of an accepted id."""
        with self._lock:
            return self._duplicates

    def fail_next(self, count: int) -> None:
        """Refuse the next ``count`` envelopes offered."""
        with self._lock:
            self._failures_left = count

    def fail_when(self, predicate: Callable[[Event], bool] | None) -> None:
        """Refuse every envelope for which ``predicate`` is true (None: stop refusing)."""
        with self._lock:
            self._fail_when = predicate

    def set_unavailable(self, flag: bool) -> None:
        """While ``flag`` is true, refuse everything, like a broker that is down."""
        with self._lock:
            self._unavailable = flag

    def subscribe(self) -> MemorySubscription:
        """Receive every envelope accepted from now on (call it on the loop that reads)."""
        subscription = MemorySubscription(self)
        with self._lock:
            self._subscribers.append(subscription)
        return subscription

    async def wait_for_published(
        self, count: int, *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> list[Event]:
        """Wait until at least ``count`` envelopes were accepted; returns them all.

        Raises :class:`~timer_core.errors.WaitTimedOut` after ``timeout`` real seconds (None:
        wait forever), saying how many were published and, when ``clock`` is a
        ``FakeClock``, who sleeps on it (a Timer on a fake clock fires only once the test
        advances it).
        """
        subscription = self.subscribe()

        async def enough() -> None:
            while len(self.published) < count:
                await subscription.get(timeout=None)

        try:
            await within(enough(), timeout, lambda: self._nothing_published(count))
        finally:
            subscription.close()
        return self.published

    def due_events(
        self,
        name: str,
        *,
        tenant_id: str | None = None,
        settings: DueEventSettingsLike | None = None,
    ) -> MemoryDueEventConsumer:
        """The ``DueTimeReached`` events of the durable consumer ``name``: the in-memory
        stand-in for ``NatsBroker.due_events`` (the same arguments; ``settings`` may be the
        NATS adapter's ``DueEventConsumerSettings`` or :class:`MemoryDueEventSettings`).

        ``async with bus.due_events("billing") as events: async for delivery in events:
        async with delivery: ...``; see :class:`MemoryDueEventConsumer`.
        """
        from timer_adapters_memory._due_events import MemoryDueEventConsumer

        return MemoryDueEventConsumer(self, name, tenant_id=tenant_id, settings=settings)

    def _nothing_published(self, count: int | None = None) -> str:
        with self._lock:
            published, offered = len(self._published), len(self._attempts)
        wanted = "an event" if count is None else f"{count} published event(s)"
        return (
            f"waited for {wanted}; {published} published ({offered - published} offered and "
            f"refused or duplicate). {_clock_hint(self.clock)}"
        )

    def _unsubscribe(self, subscription: MemorySubscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    @property
    def keeps_call_order(self) -> bool:
        """True: each call takes all its envelopes at once, calls in the order they were made."""
        return True

    async def publish_many(self, envelopes: Sequence[Event]) -> list[PublishError | None]:
        # Yield like a network round trip would, so concurrent callers interleave.
        await asyncio.sleep(0)
        results: list[PublishError | None] = []
        with self._lock:
            for envelope in envelopes:
                results.append(self._offer(envelope))
        return results

    def _offer(self, envelope: Event) -> PublishError | None:
        """Accept or refuse one envelope; called with the lock held."""
        self._attempts.append(envelope)
        if self._unavailable:
            return PublishError(f"event {envelope.id}: the memory bus is unavailable")
        if self._failures_left > 0:
            self._failures_left -= 1
            return PublishError(f"event {envelope.id}: refused on purpose (fail_next)")
        if self._fail_when is not None and self._fail_when(envelope):
            return PublishError(f"event {envelope.id}: refused on purpose (fail_when)")
        try:
            wire = decode_event(encode_envelope(envelope))
        except DecodeError as exc:
            return PublishError(f"event {envelope.id} is not a valid DueTimeReached: {exc}")
        if self._deduplicate and wire.id in self._seen:
            self._duplicates += 1
            log.debug("dropped duplicate event %s", wire.id)
            return None
        self._seen.add(wire.id)
        self._published.append(wire)
        for subscription in self._subscribers:
            subscription._deliver(wire)
        for durable in self._durables.values():
            durable.published()
        return None


def _clock_hint(clock: Clock) -> str:
    """Who sleeps on ``clock`` when it is a ``FakeClock``: the usual reason nothing fired."""
    describe = getattr(clock, "describe_sleepers", None)
    if describe is None:
        return "Is the Timer started, and is anything due yet?"
    return f"A Timer on a FakeClock fires only once the test advances it; {describe()}."
