"""Row mapping: timer entries from the store's rows, operations into statement parameters."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from timer_core import (
    PositionedOperation,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TimerOperation,
    TimerState,
    TraceContext,
    require_utc,
)

__all__ = ["SCHEDULE_SIZE", "Op", "as_ops", "entry_from_row", "read_timestamp", "write_timestamp"]

# The stored text is always format_timestamp's `YYYY-MM-DDTHH:MM:SS.sssZ` (a CHECK enforces
# it), which datetime.fromisoformat reads in C: half the cost of parse_timestamp per row.
read_timestamp = datetime.fromisoformat


def write_timestamp(value: datetime) -> str:
    """format_timestamp for the UTC instants of a TimerEntry, at a third of its cost.

    A TimerEntry's instants are always in UTC, so ``isoformat`` ends in ``+00:00`` and
    truncates to milliseconds exactly as format_timestamp does (a test holds them equal).
    """
    return value.isoformat(timespec="milliseconds")[:-6] + "Z"


# The store's own row reader: the checks its rows need, not the constructor's converters.
_from_store = TimerEntry._from_store
_STATES = {state.value: state for state in TimerState}
# A handful of tenants own every row: their validated ids are made once and handed to
# TimerEntry, whose converter passes an id of the right type straight through.
_tenant_ids: dict[str, TenantId] = {}
_MAX_TENANT_IDS = 10_000


def _tenant_id(value: str) -> TenantId:
    tenant_id = _tenant_ids.get(value)
    if tenant_id is None:
        if len(_tenant_ids) >= _MAX_TENANT_IDS:
            _tenant_ids.clear()
        tenant_id = _tenant_ids[value] = TenantId(value)
    return tenant_id


def entry_from_row(row: Sequence[Any]) -> TimerEntry:
    """The entry of a row of :data:`~timer_adapters_sqlite._sql.COLUMNS`."""
    (
        tenant_id,
        service_call_id,
        correlation_id,
        due_at,
        registered_at,
        state,
        reached_at,
        traceparent,
        tracestate,
    ) = row
    return _from_store(
        _tenant_id(tenant_id),
        service_call_id,
        read_timestamp(due_at),
        read_timestamp(registered_at),
        correlation_id,
        _STATES[state],
        None if reached_at is None else read_timestamp(reached_at),
        None if traceparent is None else TraceContext(traceparent, tracestate),
    )


# An operation as the writer runs it: its SQL parameters. A schedule has eight (the
# upsert's: the 6th its command position or None, the last two its trace context or None), a
# cancel two (the key) or, with a position, four (key, position, time): the length alone
# tells them apart.
Op = tuple[Any, ...]
SCHEDULE_SIZE = 8
_SCHEDULED = TimerState.SCHEDULED


def as_ops(operations: Sequence[TimerOperation]) -> list[Op]:
    """Validate and turn operations into parameters, on the caller's thread before queueing."""
    ops: list[Op] = []
    # A batch's entries usually share one registered_at (the command batch's `now`).
    registered: datetime | None = None
    registered_text = ""
    for operation in operations:
        position: int | None = None
        if isinstance(operation, PositionedOperation):
            position = operation.position
            if type(position) is not int or position < 0:
                raise ValueError(f"a command position is a non-negative int, got {position!r}")
            if not isinstance(operation.operation, TimerEntry):
                tenant_id, service_call_id = operation.operation
                at = write_timestamp(require_utc(operation.at, "at"))
                ops.append((TenantId(tenant_id), ServiceCallId(service_call_id), position, at))
                continue
            operation = operation.operation
        if isinstance(operation, TimerEntry):
            if operation.state is not _SCHEDULED:
                raise ValueError(f"only Scheduled entries can be scheduled, got {operation}")
            if operation.registered_at != registered:
                registered = operation.registered_at
                registered_text = write_timestamp(registered)
            trace = operation.trace_context
            ops.append(
                (
                    operation.tenant_id,
                    operation.service_call_id,
                    operation.correlation_id,
                    write_timestamp(operation.due_at),
                    registered_text,
                    position,
                    None if trace is None else trace.traceparent,
                    None if trace is None else trace.tracestate,
                )
            )
        elif isinstance(operation, tuple) and len(operation) == 2:
            ops.append((TenantId(operation[0]), ServiceCallId(operation[1])))
        else:
            raise TypeError(
                "expected a TimerEntry, TimerKey or PositionedOperation, "
                f"got {type(operation).__name__}"
            )
    return ops
