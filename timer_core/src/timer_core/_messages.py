"""The messages of the wire contract: two commands into the timer, one event out of it."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, Literal, TypeVar

import attrs

from timer_core._entry import _due, _instant, _optional_correlation, _slot_setters
from timer_core._ids import CausationId, CorrelationId, EnvelopeId, ServiceCallId, TenantId
from timer_core._time import to_epoch_ms
from timer_core._trace import TraceContext

__all__ = [
    "CancelTimer",
    "Command",
    "DueTimeReached",
    "Message",
    "MessageEnvelope",
    "MessageMetadata",
    "ScheduleTimer",
    "command_envelope",
    "require_position",
]


@attrs.frozen(slots=True)
class ScheduleTimer:
    """Command: fire ``DueTimeReached`` for this service call when ``due_at`` has come.

    ``correlation_id`` (keyword only) is the request's correlation id when the command is
    handed straight to ``schedule_in_transaction`` (or to :func:`command_envelope`), as
    ``Timer.schedule`` and ``TimerClient.schedule`` take it. It is not part of the
    payload on the wire, where the envelope carries it (``correlationId``); a decoded
    command's is None, and it takes no part in equality. It is checked when it is used.
    """

    tenant_id: TenantId = attrs.field(converter=TenantId)
    service_call_id: ServiceCallId = attrs.field(converter=ServiceCallId)
    due_at: datetime = attrs.field(converter=_due)
    # No converter: it would cost every decoded command a call; TimerEntry and
    # MessageEnvelope validate it where it is used.
    correlation_id: str | None = attrs.field(
        default=None, kw_only=True, eq=False, repr=False, metadata={"wire": False}
    )
    tag: Literal["ScheduleTimer"] = attrs.field(default="ScheduleTimer", init=False)


@attrs.frozen(slots=True)
class CancelTimer:
    """Command: remove this service call's timer if it has not fired yet."""

    tenant_id: TenantId = attrs.field(converter=TenantId)
    service_call_id: ServiceCallId = attrs.field(converter=ServiceCallId)
    tag: Literal["CancelTimer"] = attrs.field(default="CancelTimer", init=False)


@attrs.frozen(slots=True)
class DueTimeReached:
    """Event: the timer of this service call came due and was fired at ``reached_at``."""

    tenant_id: TenantId = attrs.field(converter=TenantId)
    service_call_id: ServiceCallId = attrs.field(converter=ServiceCallId)
    due_at: datetime = attrs.field(converter=_due)
    reached_at: datetime = attrs.field(converter=_instant)
    tag: Literal["DueTimeReached"] = attrs.field(default="DueTimeReached", init=False)


Command = ScheduleTimer | CancelTimer
Message = ScheduleTimer | CancelTimer | DueTimeReached
P = TypeVar("P", ScheduleTimer, CancelTimer, DueTimeReached, Command, Message)


def _optional_causation(value: str | None) -> CausationId | None:
    return None if value is None else CausationId(value)


@attrs.frozen(slots=True)
class MessageMetadata:
    """What a message carries for tracing: the request's correlation id and its cause."""

    correlation_id: CorrelationId | None = attrs.field(
        default=None, converter=_optional_correlation
    )
    causation_id: CausationId | None = attrs.field(default=None, converter=_optional_causation)


@attrs.frozen(slots=True)
class MessageEnvelope(Generic[P]):
    """One message on the wire: routing and tracing fields around a payload.

    ``type`` is always ``payload.tag`` and ``tenant_id`` always ``payload.tenant_id``;
    the constructor derives both so they cannot disagree. ``trace_context`` travels in the
    message's headers (``traceparent``, ``tracestate``), not in its JSON body.
    """

    id: EnvelopeId = attrs.field(converter=EnvelopeId)
    payload: P
    timestamp_ms: int
    aggregate_id: ServiceCallId | None = None
    correlation_id: CorrelationId | None = attrs.field(
        default=None, converter=_optional_correlation
    )
    causation_id: CausationId | None = attrs.field(default=None, converter=_optional_causation)
    position: int | None = attrs.field(default=None, eq=False, kw_only=True)
    """Where the message sits in its source's order (the JetStream stream sequence of a
    command a :class:`~timer_core.ports.CommandSource` delivered), or None. Not on the wire;
    commands of one timer apply in this order (older ones are ``STALE``)."""
    trace_context: TraceContext | None = attrs.field(default=None, kw_only=True)
    """The W3C trace context the message travels with, in its headers (``traceparent``,
    ``tracestate``), not in its JSON body; None when it has none."""

    def with_trace_context(self, trace_context: TraceContext | None) -> MessageEnvelope[P]:
        """The same message carrying ``trace_context`` instead (nothing else changes, and the
        fields, already valid, are not checked again: a firing's span is added this way)."""
        copy: MessageEnvelope[P] = object.__new__(MessageEnvelope)
        put = object.__setattr__
        for name in _ENVELOPE_FIELDS:
            put(copy, name, getattr(self, name))
        put(copy, "trace_context", trace_context)
        return copy

    @property
    def type(self) -> str:
        """The message type, equal to the payload's ``_tag``."""
        return self.payload.tag

    @property
    def tenant_id(self) -> TenantId:
        """The tenant the message belongs to (routing and partition key)."""
        return self.payload.tenant_id

    @property
    def metadata(self) -> MessageMetadata:
        """The tracing fields of this envelope."""
        return MessageMetadata(self.correlation_id, self.causation_id)

    def at_position(self, position: int | None) -> MessageEnvelope[P]:
        """This envelope with :attr:`position` set (a command source calls it per command).

        A copy made field by field: every value is already valid, so the converters are not
        run again (once per command received).
        """
        require_position(position)
        copy: MessageEnvelope[P] = object.__new__(MessageEnvelope)
        for name in _ENVELOPE_FIELDS:
            object.__setattr__(copy, name, getattr(self, name))
        object.__setattr__(copy, "position", position)
        return copy


