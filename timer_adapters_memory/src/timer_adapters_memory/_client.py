"""A stand-in for ``TimerClient`` in a host's tests: the same calls, driving an in-memory Timer."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from types import TracebackType
from typing import Self

from timer_adapters_memory._bus import MemoryEventBus
from timer_adapters_memory._clock import FakeClock
from timer_adapters_memory._commands import MemoryCommandSource
from timer_adapters_memory._store import MemoryTimerStore
from timer_core import (
    CancelTimer,
    Command,
    EnvelopeId,
    EnvelopeIdGenerator,
    MessageEnvelope,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    Timer,
    Uuid7EnvelopeIds,
    command_envelope,
)

__all__ = ["MemoryTimerClient"]


class MemoryTimerClient:
    """A :class:`~timer_core.TimerScheduler` over a real in-memory :class:`~timer_core.Timer`.

    A host's code that schedules through a ``TimerScheduler`` (``TimerClient`` in
    production) runs in its tests against this client, with no broker and no waiting::

        async with MemoryTimerClient() as timers:
            await book_order(timers)                        # the host's code schedules
            timers.clock.advance(timedelta(minutes=30))     # time passes, at once
            (event,) = await timers.bus.wait_for_published(1)

    Commands go the way ``TimerClient``'s do: built and validated the same way (a bad id or
    due time raises :class:`~timer_core.errors.ValidationError` before anything is sent),
    encoded, decoded and stored by the Timer's command loop. Unlike over NATS, ``schedule``
    and ``cancel`` return only once the Timer has stored the command, so a test can move
    the clock straight after. The parts are attributes: :attr:`clock` (a
    :class:`FakeClock`), :attr:`bus` (what was published), :attr:`store`, :attr:`commands`
    and :attr:`timer`; pass your own to share them.
    """

    def __init__(
        self,
        *,
        clock: FakeClock | None = None,
        store: MemoryTimerStore | None = None,
        bus: MemoryEventBus | None = None,
        polling_interval: float = 5.0,
        batch_size: int = 100,
        retention: timedelta | None = None,
        ids: EnvelopeIdGenerator | None = None,
    ) -> None:
        self.clock = clock or FakeClock()
        self.store = store or MemoryTimerStore()
        self.bus = bus or MemoryEventBus()
        self.commands = MemoryCommandSource(batch_size=batch_size)
        self.timer = Timer(
            self.store,
            self.bus,
            commands=self.commands,
            clock=self.clock,
            polling_interval=polling_interval,
            batch_size=batch_size,
            retention=retention,
        )
        self._ids = ids or Uuid7EnvelopeIds()

    async def start(self) -> None:
        """Start the Timer (store, bus, worker, command loop)."""
        await self.timer.start()

    async def aclose(self) -> None:
        """Stop the Timer; raises what :meth:`Timer.aclose` raises."""
        await self.timer.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.timer.__aexit__(exc_type, exc, tb)

    async def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> EnvelopeId:
        """Ask for ``DueTimeReached`` at ``due_at`` (aware); returns once it is stored."""
        payload = ScheduleTimer(TenantId(tenant_id), ServiceCallId(service_call_id), due_at)
        return await self._send(payload, correlation_id, causation_id)

    async def cancel(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> EnvelopeId:
        """Cancel the timer if it has not fired yet (a no-op otherwise); returns once done."""
        payload = CancelTimer(TenantId(tenant_id), ServiceCallId(service_call_id))
        return await self._send(payload, correlation_id, causation_id)

    async def _send(
        self,
        payload: ScheduleTimer | CancelTimer,
        correlation_id: str | None,
        causation_id: str | None,
    ) -> EnvelopeId:
        envelope: MessageEnvelope[Command] = command_envelope(
            payload,
            self._ids.new_id(),
            self.clock.now(),
            correlation_id=correlation_id,
            causation_id=causation_id,
        )
        if not self.timer.health().running:
            raise RuntimeError(
                "this MemoryTimerClient is not running: use `async with MemoryTimerClient():`"
            )
        self.commands.send(envelope)
        stored = asyncio.ensure_future(self.commands.wait_until_drained())
        failed = asyncio.ensure_future(self.timer.wait())
        try:
            await asyncio.wait({stored, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stored.cancel()
            failed.cancel()
        if not stored.done() or stored.cancelled():
            failed.result()  # the Timer's failure, if that is what ended the wait
            raise RuntimeError("the MemoryTimerClient was closed before the command was stored")
        return envelope.id
