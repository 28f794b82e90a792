"""The ``DueTimeReached`` envelope a firing publishes (contract 5, 6)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from timer_core._entry import TimerEntry
from timer_core._ids import EnvelopeId
from timer_core._messages import DueTimeReached, MessageEnvelope, _unchecked_due_event
from timer_core._time import is_utc_ms, to_epoch_ms
from timer_core.ports import EnvelopeIdGenerator, Uuid7EnvelopeIds

__all__ = ["build_due_event", "due_events"]

_DEFAULT_IDS = Uuid7EnvelopeIds()


def build_due_event(
    entry: TimerEntry, reached_at: datetime, ids: EnvelopeIdGenerator = _DEFAULT_IDS
) -> MessageEnvelope[DueTimeReached]:
    """The ``DueTimeReached`` envelope for firing ``entry`` at ``reached_at`` (contract 5, 6)."""
    envelope_id = ids.firing_id(entry)
    if (
        type(entry) is not TimerEntry
        or type(envelope_id) is not EnvelopeId
        or not is_utc_ms(reached_at)
    ):
        return MessageEnvelope(
            id=envelope_id,
            payload=DueTimeReached(
                tenant_id=entry.tenant_id,
                service_call_id=entry.service_call_id,
                due_at=entry.due_at,
                reached_at=reached_at,
            ),
            timestamp_ms=to_epoch_ms(reached_at),
            aggregate_id=entry.service_call_id,
            correlation_id=entry.correlation_id,
            trace_context=entry.trace_context,
        )
    # The hot path, once per timer fired: every value is already of its field's type and
    # form (a TimerEntry's fields, a UTC millisecond instant), so the converters are not run
    # again.
    return _unchecked_due_event(
        envelope_id,
        entry.tenant_id,
        entry.service_call_id,
        entry.due_at,
        reached_at,
        to_epoch_ms(reached_at),
        entry.correlation_id,
        entry.trace_context,
    )


def due_events(
    due: Sequence[TimerEntry], now: datetime, ids: EnvelopeIdGenerator
) -> list[MessageEnvelope[DueTimeReached]]:
    """:func:`build_due_event` for each timer of a batch fired at ``now``, with ``now``'s
    checks and epoch milliseconds made once per batch rather than once per timer (the fire
    path); the default ids only (another generator's ``firing_id`` is its own)."""
    if type(ids) is not Uuid7EnvelopeIds or not is_utc_ms(now):
        return [build_due_event(entry, now, ids) for entry in due]
    now_ms = to_epoch_ms(now)
    for_firing = EnvelopeId.for_firing
    return [
        _unchecked_due_event(
            for_firing(entry.tenant_id, entry.service_call_id, to_epoch_ms(entry.due_at)),
            entry.tenant_id,
            entry.service_call_id,
            entry.due_at,
            now,
            now_ms,
            entry.correlation_id,
            entry.trace_context,
        )
        if type(entry) is TimerEntry
        else build_due_event(entry, now, ids)
        for entry in due
    ]