def require_position(position: int | None) -> None:
    """Refuse a position that is no sequence number (a negative or non-int one)."""
    if position is not None and (type(position) is not int or position < 0):
        raise ValueError(f"position must be a non-negative int or None, got {position!r}")


_ENVELOPE_FIELDS = tuple(field.name for field in attrs.fields(MessageEnvelope))


(
    _set_payload_tenant_id,
    _set_service_call_id,
    _set_due_at,
    _set_reached_at,
    _set_tag,
) = _slot_setters(DueTimeReached, "tenant_id", "service_call_id", "due_at", "reached_at", "tag")
(
    _set_id,
    _set_payload,
    _set_timestamp_ms,
    _set_aggregate_id,
    _set_correlation_id,
    _set_causation_id,
    _set_position,
    _set_trace_context,
) = _slot_setters(
    MessageEnvelope,
    "id",
    "payload",
    "timestamp_ms",
    "aggregate_id",
    "correlation_id",
    "causation_id",
    "position",
    "trace_context",
)


def _unchecked_due_event(
    envelope_id: EnvelopeId,
    tenant_id: TenantId,
    service_call_id: ServiceCallId,
    due_at: datetime,
    reached_at: datetime,
    timestamp_ms: int,
    correlation_id: CorrelationId | None,
    trace_context: TraceContext | None = None,
) -> MessageEnvelope[DueTimeReached]:
    """A ``DueTimeReached`` envelope from values already of its fields' types and forms,
    without running the converters again: for the hot path only (a timer fired). A new field
    of either class must be set here too (``_slot_setters`` fails at import until it is)."""
    payload = object.__new__(DueTimeReached)
    _set_payload_tenant_id(payload, tenant_id)
    _set_service_call_id(payload, service_call_id)
    _set_due_at(payload, due_at)
    _set_reached_at(payload, reached_at)
    _set_tag(payload, "DueTimeReached")
    envelope: MessageEnvelope[DueTimeReached] = object.__new__(MessageEnvelope)
    _set_id(envelope, envelope_id)
    _set_payload(envelope, payload)
    _set_timestamp_ms(envelope, timestamp_ms)
    _set_aggregate_id(envelope, service_call_id)
    _set_correlation_id(envelope, correlation_id)
    _set_causation_id(envelope, None)
    _set_position(envelope, None)
    _set_trace_context(envelope, trace_context)
    return envelope


C = TypeVar("C", ScheduleTimer, CancelTimer, Command)


def command_envelope(
    payload: C,
    envelope_id: EnvelopeId,
    now: datetime,
    *,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    trace_context: TraceContext | None = None,
) -> MessageEnvelope[C]:
    """A command as a producer sends it: ``aggregateId`` is the service call, ``timestampMs``
    is ``now``, and the correlation id, when none is given (here or on a ``ScheduleTimer``),
    the envelope's own id (a new trace)."""
    return MessageEnvelope(
        id=envelope_id,
        payload=payload,
        timestamp_ms=to_epoch_ms(now),
        aggregate_id=payload.service_call_id,
        correlation_id=_first_given(correlation_id, payload, envelope_id),
        causation_id=causation_id,
        trace_context=trace_context,
    )


def _first_given(correlation_id: str | None, payload: Message, envelope_id: EnvelopeId) -> str:
    """The envelope's correlation id: the one given, else the command's, else its own id."""
    if correlation_id is not None:
        return correlation_id
    carried = getattr(payload, "correlation_id", None)
    return envelope_id if carried is None else carried
