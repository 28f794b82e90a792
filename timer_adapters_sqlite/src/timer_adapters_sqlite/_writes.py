"""Timer operations written in an open transaction, with their outcomes: the one write path
of the writer thread and of a host's own transactions. What to write is timer_core.replay's
to decide; this module reads what it needs and writes what it gets back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol, Self

import attrs

from timer_adapters_sqlite._rows import Row, timer_rows
from timer_adapters_sqlite._sql import (
    CANCEL,
    CANCEL_JSON,
    INSERT,
    INSERT_JSON,
    INSERT_NEW,
    INSERT_NEW_JSON,
    JSON_STATEMENTS,
    POSITIONS,
    POSITIONS_JSON,
    RESCHEDULE,
    RESCHEDULE_JSON,
    TOMBSTONE,
    TOMBSTONE_JSON,
)
from timer_core import CommandOutcome, TimerKey, TimerOperation, TimerState
from timer_core.instants import format_timestamp
from timer_core.replay import (
    StoredKey,
    new_timers,
    operation_keys,
    replay,
)

__all__ = ["Batch", "Cursor", "batch_of", "write_batches"]

_STATES = {state.value: state for state in TimerState}


class Cursor(Protocol):
    """What :func:`write_batches` needs of a cursor: a sqlite3 one, or a host's (see
    :mod:`~timer_adapters_sqlite._in_transaction`). ``execute`` returns the cursor itself,
    so what is fetched from its result is checked against this protocol too."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: str, parameters: Any = (), /) -> Self: ...

    def executemany(self, sql: str, parameters: Any, /) -> Self: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


@attrs.frozen(slots=True)
class Batch:
    """The operations of one ``apply``, checked; with the rows of their timers when they
    only schedule, each key once (the one-statement insert may serve them)."""

    operations: Sequence[TimerOperation]
    new_rows: list[Row] | None

    def __len__(self) -> int:
        return len(self.operations)


def batch_of(operations: Sequence[TimerOperation]) -> Batch:
    """Check ``operations`` (``ValueError`` for bad ones) on the caller's thread, before they
    are queued, and turn a batch of new timers into its rows there."""
    timers = new_timers(operations)
    if timers is None:
        replay(operations, {})  # only to check them: a bad one must not reach the writer
        return Batch(operations, None)
    return Batch(operations, timer_rows(timers))


def write_batches(cursor: Cursor, batches: Sequence[Batch]) -> list[CommandOutcome]:
    """Apply ``batches`` in order in the transaction open under ``cursor``; their outcomes.

    Batches that only schedule distinct keys go in as one insert when none of their keys
    holds anything (the usual batch); otherwise what the keys hold is read and the writes
    :func:`timer_core.replay.replay` decides are made, a statement for each kind.
    """
    rows = _new_rows(batches)
    if rows:
        _run(cursor, INSERT_NEW_JSON, INSERT_NEW, rows)
        if cursor.rowcount == len(rows):
            return [CommandOutcome.SCHEDULED] * len(rows)
        # Some key held something: the rows just inserted are read back below as Scheduled
        # timers of this transaction and rescheduled to the same values (SCHEDULED again).
    operations = [operation for batch in batches for operation in batch.operations]
    replayed = replay(operations, _stored(cursor, operation_keys(operations)))
    if replayed.inserts:
        _run(cursor, INSERT_JSON, INSERT, timer_rows(replayed.inserts))
    if replayed.updates:
        _run(cursor, RESCHEDULE_JSON, RESCHEDULE, timer_rows(replayed.updates))
    if replayed.deletes:
        _run(cursor, CANCEL_JSON, CANCEL, [tuple(key) for key in replayed.deletes])
    if replayed.tombstones:
        tombstones = [
            (t.key.tenant_id, t.key.service_call_id, t.position, format_timestamp(t.at))
            for t in replayed.tombstones
        ]
        _run(cursor, TOMBSTONE_JSON, TOMBSTONE, tombstones)
    return replayed.outcomes


def _new_rows(batches: Sequence[Batch]) -> list[Row] | None:
    """The rows of the batches' timers if every batch only schedules new keys and no key is
    in two of them (new_timers held within each), else None."""
    if len(batches) == 1:
        return batches[0].new_rows
    rows: list[Row] = []
    for batch in batches:
        if batch.new_rows is None:
            return None
        rows += batch.new_rows
    if len({row[:2] for row in rows}) < len(rows):
        return None
    return rows


def _stored(cursor: Cursor, keys: list[TimerKey]) -> dict[TimerKey, StoredKey]:
    """What the store holds for ``keys``, as timer_core.replay reads it."""
    if JSON_STATEMENTS:
        held = cursor.execute(POSITIONS_JSON, (json.dumps(keys),)).fetchall()
    else:
        held = [cursor.execute(POSITIONS, key).fetchone() for key in keys]
    return {
        key: StoredKey(None if state is None else _STATES[state], position, tombstone)
        for key, (state, position, tombstone) in zip(keys, held, strict=True)
        if state is not None or tombstone is not None
    }


def _run(cursor: Cursor, json_form: str, plain_form: str, rows: Sequence[Sequence[Any]]) -> None:
    """One statement for ``rows`` where SQLite reads JSON, else one execution per row."""
    if JSON_STATEMENTS:
        cursor.execute(json_form, (json.dumps(rows),))
    else:
        cursor.executemany(plain_form, rows)
