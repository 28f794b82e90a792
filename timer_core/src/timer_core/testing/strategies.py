"""Hypothesis strategies for Timer's values: identifiers, instants, timers, messages, envelopes.

Every value a strategy here yields satisfies the wire contract unless its name says
``invalid``; use them to property-test adapters and hosts built on Timer.
"""

from __future__ import annotations

import string
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from hypothesis import strategies as st

from timer_core._entry import TimerEntry, TimerState
from timer_core._ids import CausationId, CorrelationId, EnvelopeId, ServiceCallId, TenantId
from timer_core._messages import (
    CancelTimer,
    Command,
    DueTimeReached,
    Message,
    MessageEnvelope,
    ScheduleTimer,
)
from timer_core._time import floor_ms
from timer_core._trace import TraceContext
from timer_core.errors import InvalidIdentifier

__all__ = [
    "trace_contexts",
    "ID_ALPHABET",
    "cancel_timers",
    "causation_ids",
    "command_envelopes",
    "commands",
    "correlation_ids",
    "due_time_reached",
    "envelope_ids",
    "envelopes",
    "event_envelopes",
    "identifiers",
    "invalid_envelope_ids",
    "invalid_identifiers",
    "json_values",
    "schedule_timers",
    "service_call_ids",
    "tenant_ids",
    "timer_entries",
    "utc_datetimes",
]

_I = TypeVar("_I", TenantId, ServiceCallId, CorrelationId, CausationId)

#: The characters an identifier may use.
ID_ALPHABET = string.ascii_letters + string.digits + "_-"

#: Default bounds of :func:`utc_datetimes`: wide enough to find edge cases, narrow enough
#: that adding a few days never overflows ``datetime``.
MIN_INSTANT = datetime(1970, 1, 1, tzinfo=UTC)
MAX_INSTANT = datetime(2999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)


def identifiers(kind: type[_I], *, max_size: int = 128) -> st.SearchStrategy[_I]:
    """Valid identifiers of ``kind``: 1 to ``max_size`` characters of ``[A-Za-z0-9_-]``.

    Short ones are favoured, and UUID-shaped ones appear too, as real systems send them.
    """
    text = st.one_of(
        st.text(ID_ALPHABET, min_size=1, max_size=min(max_size, 12)),
        st.text(ID_ALPHABET, min_size=1, max_size=max_size),
        st.uuids().map(str),
    ).filter(lambda value: len(value) <= max_size)
    return text.map(kind)


def tenant_ids() -> st.SearchStrategy[TenantId]:
    """Valid tenant ids."""
    return identifiers(TenantId)


def service_call_ids() -> st.SearchStrategy[ServiceCallId]:
    """Valid service call ids."""
    return identifiers(ServiceCallId)


def correlation_ids() -> st.SearchStrategy[CorrelationId]:
    """Valid correlation ids."""
    return identifiers(CorrelationId)


def causation_ids() -> st.SearchStrategy[CausationId]:
    """Valid causation ids."""
    return identifiers(CausationId)


def invalid_identifiers() -> st.SearchStrategy[Any]:
    """Values no identifier type accepts: empty, too long, foreign characters, not strings."""
    return st.one_of(
        st.just(""),
        st.text(ID_ALPHABET, min_size=129, max_size=200),
        st.tuples(
            st.text(ID_ALPHABET, max_size=5),
            st.characters(exclude_characters=ID_ALPHABET, exclude_categories=["Cs"]),
            st.text(ID_ALPHABET, max_size=5),
        ).map("".join),
        st.sampled_from(["a.b", "a b", "a*", "a>", "tenant/1", "é", "a\n"]),
        st.none(),
        st.integers(),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
    )


def envelope_ids() -> st.SearchStrategy[EnvelopeId]:
    """Valid envelope ids: lowercase UUID v7 strings, with time fields anywhere in range."""
    return st.builds(
        _uuid7,
        st.integers(0, (1 << 48) - 1),
        st.integers(0, (1 << 12) - 1),
        st.integers(0, (1 << 62) - 1),
    )


def _uuid7(ms: int, rand_a: int, rand_b: int) -> EnvelopeId:
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    h = f"{value:032x}"
    return EnvelopeId(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")


def invalid_envelope_ids() -> st.SearchStrategy[Any]:
    """Values :class:`EnvelopeId` rejects: other UUID versions, uppercase, junk, non-strings."""
    return st.one_of(
        st.uuids(version=4).map(str),
        envelope_ids().map(str.upper).filter(_not_an_envelope_id),
        st.text(ID_ALPHABET, max_size=40).filter(_not_an_envelope_id),
        st.none(),
        st.integers(),
    )


def _not_an_envelope_id(value: str) -> bool:
    try:
        EnvelopeId(value)
    except InvalidIdentifier:
        return True
    return False


def utc_datetimes(
    min_value: datetime = MIN_INSTANT, max_value: datetime = MAX_INSTANT
) -> st.SearchStrategy[datetime]:
    """Aware UTC datetimes at millisecond precision, between the bounds (inclusive)."""
    low = min_value.astimezone(UTC).replace(tzinfo=None)
    high = max_value.astimezone(UTC).replace(tzinfo=None)
    return st.datetimes(low, high).map(lambda value: floor_ms(value.replace(tzinfo=UTC)))


def trace_contexts() -> st.SearchStrategy[TraceContext]:
    """Valid W3C trace contexts, with or without a ``tracestate``."""
    return st.builds(
        lambda trace, span, flags, state: TraceContext(
            f"00-{trace:032x}-{span:016x}-{flags:02x}", state
        ),
        st.integers(1, 2**128 - 1),
        st.integers(1, 2**64 - 1),
        st.integers(0, 255),
        st.none() | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64),
    )


