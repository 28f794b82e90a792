"""A stand-in for ``TimerClient`` in a host's tests: the same calls, driving an in-memory Timer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Self, TypeVar, cast

from timer_adapters_memory._bus import MemoryEventBus
from timer_adapters_memory._clock import FakeClock
from timer_adapters_memory._commands import MemoryCommandSource
from timer_adapters_memory._store import MemoryTimerStore
from timer_adapters_memory._waits import DEFAULT_TIMEOUT_S, within
from timer_core import (
    CancelTimer,
    Command,
    DueTimeReached,
    EnvelopeId,
    EnvelopeIdGenerator,
    MessageEnvelope,
    NotRunning,
    PublishError,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    Timer,
    TraceContext,
    Uuid7EnvelopeIds,
    WaitTimedOut,
    command_envelope,
)
from timer_core.instants import format_timestamp

__all__ = ["MemoryTimerClient"]

_C = TypeVar("_C", ScheduleTimer, CancelTimer)
_CommandEnvelope = (
    MessageEnvelope[ScheduleTimer] | MessageEnvelope[CancelTimer] | MessageEnvelope[Command]
)


class MemoryTimerClient:
    """A :class:`~timer_core.TimerScheduler` over a real in-memory :class:`~timer_core.Timer`.

    A host's code that schedules through a ``TimerScheduler`` (``TimerClient`` in
    production) runs in its tests against this client, with no broker and no waiting::

        async with MemoryTimerClient() as timers:
            await book_order(timers)                        # the host's code schedules
            timers.clock.advance(timedelta(minutes=30))     # time passes, at once
            (event,) = await timers.wait_for_published(1)

    It has ``TimerClient``'s calls (``schedule``, ``cancel``, ``schedule_envelope``,
    ``cancel_envelope``, ``send``, ``send_many``) with the same arguments and results.
    Commands are built and validated the same way (a bad id or due time raises
    :class:`~timer_core.errors.ValidationError` before anything is sent), encoded, decoded
    and stored by the Timer's command loop. Unlike over NATS, a call returns only once the
    Timer has stored the command, so a test can move the clock straight after.

    Every wait has a timeout (real seconds) and fails with
    :class:`~timer_core.errors.WaitTimedOut` saying what it waited for:
    :meth:`wait_for_published` (forgot ``clock.advance``? the message says who sleeps on
    the clock) and :meth:`wait_until_idle`, after which ``assert timers.bus.published ==
    []`` means that nothing due by now fired. The parts are attributes: :attr:`clock` (a
    :class:`FakeClock`), :attr:`bus` (what was published; ``bus.due_events(...)`` stands in
    for ``NatsBroker.due_events``), :attr:`store`, :attr:`commands` and :attr:`timer`; pass
    your own to share them.
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
        self.bus = bus or MemoryEventBus(clock=self.clock)
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

    # -- TimerClient's calls ------------------------------------------------------------

    def schedule_envelope(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_context: TraceContext | None = None,
    ) -> MessageEnvelope[ScheduleTimer]:
        """The ``ScheduleTimer`` envelope :meth:`schedule` would send (validated)."""
        payload = ScheduleTimer(TenantId(tenant_id), ServiceCallId(service_call_id), due_at)
        return self._envelope(payload, correlation_id, causation_id, trace_context)

    def cancel_envelope(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> MessageEnvelope[CancelTimer]:
        """The ``CancelTimer`` envelope :meth:`cancel` would send (validated)."""
        payload = CancelTimer(TenantId(tenant_id), ServiceCallId(service_call_id))
        return self._envelope(payload, correlation_id, causation_id)

    async def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_context: TraceContext | None = None,
    ) -> EnvelopeId:
        """Ask for ``DueTimeReached`` at ``due_at`` (aware); returns once it is stored."""
        envelope = self.schedule_envelope(
            tenant_id,
            service_call_id,
            due_at,
            correlation_id=correlation_id,
            causation_id=causation_id,
            trace_context=trace_context,
        )
        return await self.send(envelope)

    async def cancel(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> EnvelopeId:
        """Cancel the timer if it has not fired yet (a no-op otherwise); returns once done."""
        envelope = self.cancel_envelope(
            tenant_id, service_call_id, correlation_id=correlation_id, causation_id=causation_id
        )
        return await self.send(envelope)

    async def send(self, envelope: _CommandEnvelope) -> EnvelopeId:
        """Hand a prepared command envelope to the Timer; returns its id once it is stored."""
        (error,) = await self.send_many([envelope])
        if error is not None:
            raise error
        return envelope.id

    async def send_many(self, envelopes: Sequence[_CommandEnvelope]) -> list[PublishError | None]:
        """Hand many commands over in order; one result per envelope (None: stored) once the
        Timer has stored them all."""
        if not self.timer.health().running:
            raise NotRunning(
                "this MemoryTimerClient is not running: use `async with MemoryTimerClient():`"
            )
        for envelope in envelopes:
            self.commands.send(cast(MessageEnvelope[Command], envelope))
        stored = asyncio.ensure_future(self.commands.wait_until_drained(timeout=None))
        failed = asyncio.ensure_future(self.timer.wait())
        try:
            await within(
                asyncio.wait({stored, failed}, return_when=asyncio.FIRST_COMPLETED),
                DEFAULT_TIMEOUT_S,
                lambda: f"waited for the Timer to store {len(envelopes)} command(s)",
            )
        finally:
            stored.cancel()
            failed.cancel()
        if not stored.done() or stored.cancelled():
            failed.result()  # the Timer's failure, if that is what ended the wait
            raise NotRunning("the MemoryTimerClient was closed before the command was stored")
        return [None] * len(envelopes)

    # -- waits for a test ---------------------------------------------------------------

    async def wait_for_published(
        self, count: int, *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> list[MessageEnvelope[DueTimeReached]]:
        """Wait until at least ``count`` events were published; returns them all.

        Raises :class:`~timer_core.errors.WaitTimedOut` after ``timeout`` real seconds, with
        who sleeps on the fake clock (the usual cause: a test that did not advance it).
        """
        try:
            return await self.bus.wait_for_published(count, timeout=timeout)
        except WaitTimedOut as exc:
            next_due = await self.store.next_due_at()
            if next_due is None:
                raise
            ahead = (next_due - self.clock.now()).total_seconds()
            raise WaitTimedOut(
                f"{exc} The next timer is due at {format_timestamp(next_due)}, "
                f"{ahead:g} s after the fake clock's now: clock.advance({max(ahead, 0):g})?"
            ) from None

    async def wait_until_idle(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        """Return once every command sent is stored and the Timer has fired everything due
        by the fake clock's now: then ``timers.bus.published`` is what fired, no more to
        come until the clock moves. :class:`~timer_core.errors.WaitTimedOut` after
        ``timeout`` real seconds."""
        await self.commands.wait_until_drained(timeout=timeout)
        await self.timer.wait_until_idle(timeout=timeout)

    def _envelope(
        self,
        payload: _C,
        correlation_id: str | None,
        causation_id: str | None,
        trace_context: TraceContext | None = None,
    ) -> MessageEnvelope[_C]:
        return command_envelope(
            payload,
            self._ids.new_id(),
            self.clock.now(),
            correlation_id=correlation_id,
            causation_id=causation_id,
            trace_context=trace_context,
        )
