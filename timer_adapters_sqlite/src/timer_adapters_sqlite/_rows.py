"""Row mapping: timer entries from the store's rows, operations into statement parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from timer_adapters_sqlite._disk import driver_of
from timer_core import TenantId, TimerEntry, TimerState, TraceContext
from timer_core.instants import format_timestamp
from timer_core.replay import StoredTimer

__all__ = ["Row", "entries_read", "entry_from_row", "read_timestamp", "timer_rows"]

# The stored text is always format_timestamp's `YYYY-MM-DDTHH:MM:SS.sssZ` (a CHECK enforces
# it), which datetime.fromisoformat reads in C: half the cost of parse_timestamp per row.
read_timestamp = datetime.fromisoformat


# The row reader: the checks its rows need, not the constructor's converters.
_from_storage = TimerEntry.from_storage
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
    return _from_storage(
        _tenant_id(tenant_id),
        service_call_id,
        read_timestamp(due_at),
        read_timestamp(registered_at),
        correlation_id,
        _STATES[state],
        None if reached_at is None else read_timestamp(reached_at),
        None if traceparent is None else TraceContext(traceparent, tracestate),
    )


# A timer as the writer stores it: the parameters of INSERT / RESCHEDULE (the 6th its command
# position or None, the last two its trace context or None).
Row = tuple[Any, ...]


def timer_rows(timers: Sequence[StoredTimer]) -> list[Row]:
    """The statement parameters of ``timers``, in their order."""
    rows: list[Row] = []
    # A batch's entries usually share one registered_at (the command batch's `now`).
    registered: datetime | None = None
    registered_text = ""
    for timer in timers:
        entry = timer.entry
        if entry.registered_at != registered:
            registered = entry.registered_at
            registered_text = format_timestamp(registered)
        trace = entry.trace_context
        rows.append(
            (
                entry.tenant_id,
                entry.service_call_id,
                entry.correlation_id,
                format_timestamp(entry.due_at),
                registered_text,
                timer.position,
                None if trace is None else trace.traceparent,
                None if trace is None else trace.tracestate,
            )
        )
    return rows


def entries_read(sql: str, args: Sequence[Any]) -> Callable[[sa.Connection], list[TimerEntry]]:
    """The read of the timers ``sql`` selects with ``args``, for the reader thread: straight
    through the DBAPI connection, a fraction of a SQLAlchemy execute's cost per call."""

    def read(connection: sa.Connection) -> list[TimerEntry]:
        rows = driver_of(connection).execute(sql, args).fetchall()
        return [entry_from_row(row) for row in rows]

    return read