def timer_entries(
    *,
    tenant_id: st.SearchStrategy[TenantId] | None = None,
    service_call_id: st.SearchStrategy[ServiceCallId] | None = None,
    state: TimerState | None = None,
) -> st.SearchStrategy[TimerEntry]:
    """Valid timers; ``Reached`` ones have ``reached_at >= due_at``.

    ``state`` fixes the state (default: either); the id strategies narrow the keys, e.g. to
    make collisions likely.
    """
    states = st.sampled_from(list(TimerState)) if state is None else st.just(state)
    return st.builds(
        _entry,
        tenant_id=tenant_id or tenant_ids(),
        service_call_id=service_call_id or service_call_ids(),
        due_at=utc_datetimes(),
        registered_at=utc_datetimes(),
        correlation_id=st.none() | correlation_ids(),
        trace_context=st.none() | trace_contexts(),
        state=states,
        lateness=st.integers(0, 10**9).map(lambda ms: timedelta(milliseconds=ms)),
    )


def _entry(
    tenant_id: TenantId,
    service_call_id: ServiceCallId,
    due_at: datetime,
    registered_at: datetime,
    correlation_id: CorrelationId | None,
    trace_context: TraceContext | None,
    state: TimerState,
    lateness: timedelta,
) -> TimerEntry:
    entry = TimerEntry(
        tenant_id=tenant_id,
        service_call_id=service_call_id,
        due_at=due_at,
        registered_at=registered_at,
        correlation_id=correlation_id,
        trace_context=trace_context,
    )
    if state is TimerState.REACHED:
        entry = entry.reach(min(due_at + lateness, MAX_INSTANT))
    return entry


def schedule_timers() -> st.SearchStrategy[ScheduleTimer]:
    """Valid ``ScheduleTimer`` commands."""
    return st.builds(ScheduleTimer, tenant_ids(), service_call_ids(), utc_datetimes())


def cancel_timers() -> st.SearchStrategy[CancelTimer]:
    """Valid ``CancelTimer`` commands."""
    return st.builds(CancelTimer, tenant_ids(), service_call_ids())


def commands() -> st.SearchStrategy[Command]:
    """Either command."""
    return st.one_of(schedule_timers(), cancel_timers())


def due_time_reached() -> st.SearchStrategy[DueTimeReached]:
    """Valid ``DueTimeReached`` events, with ``reached_at >= due_at``."""
    return st.builds(
        lambda tenant, call, due, late: DueTimeReached(
            tenant, call, due, min(due + timedelta(milliseconds=late), MAX_INSTANT)
        ),
        tenant_ids(),
        service_call_ids(),
        utc_datetimes(),
        st.integers(0, 10**9),
    )


_P = TypeVar("_P", ScheduleTimer, CancelTimer, DueTimeReached, Command, Message)


def envelopes(payloads: st.SearchStrategy[_P]) -> st.SearchStrategy[MessageEnvelope[_P]]:
    """Valid envelopes around ``payloads``; optional fields are present or absent at random.

    ``aggregate_id``, when present, is the payload's service call id, as the contract wants.
    """
    return st.builds(
        _envelope,
        id=envelope_ids(),
        payload=payloads,
        timestamp_ms=st.integers(0, 2**53 - 1),
        with_aggregate=st.booleans(),
        correlation_id=st.none() | correlation_ids(),
        causation_id=st.none() | causation_ids(),
    )


def _envelope(
    id: EnvelopeId,
    payload: _P,
    timestamp_ms: int,
    with_aggregate: bool,
    correlation_id: CorrelationId | None,
    causation_id: CausationId | None,
) -> MessageEnvelope[_P]:
    return MessageEnvelope(
        id=id,
        payload=payload,
        timestamp_ms=timestamp_ms,
        aggregate_id=payload.service_call_id if with_aggregate else None,
        correlation_id=correlation_id,
        causation_id=causation_id,
    )


def command_envelopes() -> st.SearchStrategy[MessageEnvelope[Command]]:
    """Valid command envelopes, as a producer would send them to the timer."""
    return envelopes(commands())


def event_envelopes() -> st.SearchStrategy[MessageEnvelope[DueTimeReached]]:
    """Valid ``DueTimeReached`` envelopes as the timer publishes them (no causation id)."""
    return st.builds(
        lambda envelope: MessageEnvelope(
            id=envelope.id,
            payload=envelope.payload,
            timestamp_ms=envelope.timestamp_ms,
            aggregate_id=envelope.payload.service_call_id,
            correlation_id=envelope.correlation_id,
        ),
        envelopes(due_time_reached()),
    )


def json_values(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """Arbitrary JSON values (what ``json.loads`` can return), nested objects and arrays."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(),
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )
