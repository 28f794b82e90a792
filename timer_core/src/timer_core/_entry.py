"""The timer itself: one single-shot timer per (tenant, service call), ``Scheduled -> Reached``."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from datetime import UTC, datetime
from typing import Any, NamedTuple

import attrs

from timer_core._ids import _TOKEN, CorrelationId, ServiceCallId, TenantId
from timer_core._time import ceil_ms, floor_ms, require_utc
from timer_core._trace import TraceContext
from timer_core.errors import IllegalTransition

__all__ = ["TimerEntry", "TimerKey", "TimerState"]


class TimerState(enum.StrEnum):
    """Where a timer is in its life; ``Reached`` is final (a reached timer is never re-armed)."""

    SCHEDULED = "Scheduled"
    REACHED = "Reached"


class TimerKey(NamedTuple):
    """The identity of a timer: one per service call per tenant."""

    tenant_id: TenantId
    service_call_id: ServiceCallId


def _due(value: datetime) -> datetime:
    return ceil_ms(require_utc(value, "dueAt"))


def _instant(value: datetime) -> datetime:
    return floor_ms(require_utc(value))


def _optional_instant(value: datetime | None) -> datetime | None:
    return None if value is None else _instant(value)


def _optional_correlation(value: str | None) -> CorrelationId | None:
    return None if value is None else CorrelationId(value)


def _state(value: str) -> TimerState:
    # Enum's own call costs a microsecond or two, once per timer built: skip it for members.
    return value if value.__class__ is TimerState else TimerState(value)


_token_match = _TOKEN.fullmatch
_new_str = str.__new__


def _from_storage(
    tenant_id: str,
    service_call_id: str,
    due_at: datetime,
    registered_at: datetime,
    correlation_id: str | None,
    state: TimerState,
    reached_at: datetime | None,
    trace_context: TraceContext | None,
    claim: Hashable | None = None,
) -> TimerEntry:
    """The entry a store reads back from one of its rows (:meth:`TimerEntry.from_storage`).

    A row holds what a valid entry wrote, so each value is checked only as far as it must
    be to be used as it is (an id's characters, an instant's zone and precision, the state
    and ``reached_at`` agreeing), inline and with none of the converters' calls: about 60%
    of the constructor's cost, once per timer a store reads (bench/README.md, issue 14). A
    value that fails a check goes through the constructor, which raises what it would.
    """
    if (
        (
            tenant_id.__class__ is TenantId
            or (tenant_id.__class__ is str and _token_match(tenant_id) is not None)
        )
        and service_call_id.__class__ is str
        and _token_match(service_call_id) is not None
        and (
            correlation_id is None
            or (correlation_id.__class__ is str and _token_match(correlation_id) is not None)
        )
        and due_at.__class__ is datetime
        and due_at.tzinfo is UTC
        and not due_at.microsecond % 1000
        and registered_at.__class__ is datetime
        and registered_at.tzinfo is UTC
        and not registered_at.microsecond % 1000
        and (
            reached_at is None
            if state is TimerState.SCHEDULED
            else (
                state is TimerState.REACHED
                and reached_at is not None
                and reached_at.__class__ is datetime
                and reached_at.tzinfo is UTC
                and not reached_at.microsecond % 1000
            )
        )
        and (trace_context is None or trace_context.__class__ is TraceContext)
    ):
        return _unchecked_entry(
            tenant_id if tenant_id.__class__ is TenantId else _new_str(TenantId, tenant_id),
            _new_str(ServiceCallId, service_call_id),
            due_at,
            registered_at,
            None if correlation_id is None else _new_str(CorrelationId, correlation_id),
            state,
            reached_at,
            trace_context,
            claim,
        )
    return TimerEntry(
        tenant_id=tenant_id,
        service_call_id=service_call_id,
        due_at=due_at,
        registered_at=registered_at,
        correlation_id=correlation_id,
        state=state,
        reached_at=reached_at,
        trace_context=trace_context,
        claim=claim,
    )


@attrs.frozen(slots=True)
class TimerEntry:
    """A stored timer.

    All instants are aware UTC datetimes at millisecond precision: ``due_at`` is rounded up
    (never fire early), the others down. ``reached_at`` is set exactly when ``state`` is
    ``Reached``.
    """

    tenant_id: TenantId = attrs.field(converter=TenantId)
    service_call_id: ServiceCallId = attrs.field(converter=ServiceCallId)
    due_at: datetime = attrs.field(converter=_due)
    registered_at: datetime = attrs.field(converter=_instant)
    correlation_id: CorrelationId | None = attrs.field(
        default=None, converter=_optional_correlation
    )
    state: TimerState = attrs.field(default=TimerState.SCHEDULED, converter=_state)
    reached_at: datetime | None = attrs.field(default=None, converter=_optional_instant)
    trace_context: TraceContext | None = None
    """The W3C trace context of the ``ScheduleTimer`` that scheduled it last, if it had one."""
    claim: Hashable | None = attrs.field(default=None, eq=False, repr=False)
    """The claim of the leasing store that returned this timer from a find (its lease token,
    say), or None. It travels with the timer, and with the ``Reached`` entry :meth:`reach`
    makes of it, back to that store's ``mark_reached`` or ``release_claims``, which check it
    (the fence). Not part of the timer: never stored, compared or hashed."""

    def __attrs_post_init__(self) -> None:
        if (self.state is TimerState.REACHED) != (self.reached_at is not None):
            raise IllegalTransition(
                f"timer {self.tenant_id}/{self.service_call_id}: reached_at must be set "
                f"exactly when the state is Reached (state={self.state}, "
                f"reached_at={self.reached_at})"
            )

    from_storage = staticmethod(_from_storage)
    """``TimerEntry.from_storage(tenant_id, service_call_id, due_at, registered_at,
    correlation_id, state, reached_at, trace_context, claim=None)``: the entry a store reads
    back from what it stored, its values as a valid entry wrote them (aware UTC datetimes at
    milliseconds, ids as strings, a :class:`TimerState`), with the claim it took on it.

    Values in that form are checked only as far as they must be (an id's characters, an
    instant's zone and precision, the state and ``reached_at`` agreeing), at about 40% of
    the constructor's cost, once per timer a store reads; anything else goes through the
    constructor, which raises what it would."""

    @property
    def key(self) -> TimerKey:
        """The timer's identity."""
        return TimerKey(self.tenant_id, self.service_call_id)

    @property
    def is_scheduled(self) -> bool:
        """Whether the timer is still waiting to fire."""
        return self.state is TimerState.SCHEDULED

    def is_due(self, now: datetime) -> bool:
        """Whether a ``Scheduled`` timer should fire at ``now`` (``dueAt <= now``, inclusive)."""
        return self.state is TimerState.SCHEDULED and self.due_at <= now

    def reach(self, reached_at: datetime) -> TimerEntry:
        """The same timer, fired at ``reached_at``.

        Raises :class:`IllegalTransition` if it is already ``Reached`` or not yet due.
        """
        return self._reached(_instant(reached_at))

    def _reached(self, reached_at: datetime) -> TimerEntry:
        """:meth:`reach` for a ``reached_at`` already an instant as Timer keeps them (a plain
        UTC datetime at milliseconds, ``is_utc_ms``): the fire path's, once per timer, with
        the instant's conversion made once per batch."""
        if self.state is not TimerState.SCHEDULED:
            raise IllegalTransition(
                f"timer {self.tenant_id}/{self.service_call_id} is already Reached"
            )
        if reached_at < self.due_at:
            raise IllegalTransition(
                f"timer {self.tenant_id}/{self.service_call_id} is due at {self.due_at}, "
                f"cannot be reached at {reached_at}"
            )
        # Every field but two is this valid entry's, and those two are checked above:
        # attrs.evolve, or the constructor, cost several times as much, once per timer
        # fired (bench/README.md).
        return _unchecked_entry(
            self.tenant_id,
            self.service_call_id,
            self.due_at,
            self.registered_at,
            self.correlation_id,
            TimerState.REACHED,
            reached_at,
            self.trace_context,
            self.claim,
        )

    def reschedule(
        self,
        due_at: datetime,
        registered_at: datetime,
        correlation_id: str | None,
        trace_context: TraceContext | None = None,
    ) -> TimerEntry:
        """The same timer with a new due time, correlation id and trace context (the last
        schedule's); raises :class:`IllegalTransition` if Reached."""
        if self.state is not TimerState.SCHEDULED:
            raise IllegalTransition(
                f"timer {self.tenant_id}/{self.service_call_id} is Reached and is never re-armed"
            )
        return attrs.evolve(
            self,
            due_at=due_at,
            registered_at=registered_at,
            correlation_id=correlation_id,
            trace_context=trace_context,
            claim=None,
        )


def _slot_setters(cls: type[Any], *names: str) -> tuple[Callable[[Any, Any], None], ...]:
    """The slot setters of an attrs slots class's fields, in the order named: a frozen
    instance's fields set without its ``__setattr__``, a third cheaper than
    ``object.__setattr__`` by name. Every field must be named (or this raises, at import), so a
    hot path setting each one cannot miss a new field."""
    fields = {field.name for field in attrs.fields(cls)}
    if set(names) != fields or len(names) != len(fields):
        raise TypeError(f"{cls.__name__} has the fields {sorted(fields)}, not {list(names)}")
    return tuple(cls.__dict__[name].__set__ for name in names)


(
    _set_tenant_id,
    _set_service_call_id,
    _set_due_at,
    _set_registered_at,
    _set_correlation_id,
    _set_state,
    _set_reached_at,
    _set_trace_context,
    _set_claim,
) = _slot_setters(
    TimerEntry,
    "tenant_id",
    "service_call_id",
    "due_at",
    "registered_at",
    "correlation_id",
    "state",
    "reached_at",
    "trace_context",
    "claim",
)


def _unchecked_entry(
    tenant_id: TenantId,
    service_call_id: ServiceCallId,
    due_at: datetime,
    registered_at: datetime,
    correlation_id: CorrelationId | None,
    state: TimerState,
    reached_at: datetime | None,
    trace_context: TraceContext | None = None,
    claim: Hashable | None = None,
) -> TimerEntry:
    """A TimerEntry from values already of its fields' types and forms, without running the
    converters and checks again: for the hot paths only (a fired timer, a stored command).
    A new field must be set here too (``_slot_setters`` fails at import until it is)."""
    entry = object.__new__(TimerEntry)
    _set_tenant_id(entry, tenant_id)
    _set_service_call_id(entry, service_call_id)
    _set_due_at(entry, due_at)
    _set_registered_at(entry, registered_at)
    _set_correlation_id(entry, correlation_id)
    _set_state(entry, state)
    _set_reached_at(entry, reached_at)
    _set_trace_context(entry, trace_context)
    _set_claim(entry, claim)
    return entry
