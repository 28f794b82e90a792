"""The in-memory stand-in for ``NatsBroker.due_events``: durable consumers of the events a
:class:`~timer_adapters_memory.MemoryEventBus` accepted, whose deliveries are acked, nak'd and
redelivered (with a delivery count) as JetStream's are, so a host tests its consumer's own
logic without NATS."""

from __future__ import annotations

import asyncio
import heapq
import logging
import re
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol, Self

import attrs

from timer_adapters_memory._waits import DEFAULT_TIMEOUT_S, within
from timer_core import (
    AsyncResource,
    DueTimeReached,
    EnvelopeId,
    MessageEnvelope,
    NotRunning,
    TenantId,
    ValidationError,
)

if TYPE_CHECKING:
    from timer_adapters_memory._bus import MemoryEventBus

__all__ = [
    "DueEventSettingsLike",
    "MemoryDueEventConsumer",
    "MemoryDueEventDelivery",
    "MemoryDueEventSettings",
]

log = logging.getLogger(__name__)

Settlement = Literal["ack", "nak", "term"]
Event = MessageEnvelope[DueTimeReached]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class DueEventSettingsLike(Protocol):
    """What a due-event consumer reads of its settings: the NATS adapter's
    ``DueEventConsumerSettings`` and :class:`MemoryDueEventSettings` both fit."""

    @property
    def deliver_policy(self) -> Literal["all", "new"]: ...

    @property
    def max_deliver(self) -> int: ...

    def nak_delay(self, delivery: int) -> float: ...


