"""Commands applied to the store: a batch from a command source, or one schedule or cancel."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime

from timer_core._entry import TimerEntry, TimerKey, TimerState, _unchecked_entry
from timer_core._ids import CorrelationId, TenantId
from timer_core._messages import CancelTimer, Command, MessageEnvelope, ScheduleTimer
from timer_core._time import floor_ms, is_utc_ms
from timer_core._trace import TraceContext
from timer_core.errors import ValidationError
from timer_core.instrumentation import NO_INSTRUMENTATION, Instrumentation
from timer_core.ports import (
    Clock,
    CommandOutcome,
    PositionedOperation,
    TimerOperation,
    TimerStore,
)

__all__ = ["cancel_timer", "handle_commands", "schedule_timer", "scheduled_entry"]

log = logging.getLogger(__name__)


def _operation(envelope: MessageEnvelope[Command], now: datetime) -> TimerOperation:
    operation = _unpositioned(envelope, now)
    position = envelope.position
    return operation if position is None else PositionedOperation(operation, position, now)


def _unpositioned(envelope: MessageEnvelope[Command], now: datetime) -> TimerEntry | TimerKey:
    command = envelope.payload
    if isinstance(command, ScheduleTimer):
        correlation_id = envelope.correlation_id
        if (
            type(command) is ScheduleTimer
            and (correlation_id is None or type(correlation_id) is CorrelationId)
            and is_utc_ms(now)
        ):
            # The hot path, once per command stored: a ScheduleTimer's fields are already
            # of the entry's types and forms (its converters ran).
            return _unchecked_entry(
                command.tenant_id,
                command.service_call_id,
                command.due_at,
                now,
                correlation_id,
                TimerState.SCHEDULED,
                None,
                envelope.trace_context,
            )
        return scheduled_entry(
            command, now, correlation_id=correlation_id, trace_context=envelope.trace_context
        )
    return TimerKey(command.tenant_id, command.service_call_id)


async def handle_commands(
    store: TimerStore,
    envelopes: Sequence[MessageEnvelope[Command]],
    clock: Clock,
    *,
    instrumentation: Instrumentation = NO_INSTRUMENTATION,
    max_pending_per_tenant: int | None = None,
) -> list[CommandOutcome]:
    """Apply a batch of decoded commands in order, in one store transaction.

    An envelope with a :attr:`~timer_core.MessageEnvelope.position` is applied as a
    :class:`~timer_core.ports.PositionedOperation`: older than what its timer already saw,
    it changes nothing (``STALE``). With ``max_pending_per_tenant``, a ``ScheduleTimer``
    that would give its tenant more ``Scheduled`` timers than that is refused
    (``OVER_QUOTA``, not applied; the command source dead-letters it); reschedules and
    cancels always pass. Several instances admitting at the same moment may each go up to
    the cap. Returns once every command is durably applied (the caller may then ack them
    all); raises :class:`~timer_core.errors.StoreError` if none could be.
    """
    if not envelopes:
        return []
    now = floor_ms(clock.now())
    observer = instrumentation.commands_started(envelopes)
    try:
        refused: set[int] = set()
        if max_pending_per_tenant is not None:
            refused = await _over_quota(store, envelopes, max_pending_per_tenant)
        if refused:
            admitted = [e for i, e in enumerate(envelopes) if i not in refused]
            applied = iter(await store.apply([_operation(envelope, now) for envelope in admitted]))
            outcomes = [
                CommandOutcome.OVER_QUOTA if i in refused else next(applied)
                for i in range(len(envelopes))
            ]
            log.warning(
                "%d ScheduleTimer commands over the cap of %d pending timers per tenant refused",
                len(refused),
                max_pending_per_tenant,
            )
        else:
            outcomes = await store.apply([_operation(envelope, now) for envelope in envelopes])
    except Exception as exc:
        observer.finished(exc)
        raise
    instrumentation.commands_handled(envelopes, outcomes)
    observer.finished()
    if log.isEnabledFor(logging.DEBUG):
        for envelope, outcome in zip(envelopes, outcomes, strict=True):
            log.debug(
                "%s %s/%s -> %s (correlation %s)",
                envelope.type,
                envelope.tenant_id,
                envelope.payload.service_call_id,
                outcome.value,
                envelope.correlation_id,
            )
    return outcomes


async def _over_quota(
    store: TimerStore, envelopes: Sequence[MessageEnvelope[Command]], cap: int
) -> set[int]:
    """The indexes of the ``ScheduleTimer`` commands that would take their tenant past
    ``cap`` pending timers. One count per tenant in the batch; only a tenant near its cap
    has the keys of its commands read, to follow the batch in order."""
    by_tenant: dict[TenantId, list[int]] = {}
    for index, envelope in enumerate(envelopes):
        by_tenant.setdefault(envelope.tenant_id, []).append(index)
    refused: set[int] = set()
    for tenant_id, indexes in by_tenant.items():
        schedules = sum(isinstance(envelopes[i].payload, ScheduleTimer) for i in indexes)
        if not schedules:
            continue
        pending = await store.count_scheduled_for_tenant(tenant_id)
        if pending + schedules <= cap:
            continue
        calls = {envelopes[i].payload.service_call_id for i in indexes}
        stored = {call: await store.get(tenant_id, call) for call in calls}
        scheduled = {call for call, e in stored.items() if e is not None and e.is_scheduled}
        reached = {call for call, e in stored.items() if e is not None and not e.is_scheduled}
        for index in indexes:
            command = envelopes[index].payload
            call = command.service_call_id
            if isinstance(command, ScheduleTimer):
                if call in scheduled or call in reached:
                    continue  # a reschedule, or ignored: no new pending timer
                if pending >= cap:
                    refused.add(index)
                    continue
                scheduled.add(call)
                pending += 1
            elif call in scheduled:
                scheduled.discard(call)
                pending -= 1
    return refused


async def schedule_timer(
    store: TimerStore,
    command: ScheduleTimer,
    clock: Clock,
    *,
    correlation_id: str | None = None,
    trace_context: TraceContext | None = None,
) -> CommandOutcome:
    """Store or reschedule one timer; a ``Reached`` timer is never re-armed."""
    entry = scheduled_entry(
        command, clock.now(), correlation_id=correlation_id, trace_context=trace_context
    )
    return await store.schedule(entry)


def scheduled_entry(
    command: ScheduleTimer,
    now: datetime,
    *,
    correlation_id: str | None = None,
    trace_context: TraceContext | None = None,
) -> TimerEntry:
    """The ``Scheduled`` timer a ``ScheduleTimer`` received at ``now`` stores; its
    correlation id is ``correlation_id`` or else the command's own (both, differing, is a
    :class:`~timer_core.errors.ValidationError`)."""
    carried = command.correlation_id
    if carried is not None and correlation_id is not None and carried != correlation_id:
        raise ValidationError(
            f"two correlation ids for {command.tenant_id}/{command.service_call_id}: "
            f"{carried!r} on the ScheduleTimer and {correlation_id!r} beside it; give one"
        )
    return TimerEntry(
        tenant_id=command.tenant_id,
        service_call_id=command.service_call_id,
        due_at=command.due_at,
        registered_at=floor_ms(now),
        correlation_id=correlation_id if correlation_id is not None else carried,
        trace_context=trace_context,
    )


async def cancel_timer(store: TimerStore, command: CancelTimer) -> CommandOutcome:
    """Remove a ``Scheduled`` timer; a no-op for a ``Reached`` or unknown one."""
    return await store.cancel(command.tenant_id, command.service_call_id)
