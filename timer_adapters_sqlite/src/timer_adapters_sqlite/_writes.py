"""Timer operations written in an open transaction, with their outcomes: the one write path
of the writer thread and of a host's own transactions."""

from __future__ import annotations

import json
from typing import Any, Protocol, Self

from timer_adapters_sqlite._rows import SCHEDULE_SIZE, Op
from timer_adapters_sqlite._sql import (
    CANCEL,
    CANCEL_JSON,
    JSON_STATEMENTS,
    POSITIONS,
    POSITIONS_JSON,
    TOMBSTONE,
    TOMBSTONE_JSON,
    UPSERT,
    UPSERT_JSON,
)
from timer_core import CommandOutcome, TimerState

__all__ = ["Cursor", "write_ops"]


class Cursor(Protocol):
    """What :func:`write_ops` needs of a cursor: a sqlite3 one, or a host's (see
    :mod:`~timer_adapters_sqlite._in_transaction`). ``execute`` returns the cursor itself,
    so what is fetched from its result is checked against this protocol too."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: str, parameters: Any = (), /) -> Self: ...

    def executemany(self, sql: str, parameters: Any, /) -> Self: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


def write_ops(cursor: Cursor, ops: list[Op]) -> list[CommandOutcome]:
    """Run ``ops`` in order in the transaction open under ``cursor``; runs of schedules are one
    statement. The writer's transactions and a host's own (see ``schedule_in_transaction``)
    write timers through this one function."""
    outcomes: list[CommandOutcome] = []
    start, count = 0, len(ops)
    while start < count:
        size = len(ops[start])
        end = start + 1
        while end < count and len(ops[end]) == size:
            end += 1
        params = ops[start:end]
        if size == SCHEDULE_SIZE:
            outcomes += _schedule_run(cursor, params)
        elif size == 2:
            # Cancels run one by one: each needs its own row count for its outcome.
            for key in params:
                cursor.execute(CANCEL, key)
                outcomes.append(
                    CommandOutcome.CANCELLED if cursor.rowcount == 1 else CommandOutcome.CANCEL_NOOP
                )
        else:
            outcomes += _positioned_cancel_run(cursor, params)
        start = end
    return outcomes


def _positioned_cancel_run(cursor: Cursor, params: list[Op]) -> list[CommandOutcome]:
    """A run of positioned cancels: three statements for the run when its keys are distinct
    (what the keys hold, the deletes, the tombstones), else one cancel after another."""
    if not JSON_STATEMENTS or len({op[:2] for op in params}) < len(params):
        return [_positioned_cancel(cursor, op) for op in params]
    held = cursor.execute(POSITIONS_JSON, (json.dumps([op[:2] for op in params]),)).fetchall()
    outcomes: list[CommandOutcome] = []
    applied: list[Op] = []
    for op, (state, stored, tombstone) in zip(params, held, strict=True):
        position = op[2]
        if (stored is not None and stored > position) or (
            tombstone is not None and tombstone > position
        ):
            outcomes.append(CommandOutcome.STALE)
            continue
        applied.append(op)
        outcomes.append(
            CommandOutcome.CANCELLED
            if state == TimerState.SCHEDULED
            else CommandOutcome.CANCEL_NOOP
        )
    if applied:
        cursor.execute(CANCEL_JSON, (json.dumps([op[:2] for op in applied]),))
        cursor.execute(TOMBSTONE_JSON, (json.dumps(applied),))
    return outcomes


def _positioned_cancel(cursor: Cursor, op: Op) -> CommandOutcome:
    """A cancel at a command position: stale, or applied and remembered by a tombstone."""
    tenant_id, service_call_id, position, _ = op
    _, stored, tombstone = cursor.execute(POSITIONS, (tenant_id, service_call_id)).fetchone()
    if (stored is not None and stored > position) or (
        tombstone is not None and tombstone > position
    ):
        return CommandOutcome.STALE
    cursor.execute(CANCEL, (tenant_id, service_call_id))
    cancelled = cursor.rowcount == 1
    cursor.execute(TOMBSTONE, op)
    return CommandOutcome.CANCELLED if cancelled else CommandOutcome.CANCEL_NOOP


def _schedule_run(cursor: Cursor, params: list[tuple[Any, ...]]) -> list[CommandOutcome]:
    if JSON_STATEMENTS:
        cursor.execute(UPSERT_JSON, (json.dumps(params),))
    else:
        cursor.executemany(UPSERT, params)
    if cursor.rowcount == len(params):
        return [CommandOutcome.SCHEDULED] * len(params)
    # Some upserts hit a Reached timer or were older than the key's position. Within a run
    # of upserts a Reached key stays Reached, every other key ends Scheduled (or absent,
    # behind a newer tombstone) with the highest position applied to it, so what is stored
    # now tells which. (One superseded by a newer one of the same run is reported stale
    # too: it is older than one applied.)
    outcomes = []
    for row in params:
        state, stored, tombstone = cursor.execute(POSITIONS, row[:2]).fetchone()
        position = row[5]
        if position is not None and (
            state is None
            or (stored is not None and stored > position)
            or (tombstone is not None and tombstone > position)
        ):
            outcomes.append(CommandOutcome.STALE)
        elif state == TimerState.REACHED:
            outcomes.append(CommandOutcome.IGNORED_REACHED)
        else:
            outcomes.append(CommandOutcome.SCHEDULED)
    return outcomes