def _max_deliver(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value != -1 and value < 1:
        raise ValidationError(f"max_deliver must be -1 (unlimited) or at least 1, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValidationError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen
class MemoryDueEventSettings:
    """The settings of ``DueEventConsumerSettings`` that mean something in memory."""

    deliver_policy: Literal["all", "new"] = attrs.field(
        default="all", validator=attrs.validators.in_(("all", "new"))
    )
    """Where a consumer created now starts: every event published so far, or the next one."""
    max_deliver: int = attrs.field(default=-1, validator=_max_deliver)
    """Deliveries of one event before it is given up (listed in ``given_up``); -1 unlimited."""
    nak_delay_s: float = attrs.field(default=1.0, validator=_positive)
    """Redelivery delay after the first failed handling; it doubles with each delivery."""
    max_nak_delay_s: float = attrs.field(default=60.0, validator=_positive)
    """Cap of the doubling redelivery delay."""

    def nak_delay(self, delivery: int) -> float:
        """Redelivery delay after the ``delivery``-th delivery of an event failed."""
        return float(
            min(self.max_nak_delay_s, self.nak_delay_s * 2 ** min(max(delivery, 1) - 1, 30))
        )


class _Durable:
    """One durable consumer's place among the bus's events (kept by the bus, under its lock):
    where it is, what waits for redelivery, what was settled how."""

    def __init__(
        self, bus: MemoryEventBus, tenant_id: TenantId | None, settings: DueEventSettingsLike
    ) -> None:
        self.tenant_id = tenant_id
        self.settings = settings
        self.next_index = len(bus._published) if settings.deliver_policy == "new" else 0
        self.redeliver: list[tuple[float, int]] = []  # (ready at, monotonic; event index)
        self.deliveries: dict[int, int] = {}
        self.outstanding: set[int] = set()
        self.acked: list[EnvelopeId] = []
        self.terminated: list[EnvelopeId] = []
        self.given_up: list[EnvelopeId] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def published(self) -> None:
        """A new event was accepted (or one became ready again): wake the readers."""
        waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                same_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                same_loop = False
            if same_loop:
                event.set()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def waiter(self) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters.append((asyncio.get_running_loop(), event))
        return event

    def take(self, events: list[Event], now: float) -> tuple[int, Event, int] | None:
        """The next event to hand out (a redelivery that is ready first), or None."""
        if self.redeliver and self.redeliver[0][0] <= now:
            _, index = heapq.heappop(self.redeliver)
        else:
            index = -1
            while self.next_index < len(events):
                candidate = self.next_index
                self.next_index += 1
                if self.tenant_id is None or events[candidate].tenant_id == self.tenant_id:
                    index = candidate
                    break
            if index < 0:
                return None
        count = self.deliveries.get(index, 0) + 1
        self.deliveries[index] = count
        self.outstanding.add(index)
        return index, events[index], count

    def next_ready_at(self) -> float | None:
        return self.redeliver[0][0] if self.redeliver else None

    def settle(self, index: int, event: Event, how: Settlement, ready_at: float) -> None:
        self.outstanding.discard(index)
        if how == "ack":
            self.acked.append(event.id)
        elif how == "term":
            self.terminated.append(event.id)
        elif (
            self.settings.max_deliver != -1 and self.deliveries[index] >= self.settings.max_deliver
        ):
            self.given_up.append(event.id)
        else:
            heapq.heappush(self.redeliver, (ready_at, index))
            self.published()


class MemoryDueEventDelivery:
    """One delivery of a ``DueTimeReached`` event, settled exactly once: the stand-in for the
    NATS adapter's ``DueEventDelivery``, with the same attributes and the same
    ``async with delivery:`` rule (acked when the block ends normally; nak'd with the growing
    delay, logged and suppressed when it raises an ``Exception``; handed back at once when
    it is cancelled)."""

    def __init__(
        self, consumer: MemoryDueEventConsumer, index: int, envelope: Event, delivery: int
    ) -> None:
        self._consumer = consumer
        self._index = index
        self.envelope = envelope
        """The decoded envelope: id, timestamp, correlation id and the event."""
        self.num_delivered = delivery
        """How many times this event was handed to the consumer (1 the first time)."""
        self.settled: Settlement | None = None
        """How it was settled, or None while it is not."""

    @property
    def event(self) -> DueTimeReached:
        """The ``DueTimeReached`` payload."""
        return self.envelope.payload

    @property
    def id(self) -> EnvelopeId:
        """The envelope id: equal on every copy of the same firing (deduplicate on it)."""
        return self.envelope.id

    @property
    def redelivered(self) -> bool:
        """Whether this event was handed out before."""
        return self.num_delivered > 1

    @property
    def stream_sequence(self) -> int:
        """The event's place among the bus's accepted events (1 for the first)."""
        return self._index + 1

    @property
    def subject(self) -> str:
        """``<prefix>.events.<tenantId>.<serviceCallId>``, as the event was published."""
        event = self.event
        return (
            f"{self._consumer._bus.subject_prefix}.events.{event.tenant_id}.{event.service_call_id}"
        )

    async def ack(self) -> None:
        """Done with it: it is not delivered again."""
        self._settle("ack", 0.0)

    async def nak(self, delay: float | None = None) -> None:
        """Not handled: redelivered after ``delay`` seconds on the bus's clock (default: the
        settings' growing nak delay); given up after ``max_deliver`` deliveries."""
        if delay is None:
            delay = self._consumer.settings.nak_delay(self.num_delivered)
        self._settle("nak", delay)

    async def term(self) -> None:
        """Never deliver it again, though it was not handled (a poison event)."""
        self._settle("term", 0.0)

    async def in_progress(self) -> None:
        """Accepted for parity with NATS; in memory no ack wait runs out."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if exc is None:
            await self.ack()
            return False
        if not isinstance(exc, Exception):  # cancellation: hand it back at once
            self._settle("nak", 0.0)
            return False
        await self.nak()
        log.error(
            "handling DueTimeReached %s (%s/%s, delivery %d) failed; %s",
            self.id,
            self.event.tenant_id,
            self.event.service_call_id,
            self.num_delivered,
            "redelivery later" if self.settled == "nak" else f"settled: {self.settled}",
            exc_info=exc,
        )
        return True

    def _settle(self, how: Settlement, delay: float) -> None:
        if self.settled is not None:
            return
        self.settled = how
        self._consumer._settle(self, how, delay)

    def __repr__(self) -> str:
        return (
            f"<MemoryDueEventDelivery {self.id} {self.event.tenant_id}/"
            f"{self.event.service_call_id} delivery {self.num_delivered}>"
        )


class MemoryDueEventConsumer(AsyncResource):
    """The events of a durable consumer on a :class:`MemoryEventBus`, one delivery at a time.

    Made by :meth:`MemoryEventBus.due_events`. Like JetStream's: the consumer ``name`` is
    created on first use (from ``settings.deliver_policy``) and keeps its place across
    ``async with`` blocks; several readers of one name share its events (each goes to one);
    a nak'd event comes back after its delay on the bus's clock, with ``num_delivered`` one
    higher, before newer events; one never settled when its reader leaves is handed back at
    once (as after JetStream's ack wait). :attr:`acked`, :attr:`terminated` and
    :attr:`given_up` (``max_deliver`` reached) list what was settled how.
    ``async for`` waits for events as long as it takes; :meth:`get` fails with
    :class:`~timer_core.errors.WaitTimedOut` after its timeout.
    """

    def __init__(
        self,
        bus: MemoryEventBus,
        name: str,
        *,
        tenant_id: str | None = None,
        settings: DueEventSettingsLike | None = None,
    ) -> None:
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise ValidationError(
                f"consumer name must be 1-64 characters of [A-Za-z0-9_-], got {name!r}"
            )
        self.name = name
        self.tenant_id = None if tenant_id is None else TenantId(tenant_id)
        self.settings: DueEventSettingsLike = (
            settings if settings is not None else MemoryDueEventSettings()
        )
        self._bus = bus
        self._durable: _Durable | None = None
        self._held: dict[int, MemoryDueEventDelivery] = {}
        self._stop = asyncio.Event()

    @property
    def acked(self) -> list[EnvelopeId]:
        """Ids of the events acked on this durable consumer, in order."""
        return list(self._state().acked)

    @property
    def terminated(self) -> list[EnvelopeId]:
        """Ids of the events terminated (``term``) on this durable consumer."""
        return list(self._state().terminated)

    @property
    def given_up(self) -> list[EnvelopeId]:
        """Ids of the events nak'd on their ``max_deliver``-th delivery: never delivered again."""
        return list(self._state().given_up)

    @property
    def pending(self) -> int:
        """Events not settled yet: handed out, waiting for redelivery, or not yet read."""
        durable = self._state()
        with self._bus._lock:
            unread = sum(
                1
                for event in self._bus._published[durable.next_index :]
                if self.tenant_id is None or event.tenant_id == self.tenant_id
            )
            return unread + len(durable.outstanding) + len(durable.redeliver)

    def _state(self) -> _Durable:
        if self._durable is None:
            raise NotRunning(
                f"due-event consumer {self.name} is not started: "
                "use `async with bus.due_events(...)`"
            )
        return self._durable

    async def start(self) -> None:
        """Create the durable consumer on first use (else join it); idempotent."""
        if self._durable is not None:
            return
        bus = self._bus
        with bus._lock:
            durable = bus._durables.get(self.name)
            if durable is None:
                durable = bus._durables[self.name] = _Durable(bus, self.tenant_id, self.settings)
        self._durable = durable
        self._stop.clear()

    async def stop(self) -> None:
        """End the iteration: a pending ``__anext__`` returns at once."""
        self._stop.set()
        if self._durable is not None:
            with self._bus._lock:
                self._durable.published()

    async def aclose(self) -> None:
        """Hand back the deliveries this reader left unsettled; idempotent."""
        self._stop.set()
        for delivery in list(self._held.values()):
            delivery._settle("nak", 0.0)
        self._held.clear()
        self._durable = None

    def __aiter__(self) -> AsyncIterator[MemoryDueEventDelivery]:
        return self

    async def __anext__(self) -> MemoryDueEventDelivery:
        delivery = await self._next()
        if delivery is None:
            raise StopAsyncIteration
        return delivery

    async def get(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> MemoryDueEventDelivery:
        """The next delivery; :class:`~timer_core.errors.WaitTimedOut` when none came within
        ``timeout`` real seconds, ``EOFError`` once stopped."""
        delivery = await within(self._next(), timeout, self._nothing_to_deliver)
        if delivery is None:
            raise EOFError(f"due-event consumer {self.name} was stopped")
        return delivery

    def _nothing_to_deliver(self) -> str:
        durable = self._durable
        waiting = 0 if durable is None else len(durable.redeliver)
        return (
            f"consumer {self.name} waited for a delivery; {waiting} nak'd event(s) wait for "
            f"their redelivery delay. {self._bus._nothing_published()}"
        )

    async def _next(self) -> MemoryDueEventDelivery | None:
        bus = self._bus
        while not self._stop.is_set():
            durable = self._state()
            with bus._lock:
                taken = durable.take(bus._published, bus.clock.monotonic())
                if taken is None:
                    woken = durable.waiter()
                    ready_at = durable.next_ready_at()
            if taken is not None:
                index, envelope, count = taken
                delivery = MemoryDueEventDelivery(self, index, envelope, count)
                self._held[index] = delivery
                return delivery
            waits: set[asyncio.Future[object]] = {
                asyncio.ensure_future(woken.wait()),
                asyncio.ensure_future(self._stop.wait()),
            }
            if ready_at is not None:
                waits.add(asyncio.ensure_future(bus.clock.sleep(ready_at - bus.clock.monotonic())))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
        return None

    def _settle(self, delivery: MemoryDueEventDelivery, how: Settlement, delay: float) -> None:
        self._held.pop(delivery._index, None)
        bus = self._bus
        durable = self._durable or bus._durables[self.name]
        with bus._lock:
            durable.settle(
                delivery._index, delivery.envelope, how, bus.clock.monotonic() + max(0.0, delay)
            )
