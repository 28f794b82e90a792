"""``SqliteTimerStore``: the durable timer store on one SQLite file, group-committing writes.

All writes run on one dedicated writer thread and connection; concurrent ``apply`` calls
queued while a transaction commits are written together in the next one. Reads run on a
second thread with its own connection, which WAL lets proceed while the writer writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import Any, Protocol, TypeVar

import attrs
import sqlalchemy as sa
import sqlalchemy.exc
import sqlalchemy.orm

from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._schema import (
    TABLE,
    TOMBSTONES,
    StoreMode,
    Synchronous,
    check_schema,
    create_sqlite_engine,
    migrate_connection,
)
from timer_core import (
    CancelTimer,
    CommandOutcome,
    CorrelationId,
    DueCursor,
    PositionedOperation,
    RemoteScheduleCallback,
    ScheduleTimer,
    ServiceCallId,
    StoreError,
    StoreUnavailable,
    TenantId,
    TimerEntry,
    TimerKey,
    TimerOperation,
    TimerState,
    TimerStore,
    TraceContext,
    format_timestamp,
    require_utc,
    scheduled_entry,
)

__all__ = ["SqliteTimerStore", "cancel_in_transaction", "schedule_in_transaction"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_COLUMNS = (
    "tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at, "
    "traceparent, tracestate"
)

# ADR-0003 section 5: a Reached timer is never re-armed, so the update is guarded by state.
# Command order (a PositionedOperation's position, the 6th value, NULL without one): a
# schedule older than the key's tombstone is not inserted, one older than the stored
# timer's position does not update it, and an unpositioned one keeps the stored position.
_ORDERED_UPDATE = f"""
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    due_at = excluded.due_at,
    correlation_id = excluded.correlation_id,
    registered_at = excluded.registered_at,
    traceparent = excluded.traceparent,
    tracestate = excluded.tracestate,
    command_position = coalesce(excluded.command_position, {TABLE}.command_position)
WHERE {TABLE}.state = 'Scheduled'
  AND (excluded.command_position IS NULL OR {TABLE}.command_position IS NULL
       OR {TABLE}.command_position <= excluded.command_position)
"""
_UPSERT = f"""
INSERT INTO {TABLE}
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, state, command_position,
     traceparent, tracestate)
SELECT ?1, ?2, ?3, ?4, ?5, 'Scheduled', ?6, ?7, ?8
WHERE ?6 IS NULL OR NOT EXISTS (
    SELECT 1 FROM {TOMBSTONES} AS c
    WHERE c.tenant_id = ?1 AND c.service_call_id = ?2 AND c.command_position > ?6)
{_ORDERED_UPDATE}"""
_CANCEL = f"""
DELETE FROM {TABLE} WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled'
"""
# (state, position) of the key's timer and its tombstone's position; NULLs where absent.
_POSITIONS = f"""
SELECT (SELECT state FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id = ?2),
       (SELECT command_position FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id = ?2),
       (SELECT command_position FROM {TOMBSTONES} WHERE tenant_id = ?1 AND service_call_id = ?2)
"""
# The same three for a run of positioned cancels of distinct keys, as JSON arrays.
_POSITIONS_JSON = f"""
SELECT s.state, s.command_position, c.command_position
FROM json_each(?) AS j
LEFT JOIN {TABLE} AS s ON s.tenant_id = json_extract(j.value, '$[0]')
    AND s.service_call_id = json_extract(j.value, '$[1]')
LEFT JOIN {TOMBSTONES} AS c ON c.tenant_id = json_extract(j.value, '$[0]')
    AND c.service_call_id = json_extract(j.value, '$[1]')
ORDER BY j.key
"""
_CANCEL_JSON = f"""
DELETE FROM {TABLE} WHERE state = 'Scheduled' AND (tenant_id, service_call_id) IN (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?))
"""
_TOMBSTONE_JSON = f"""
INSERT INTO {TOMBSTONES} AS c (tenant_id, service_call_id, command_position, cancelled_at)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
       json_extract(value, '$[3]')
FROM json_each(?) WHERE true
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    command_position = max(c.command_position, excluded.command_position),
    cancelled_at = excluded.cancelled_at
"""
_TOMBSTONE = f"""
INSERT INTO {TOMBSTONES} (tenant_id, service_call_id, command_position, cancelled_at)
VALUES (?, ?, ?, ?)
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    command_position = max(command_position, excluded.command_position),
    cancelled_at = excluded.cancelled_at
"""
_MARK_REACHED = f"""
UPDATE {TABLE} SET state = 'Reached', reached_at = ?
WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled' AND due_at = ?
"""
# The same two writes as one statement each, their rows handed over as one JSON array:
# executemany takes the GIL back between every two rows, and while the event loop keeps
# another thread busy each of those waits up to a switch interval (5 ms) for it (measured:
# 0.3-3k upserts/s that way, 8k/s as one statement, the event loop running on meanwhile).
_UPSERT_JSON = f"""
INSERT INTO {TABLE}
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, state, command_position,
     traceparent, tracestate)
SELECT tenant_id, service_call_id, correlation_id, due_at, registered_at, 'Scheduled', position,
       traceparent, tracestate
FROM (
    SELECT key, json_extract(value, '$[0]') AS tenant_id,
           json_extract(value, '$[1]') AS service_call_id,
           json_extract(value, '$[2]') AS correlation_id, json_extract(value, '$[3]') AS due_at,
           json_extract(value, '$[4]') AS registered_at, json_extract(value, '$[5]') AS position,
           json_extract(value, '$[6]') AS traceparent, json_extract(value, '$[7]') AS tracestate
    FROM json_each(?)
) AS v
WHERE position IS NULL OR NOT EXISTS (
    SELECT 1 FROM {TOMBSTONES} AS c
    WHERE c.tenant_id = v.tenant_id AND c.service_call_id = v.service_call_id
      AND c.command_position > v.position)
ORDER BY key
{_ORDERED_UPDATE}"""
_MARK_REACHED_JSON = f"""
UPDATE {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
SET state = 'Reached', reached_at = marks.reached_at
FROM (
    SELECT json_extract(value, '$[0]') AS reached_at, json_extract(value, '$[1]') AS tenant_id,
           json_extract(value, '$[2]') AS service_call_id, json_extract(value, '$[3]') AS due_at
    FROM json_each(?)
) AS marks
WHERE {TABLE}.tenant_id = marks.tenant_id AND {TABLE}.service_call_id = marks.service_call_id
  AND {TABLE}.state = 'Scheduled' AND {TABLE}.due_at = marks.due_at
"""


def _json_statements_supported() -> bool:
    """Whether this SQLite has JSON functions and UPDATE ... FROM (3.33; JSON built in 3.38)."""
    try:
        with contextlib.closing(sqlite3.connect(":memory:")) as probe:
            probe.execute("CREATE TABLE t (a, b)")
            probe.execute("UPDATE t SET b = j.value FROM json_each('[1]') AS j WHERE t.a = j.key")
    except sqlite3.Error:
        return False
    return True


_JSON_STATEMENTS = _json_statements_supported()
# INDEXED BY pins the plans the EXPLAIN QUERY PLAN tests prove: statistics from a host's
# ANALYZE must never turn the poll into a scan whose cost grows with the table.
_FIND_DUE = f"""
SELECT {_COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND due_at <= ?
ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
_FIND_DUE_AFTER = f"""
SELECT {_COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND due_at <= ? AND (due_at, tenant_id, service_call_id) > (?, ?, ?)
ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
_FIND_DUE_FOR_TENANT = f"""
SELECT {_COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
WHERE tenant_id = ? AND state = 'Scheduled' AND due_at <= ?
ORDER BY due_at, service_call_id LIMIT ?
"""
# find_due_by_tenant in two statements whatever the number of tenants (statements, not rows,
# are what a read costs while the event loop holds the GIL): the tenants with pending timers
# and their earliest due time, by a loose scan of the tenant-first partial index (a few seeks
# per tenant), longest waiting first ...
_DUE_TENANTS = f"""
WITH RECURSIVE pending(tenant_id) AS (
    SELECT (SELECT min(tenant_id) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
            WHERE state = 'Scheduled')
  UNION ALL
    SELECT (SELECT min(tenant_id) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
            WHERE state = 'Scheduled' AND tenant_id > pending.tenant_id)
    FROM pending WHERE pending.tenant_id IS NOT NULL
)
SELECT tenant_id, (
    SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
    WHERE state = 'Scheduled' AND tenant_id = pending.tenant_id) AS earliest
FROM pending WHERE tenant_id IS NOT NULL AND earliest <= ? ORDER BY earliest, tenant_id
"""
# ... then up to ?3 due timers of each tenant of a JSON array of [tenant, after due_at,
# after service_call_id] ("" sorts before every valid value: no cursor), in its own order.
_FIND_DUE_OF_TENANTS = f"""
SELECT {", ".join(f"s.{column}" for column in _COLUMNS.split(", "))}
FROM json_each(?1) AS j
JOIN {TABLE} AS s ON s.rowid IN (
    SELECT rowid FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
    WHERE tenant_id = json_extract(j.value, '$[0]') AND state = 'Scheduled' AND due_at <= ?2
      AND (due_at, service_call_id)
          > (json_extract(j.value, '$[1]'), json_extract(j.value, '$[2]'))
    ORDER BY due_at, service_call_id LIMIT ?3
)
"""
# min() is answered by one seek to the first entry of the partial index.
_NEXT_DUE_AT = f"""
SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled'
"""
_GET = sa.text(
    f"SELECT {_COLUMNS} FROM {TABLE} WHERE tenant_id = :tenant AND service_call_id = :call"
)
# Without stats the planner prefers the primary key (it yields service_call_id order) and
# would walk the whole tenant; a correlation id matches a handful of rows, so seek on it.
_FIND_BY_CORRELATION = sa.text(
    f"SELECT {_COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_correlation_id "
    "WHERE correlation_id = :correlation AND tenant_id = :tenant ORDER BY service_call_id"
)
_LIST_FOR_TENANT = sa.text(
    f"SELECT {_COLUMNS} FROM {TABLE} "
    "WHERE tenant_id = :tenant AND service_call_id > :after ORDER BY service_call_id LIMIT :limit"
)
_COUNT_SCHEDULED_FOR_TENANT = f"""
SELECT count(*) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
WHERE tenant_id = ? AND state = 'Scheduled'
"""
_COUNT_SCHEDULED = sa.text(
    f"SELECT count(*) FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due "
    "WHERE state = 'Scheduled'"
)
_PURGE_REACHED = sa.text(
    f"DELETE FROM {TABLE} WHERE (tenant_id, service_call_id) IN ("
    f"SELECT tenant_id, service_call_id FROM {TABLE} INDEXED BY idx_timer_schedules_reached_at "
    "WHERE state = 'Reached' AND reached_at < :before ORDER BY reached_at LIMIT :limit)"
)
_PURGE_TOMBSTONES = sa.text(
    f"DELETE FROM {TOMBSTONES} WHERE (tenant_id, service_call_id) IN ("
    f"SELECT tenant_id, service_call_id FROM {TOMBSTONES} "
    "INDEXED BY idx_timer_tombstones_cancelled_at "
    "WHERE cancelled_at < :before ORDER BY cancelled_at LIMIT :limit)"
)

# The stored text is always format_timestamp's `YYYY-MM-DDTHH:MM:SS.sssZ` (a CHECK enforces
# it), which datetime.fromisoformat reads in C: half the cost of parse_timestamp per row.
_read_timestamp = datetime.fromisoformat


def _write_timestamp(value: datetime) -> str:
    """format_timestamp for the UTC instants of a TimerEntry, at a third of its cost.

    A TimerEntry's instants are always in UTC, so ``isoformat`` ends in ``+00:00`` and
    truncates to milliseconds exactly as format_timestamp does (a test holds them equal).
    """
    return value.isoformat(timespec="milliseconds")[:-6] + "Z"


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


def _entry(row: Sequence[Any]) -> TimerEntry:
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
    return TimerEntry(
        tenant_id=_tenant_id(tenant_id),
        service_call_id=service_call_id,
        due_at=_read_timestamp(due_at),
        registered_at=_read_timestamp(registered_at),
        correlation_id=correlation_id,
        state=_STATES[state],
        reached_at=None if reached_at is None else _read_timestamp(reached_at),
        trace_context=None if traceparent is None else TraceContext(traceparent, tracestate),
    )


# An operation as the writer runs it: its SQL parameters. A schedule has eight (the
# upsert's: the 6th its command position or None, the last two its trace context or None), a
# cancel two (the key) or, with a position, four (key, position, time): the length alone
# tells them apart.
_Op = tuple[Any, ...]
_SCHEDULE_SIZE = 8
_SCHEDULED = TimerState.SCHEDULED


def _as_ops(operations: Sequence[TimerOperation]) -> list[_Op]:
    """Validate and turn operations into parameters, on the caller's thread before queueing."""
    ops: list[_Op] = []
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
                at = _write_timestamp(require_utc(operation.at, "at"))
                ops.append((TenantId(tenant_id), ServiceCallId(service_call_id), position, at))
                continue
            operation = operation.operation
        if isinstance(operation, TimerEntry):
            if operation.state is not _SCHEDULED:
                raise ValueError(f"only Scheduled entries can be scheduled, got {operation}")
            if operation.registered_at != registered:
                registered = operation.registered_at
                registered_text = _write_timestamp(registered)
            trace = operation.trace_context
            ops.append(
                (
                    operation.tenant_id,
                    operation.service_call_id,
                    operation.correlation_id,
                    _write_timestamp(operation.due_at),
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


class _Cursor(Protocol):
    """What :func:`_write_ops` needs of a cursor: a sqlite3 one, or :class:`_HostCursor`."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: str, parameters: Any = (), /) -> Any: ...

    def executemany(self, sql: str, parameters: Any, /) -> Any: ...

    def fetchone(self) -> Any: ...


class _HostCursor:
    """A cursor over a host's SQLAlchemy connection: statements run through the connection
    (its events and logging see them), whatever the SQLite driver, sync or under
    ``run_sync`` of SQLAlchemy's asyncio API."""

    def __init__(self, connection: sa.Connection) -> None:
        self._connection = connection
        self._result: sa.CursorResult[Any] | None = None

    @property
    def rowcount(self) -> int:
        return -1 if self._result is None else self._result.rowcount

    def execute(self, sql: str, parameters: Any = (), /) -> _HostCursor:
        self._result = self._connection.exec_driver_sql(sql, tuple(parameters))
        return self

    def executemany(self, sql: str, parameters: Any, /) -> _HostCursor:
        self._result = self._connection.exec_driver_sql(sql, list(parameters))
        return self

    def fetchone(self) -> Any:
        return None if self._result is None else self._result.fetchone()


def _write_ops(cursor: _Cursor, ops: list[_Op]) -> list[CommandOutcome]:
    """Run ``ops`` in order in the transaction open under ``cursor``; runs of schedules are one
    statement. The writer's transactions and a host's own (see :func:`schedule_in_transaction`)
    write timers through this one function."""
    outcomes: list[CommandOutcome] = []
    start, count = 0, len(ops)
    while start < count:
        size = len(ops[start])
        end = start + 1
        while end < count and len(ops[end]) == size:
            end += 1
        params = ops[start:end]
        if size == _SCHEDULE_SIZE:
            outcomes += _schedule_run(cursor, params)
        elif size == 2:
            # Cancels run one by one: each needs its own row count for its outcome.
            for key in params:
                cursor.execute(_CANCEL, key)
                outcomes.append(
                    CommandOutcome.CANCELLED if cursor.rowcount == 1 else CommandOutcome.CANCEL_NOOP
                )
        else:
            outcomes += _positioned_cancel_run(cursor, params)
        start = end
    return outcomes


def _positioned_cancel_run(cursor: _Cursor, params: list[_Op]) -> list[CommandOutcome]:
    """A run of positioned cancels: three statements for the run when its keys are distinct
    (what the keys hold, the deletes, the tombstones), else one cancel after another."""
    if not _JSON_STATEMENTS or len({op[:2] for op in params}) < len(params):
        return [_positioned_cancel(cursor, op) for op in params]
    held = cursor.execute(_POSITIONS_JSON, (json.dumps([op[:2] for op in params]),)).fetchall()
    outcomes: list[CommandOutcome] = []
    applied: list[_Op] = []
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
        cursor.execute(_CANCEL_JSON, (json.dumps([op[:2] for op in applied]),))
        cursor.execute(_TOMBSTONE_JSON, (json.dumps(applied),))
    return outcomes


def _positioned_cancel(cursor: _Cursor, op: _Op) -> CommandOutcome:
    """A cancel at a command position: stale, or applied and remembered by a tombstone."""
    tenant_id, service_call_id, position, _ = op
    _, stored, tombstone = cursor.execute(_POSITIONS, (tenant_id, service_call_id)).fetchone()
    if (stored is not None and stored > position) or (
        tombstone is not None and tombstone > position
    ):
        return CommandOutcome.STALE
    cursor.execute(_CANCEL, (tenant_id, service_call_id))
    cancelled = cursor.rowcount == 1
    cursor.execute(_TOMBSTONE, op)
    return CommandOutcome.CANCELLED if cancelled else CommandOutcome.CANCEL_NOOP


def _schedule_run(cursor: _Cursor, params: list[tuple[Any, ...]]) -> list[CommandOutcome]:
    if _JSON_STATEMENTS:
        cursor.execute(_UPSERT_JSON, (json.dumps(params),))
    else:
        cursor.executemany(_UPSERT, params)
    if cursor.rowcount == len(params):
        return [CommandOutcome.SCHEDULED] * len(params)
    # Some upserts hit a Reached timer or were older than the key's position. Within a run
    # of upserts a Reached key stays Reached, every other key ends Scheduled (or absent,
    # behind a newer tombstone) with the highest position applied to it, so what is stored
    # now tells which. (One superseded by a newer one of the same run is reported stale
    # too: it is older than one applied.)
    outcomes = []
    for row in params:
        state, stored, tombstone = cursor.execute(_POSITIONS, row[:2]).fetchone()
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


@attrs.define(slots=True)
class _ApplyJob:
    """Operations of one ``apply`` call, group-committed with others queued with it."""

    ops: list[_Op]
    future: asyncio.Future[Any]


@attrs.define(slots=True)
class _CallJob:
    """A write that runs alone in its own ``BEGIN IMMEDIATE`` transaction (mark, purge)."""

    fn: Callable[[sa.Connection], Any]
    future: asyncio.Future[Any]


@attrs.define(slots=True)
class _OpenJob:
    """Open the writer's connection and migrate the schema, on the writer thread."""

    mode: StoreMode
    future: asyncio.Future[Any]
    migrate: bool = True


_Job = _ApplyJob | _CallJob | _OpenJob
_STOP = object()
"""Queued after the last job: the thread finishes what came before it, then ends."""

# (the caller's future, the result, or the error to raise in the caller)
_Result = tuple[asyncio.Future[Any], Any, BaseException | None]


def _settle(results: list[_Result]) -> None:
    """Resolve callers' futures; runs on their event loop."""
    for future, result, error in results:
        # A caller cancelled while its write was in flight: the write stands, nobody waits.
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _deliver(results: list[_Result]) -> None:
    """Hand results to each caller's event loop: one wake-up per loop, not per caller."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
    for result in results:
        by_loop.setdefault(result[0].get_loop(), []).append(result)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, batch)
        except RuntimeError:
            log.debug("event loop closed before a timer store result could be delivered")


class _Reader:
    """The thread that reads, on its own connection, which WAL lets run beside the writer.

    A queue and one ``call_soon_threadsafe`` per result: measured, ``run_in_executor`` on a
    ThreadPoolExecutor made an empty poll about twice as slow and twice as costly in CPU.
    """

    def __init__(self, engine: sa.Engine, where: str) -> None:
        self._engine = engine
        self._where = where
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._connection: sa.Connection | None = None
        self._thread = threading.Thread(target=self._run, name="timer-sqlite-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[[sa.Connection], Any], future: asyncio.Future[Any]) -> None:
        self._queue.put((fn, future))

    def stop(self) -> None:
        """Finish the reads queued so far, then close the connection and end the thread."""
        self._queue.put(_STOP)

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            assert isinstance(item, tuple)
            fn: Callable[[sa.Connection], Any] = item[0]
            future: asyncio.Future[Any] = item[1]
            _deliver([self._read(fn, future)])
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:
                log.exception("closing the reader connection of %s failed", self._where)
            self._connection = None

    def _read(self, fn: Callable[[sa.Connection], Any], future: asyncio.Future[Any]) -> _Result:
        try:
            if self._connection is None:
                self._connection = self._engine.connect()
            connection = self._connection
            try:
                return future, fn(connection), None
            finally:
                # Reads run in autocommit; this only resets SQLAlchemy's autobegun state.
                connection.rollback()
        except StoreError as exc:
            return future, None, exc
        except Exception as exc:
            return future, None, translate_error(exc, self._where)


# The writer checkpoints on its own only past this many WAL pages (32 MiB at 4 KiB pages):
# normally the checkpointer thread has copied the WAL back long before. Past the size limit
# the WAL file is cut back to it whenever it restarts.
_WRITER_AUTOCHECKPOINT_PAGES = 8192
_WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024


def _driver_of(connection: sa.Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLAlchemy one, for the statements run directly."""
    driver = connection.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    return driver


class _Checkpointer:
    """The thread that copies committed WAL pages back into the database file.

    SQLite's default has the committing connection checkpoint every 1000 WAL pages, and a
    batch of upserts with random keys dirties pages all over five indexes: nearly every
    commit of 1000 timers paid for a checkpoint (copy and sync) before the writer could
    take the next batch. Here, after each commit, a PASSIVE checkpoint on a connection of
    its own runs beside the writer (it never blocks writers or readers).
    Measured: 1000-upsert transactions 13,000 -> 21,000/s (bench/README.md).
    """

    def __init__(self, engine: sa.Engine, where: str) -> None:
        self._engine = engine
        self._where = where
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name="timer-sqlite-checkpointer", daemon=True
        )
        self.checkpoints = 0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """A commit happened: checkpoint when the one in progress (if any) is done."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        connection: sa.Connection | None = None
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                try:
                    if connection is None:
                        connection = self._engine.connect()
                    busy, frames, copied = (
                        _driver_of(connection).execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    )
                    if not busy and frames == copied:
                        self.checkpoints += 1  # the WAL is all in the file now
                except Exception as exc:
                    # The writer's own checkpoint past the page limit is the fallback.
                    log.debug("checkpoint of %s failed: %s", self._where, exc)
                    if connection is not None:
                        with contextlib.suppress(Exception):
                            connection.close()
                        connection = None
        finally:
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()


class _Writer:
    """The one thread that writes: drains the queue and commits each drained group at once."""

    def __init__(self, engine: sa.Engine, where: str, max_group_operations: int) -> None:
        self._engine = engine
        self._where = where
        self._max_ops = max_group_operations
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._connection: sa.Connection | None = None
        self._driver: sqlite3.Connection | None = None
        self._thread = threading.Thread(target=self._run, name="timer-sqlite-writer", daemon=True)
        self._checkpointer = _Checkpointer(engine, where)
        self.transactions = 0

    @property
    def checkpoints(self) -> int:
        """Checkpoints the checkpointer thread completed (the whole WAL copied back)."""
        return self._checkpointer.checkpoints

    def start(self) -> None:
        self._checkpointer.start()
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Finish the jobs queued so far, then close the connection and end the thread."""
        self._queue.put(_STOP)

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        held: list[_Job] = []
        stopping = False
        while not stopping:
            jobs, held, stopping = self._next_group(held)
            try:
                self._run_jobs(jobs)
            except Exception as exc:
                # A bug here must not kill the only writer and leave every caller waiting.
                log.exception("timer store writer on %s failed", self._where)
                error = StoreError(f"timer store writer on {self._where} failed: {exc!r}")
                _deliver([(job.future, None, error) for job in jobs])
        # Nothing is submitted after the stop marker by the store; this is a safety net so
        # no caller could ever wait forever.
        leftovers: list[_Job] = list(held)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _ApplyJob | _CallJob | _OpenJob):
                leftovers.append(item)
        closed = StoreUnavailable(f"the timer store on {self._where} is closed")
        _deliver([(job.future, None, closed) for job in leftovers])
        self._checkpointer.stop()
        self._close()

    def _next_group(self, held: list[_Job]) -> tuple[list[_Job], list[_Job], bool]:
        """Wait for work, then take everything queued, up to the operation bound."""
        jobs: list[_Job] = []
        operations = 0
        incoming = list(held)
        if not incoming:
            incoming.append(self._queue.get())  # type: ignore[arg-type]
        while True:
            if incoming:
                item: object = incoming.pop(0)
            else:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return jobs, [], False
            if item is _STOP:
                return jobs, incoming, True
            assert isinstance(item, _ApplyJob | _CallJob | _OpenJob)
            if isinstance(item, _ApplyJob):
                if jobs and operations + len(item.ops) > self._max_ops:
                    return jobs, [item, *incoming], False
                operations += len(item.ops)
            jobs.append(item)

    def _run_jobs(self, jobs: list[_Job]) -> None:
        """Run consecutive apply jobs as one group, other jobs alone, keeping queue order."""
        index = 0
        while index < len(jobs):
            job = jobs[index]
            results: list[_Result]
            if isinstance(job, _OpenJob):
                results = [self._open(job)]
                index += 1
            elif isinstance(job, _CallJob):
                results = [self._call(job)]
                index += 1
            else:
                group: list[_ApplyJob] = []
                while index < len(jobs) and isinstance(jobs[index], _ApplyJob):
                    group.append(jobs[index])  # type: ignore[arg-type]
                    index += 1
                results = self._apply_group(group)
            _deliver(results)

    def _open(self, job: _OpenJob) -> _Result:
        try:
            connection = self._engine.connect()
            self._connection = connection
            driver = self._driver = _driver_of(connection)
            driver.execute(f"PRAGMA wal_autocheckpoint = {_WRITER_AUTOCHECKPOINT_PAGES}")
            driver.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT_BYTES}")
            if job.migrate:
                migrate_connection(connection, mode=job.mode, where=self._where)
            return job.future, None, None
        except Exception as exc:
            self._close()
            return job.future, None, self._error(exc)

    def _close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:
                log.exception("closing the writer connection of %s failed", self._where)
        self._connection = None
        self._driver = None

    def _not_open(self) -> StoreUnavailable:
        return StoreUnavailable(f"the timer store on {self._where} is not open")

    def _call(self, job: _CallJob) -> _Result:
        connection, driver = self._connection, self._driver
        if connection is None or driver is None:
            return job.future, None, self._not_open()
        try:
            driver.execute("BEGIN IMMEDIATE")
            try:
                result = job.fn(connection)
                driver.execute("COMMIT")
            except BaseException:
                self._rollback(driver)
                raise
            finally:
                # Statements run through SQLAlchemy autobegin on its side; the transaction
                # is ours (BEGIN IMMEDIATE above), so only SQLAlchemy's state is reset here.
                connection.rollback()
            self.transactions += 1
            self._checkpointer.poke()
            return job.future, result, None
        except Exception as exc:
            return job.future, None, self._error(exc)

    def _apply_group(self, group: list[_ApplyJob]) -> list[_Result]:
        driver = self._driver
        if driver is None:
            closed = self._not_open()
            return [(job.future, None, closed) for job in group]
        ops = [op for job in group for op in job.ops]
        try:
            outcomes = self._apply_ops(driver, ops)
        except Exception as exc:
            error = self._error(exc)
            if len(group) == 1 or isinstance(error, StoreUnavailable):
                return [(job.future, None, error) for job in group]
            # One caller's bad operation (a constraint, a missing service call) must not fail
            # the others that happened to share its transaction: redo them one by one.
            log.debug("group commit of %d calls failed (%s); retrying each", len(group), error)
            return [self._apply_alone(driver, job) for job in group]
        results: list[_Result] = []
        start = 0
        for job in group:
            end = start + len(job.ops)
            results.append((job.future, outcomes[start:end], None))
            start = end
        return results

    def _apply_alone(self, driver: sqlite3.Connection, job: _ApplyJob) -> _Result:
        try:
            return job.future, self._apply_ops(driver, job.ops), None
        except Exception as exc:
            return job.future, None, self._error(exc)

    def _apply_ops(self, driver: sqlite3.Connection, ops: list[_Op]) -> list[CommandOutcome]:
        """Apply ``ops`` in order in one transaction of their own."""
        driver.execute("BEGIN IMMEDIATE")
        try:
            outcomes = _write_ops(driver.cursor(), ops)
            driver.execute("COMMIT")
        except BaseException:
            self._rollback(driver)
            raise
        self.transactions += 1
        self._checkpointer.poke()
        return outcomes

    def _rollback(self, driver: sqlite3.Connection) -> None:
        if driver.in_transaction:
            try:
                driver.execute("ROLLBACK")
            except sqlite3.Error:
                log.exception("rollback on %s failed", self._where)

    def _error(self, exc: Exception) -> BaseException:
        if isinstance(exc, ValueError | TypeError):
            return exc
        return translate_error(exc, self._where)


class SqliteTimerStore(TimerStore):
    """A :class:`~timer_core.ports.TimerStore` on a SQLite file, through SQLAlchemy.

    ``mode="standalone"`` (default): the timer owns the file. ``mode="shared"``: the file is
    the host's and already holds ``service_calls(tenant_id, service_call_id)``; the timer
    table then references it with ``ON DELETE CASCADE``, so deleting a service call deletes
    its timer. ``synchronous="NORMAL"`` (default) with WAL never corrupts the database and
    keeps every commit across a crash of the process, but a power loss may lose the last
    commits; ``"FULL"`` syncs every commit to disk at a cost in write throughput.
    ``busy_timeout_ms`` is how long a write waits for another process's lock before it
    raises :class:`~timer_core.errors.StoreUnavailable`. ``pragmas`` are extra per-connection
    pragmas (``cache_size``, ``max_page_count``, ...). ``max_group_operations`` bounds how
    many queued operations one group commit takes, to keep transactions short.

    Timers written by other connections (a host's own transaction, see
    :func:`schedule_in_transaction`; another process) are noticed within
    ``watch_interval_s``: the store checks SQLite's ``PRAGMA data_version``, which changes
    when any other connection commits, and then calls ``on_remote_schedule`` with the
    earliest due time, so the worker wakes (:class:`~timer_core.Timer` registers it through
    :meth:`watch_remote_schedules`). ``watch_interval_s=None`` turns the check off; the
    worker's poll stays the safety net either way.

    Nothing is opened before :meth:`start`, which also applies the migrations.
    ``migrate=False`` (for read-only tools) creates and changes nothing at start: it
    refuses a missing file or one whose schema is not current
    (:class:`~timer_core.errors.SchemaNotFound` when there is none).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: StoreMode = "standalone",
        synchronous: Synchronous = "NORMAL",
        busy_timeout_ms: int = 5000,
        pragmas: Mapping[str, int | str] | None = None,
        max_group_operations: int = 10_000,
        on_remote_schedule: Callable[[datetime], None] | None = None,
        watch_interval_s: float | None = 0.1,
        migrate: bool = True,
    ) -> None:
        if mode not in ("standalone", "shared"):
            raise ValueError(f"mode must be 'standalone' or 'shared', got {mode!r}")
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        if busy_timeout_ms < 0:
            raise ValueError(f"busy_timeout_ms must be >= 0, got {busy_timeout_ms}")
        if max_group_operations < 1:
            raise ValueError(f"max_group_operations must be >= 1, got {max_group_operations}")
        if watch_interval_s is not None and not watch_interval_s > 0:
            raise ValueError(f"watch_interval_s must be positive or None, got {watch_interval_s}")
        self.path = os.fspath(path)
        self.mode: StoreMode = mode
        self._synchronous: Synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._pragmas = dict(pragmas or {})
        self._max_group_operations = max_group_operations
        self.on_remote_schedule = on_remote_schedule
        """Called on the event loop with the earliest due time after another connection
        committed (see the class notes)."""
        self._watch_interval_s = watch_interval_s
        self._watch: asyncio.Task[None] | None = None
        self._migrate = migrate
        self._engine: sa.Engine | None = None
        self._writer: _Writer | None = None
        self._reader: _Reader | None = None
        self._lifecycle = asyncio.Lock()

    def __repr__(self) -> str:
        return f"SqliteTimerStore({self.path!r}, mode={self.mode!r})"

    @property
    def transactions_committed(self) -> int:
        """Write transactions committed since :meth:`start` (group commits count once)."""
        return 0 if self._writer is None else self._writer.transactions

    @property
    def checkpoints_completed(self) -> int:
        """WAL checkpoints run beside the writer since :meth:`start` (see the module notes)."""
        return 0 if self._writer is None else self._writer.checkpoints

    @property
    def engine(self) -> sa.Engine:
        """The SQLAlchemy engine (after :meth:`start`), e.g. for a host's own queries."""
        if self._engine is None:
            raise StoreUnavailable(f"the timer store on {self.path} is not started")
        return self._engine

    async def start(self) -> None:
        # Opening switches the file to WAL and migrates it; another connection doing that at
        # the same moment (a second store or process) can make SQLite answer busy at once,
        # without waiting for the busy timeout, so opening is retried for that long.
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        while True:
            try:
                await self._start_once()
                return
            except StoreUnavailable as exc:
                busy = "SQLITE_BUSY" in str(exc) or "SQLITE_LOCKED" in str(exc)
                if not busy or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    async def _start_once(self) -> None:
        async with self._lifecycle:
            if self._writer is not None:
                return
            if not self._migrate:
                # Checked reading only, before any connection could create or convert it.
                await asyncio.to_thread(check_schema, self.path)
            engine = create_sqlite_engine(
                self.path,
                synchronous=self._synchronous,
                busy_timeout_ms=self._busy_timeout_ms,
                pragmas=self._pragmas,
            )
            writer = _Writer(engine, self.path, self._max_group_operations)
            writer.start()
            reader = _Reader(engine, self.path)
            reader.start()
            try:
                loop = asyncio.get_running_loop()
                opened: asyncio.Future[None] = loop.create_future()
                writer.submit(_OpenJob(self.mode, opened, self._migrate))
                await opened
                # The first read opens the reader's connection: fail now, not at the first poll.
                reader_opened: asyncio.Future[None] = loop.create_future()
                reader.submit(lambda _: None, reader_opened)
                await reader_opened
            except BaseException as exc:
                await self._shutdown(engine, writer, reader)
                if isinstance(exc, Exception) and not isinstance(exc, StoreError):
                    raise translate_error(exc, self.path) from exc
                raise
            self._engine, self._writer, self._reader = engine, writer, reader
            if self._watch_interval_s is not None:
                self._watch = asyncio.create_task(self._watch_other_commits(self._watch_interval_s))
            log.debug("timer store on %s started (%s mode)", self.path, self.mode)

    async def aclose(self) -> None:
        async with self._lifecycle:
            if self._writer is None or self._engine is None or self._reader is None:
                return
            engine, writer, reader = self._engine, self._writer, self._reader
            self._engine = self._writer = self._reader = None
            watch, self._watch = self._watch, None
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            await self._shutdown(engine, writer, reader)
            log.debug("timer store on %s closed", self.path)

    @staticmethod
    async def _shutdown(engine: sa.Engine, writer: _Writer, reader: _Reader) -> None:
        # Reads and writes queued before the stop markers still run and resolve their callers.
        writer.stop()
        reader.stop()
        await asyncio.to_thread(writer.join)
        await asyncio.to_thread(reader.join)
        engine.dispose()

    def watch_remote_schedules(self, callback: RemoteScheduleCallback | None) -> bool:
        """Have ``callback(due_at)`` called after other connections commit timers.

        Returns False when the store was made with ``watch_interval_s=None`` (no watch).
        """
        self.on_remote_schedule = callback
        return self._watch_interval_s is not None

    async def _watch_other_commits(self, interval: float) -> None:
        """Hand ``on_remote_schedule`` the earliest due time whenever another connection
        committed (``data_version`` moved): one cheap pragma per interval otherwise."""
        last: int | None = None
        while True:
            try:
                last, due_at = await self._read(partial(_changes_since, last))
            except StoreError as exc:
                log.debug("checking %s for other connections' commits failed: %s", self.path, exc)
                due_at = None
            callback = self.on_remote_schedule
            if due_at is not None and callback is not None:
                try:
                    callback(due_at)
                except Exception:  # the host's callback must not end the watch
                    log.exception("the on_remote_schedule callback failed")
            await asyncio.sleep(interval)

    def _running_writer(self) -> _Writer:
        writer = self._writer
        if writer is None:
            raise StoreUnavailable(f"the timer store on {self.path} is not started or closed")
        return writer

    async def _write(self, fn: Callable[[sa.Connection], T]) -> T:
        writer = self._running_writer()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        writer.submit(_CallJob(fn, future))
        return await future

    async def _read(self, fn: Callable[[sa.Connection], T]) -> T:
        reader = self._reader
        if reader is None:
            raise StoreUnavailable(f"the timer store on {self.path} is not started or closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        reader.submit(fn, future)
        return await future

    # -- writes ----------------------------------------------------------------------------

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        ops = _as_ops(operations)
        if not ops:
            return []
        writer = self._running_writer()
        future: asyncio.Future[list[CommandOutcome]] = asyncio.get_running_loop().create_future()
        writer.submit(_ApplyJob(ops, future))
        return await future

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        params = []
        # A firing batch shares one reached_at (the pass's `now`): format it once.
        reached: datetime | None = None
        reached_text = ""
        for entry in entries:
            if entry.reached_at is None:
                raise ValueError(f"mark_reached needs Reached entries, got {entry}")
            if entry.reached_at != reached:
                reached = entry.reached_at
                reached_text = _write_timestamp(reached)
            params.append(
                (
                    reached_text,
                    entry.tenant_id,
                    entry.service_call_id,
                    _write_timestamp(entry.due_at),
                )
            )
        if not params:
            return 0

        # Straight through the DBAPI connection: the poller's hot path (measured). One
        # statement for the batch unless a key repeats in it (UPDATE ... FROM would update
        # such a row once, with either reached_at; one by one, the first mark stays).
        def mark(connection: sa.Connection) -> int:
            driver = _driver_of(connection)
            if _JSON_STATEMENTS and len({row[1:3] for row in params}) == len(params):
                return driver.execute(_MARK_REACHED_JSON, (json.dumps(params),)).rowcount
            return driver.executemany(_MARK_REACHED, params).rowcount

        return await self._write(mark)

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        before = format_timestamp(require_utc(reached_before, "reached_before"))
        if limit <= 0:
            return 0
        params = {"before": before, "limit": limit}

        def purge(connection: sa.Connection) -> int:
            deleted = connection.execute(_PURGE_REACHED, params).rowcount
            if deleted < limit:
                rest = {"before": before, "limit": limit - deleted}
                deleted += connection.execute(_PURGE_TOMBSTONES, rest).rowcount
            return deleted

        return await self._write(purge)

    # -- reads -----------------------------------------------------------------------------

    async def get(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> TimerEntry | None:
        params = {"tenant": TenantId(tenant_id), "call": ServiceCallId(service_call_id)}

        def get(connection: sa.Connection) -> TimerEntry | None:
            row = connection.execute(_GET, params).first()
            return None if row is None else _entry(row)

        return await self._read(get)

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        now_text = format_timestamp(require_utc(now, "now"))
        if limit <= 0:
            return []
        sql: str
        args: tuple[Any, ...]
        if after is None:
            sql, args = _FIND_DUE, (now_text, limit)
        else:
            cursor = DueCursor(*after)
            sql = _FIND_DUE_AFTER
            args = (
                now_text,
                format_timestamp(require_utc(cursor.due_at, "after.due_at")),
                TenantId(cursor.tenant_id),
                ServiceCallId(cursor.service_call_id),
                limit,
            )

        # The poller's hot path: straight through the DBAPI connection, measured at a
        # fraction of the per-call cost of a SQLAlchemy execute (see bench/README.md).
        def find(connection: sa.Connection) -> list[TimerEntry]:
            rows = _driver_of(connection).execute(sql, args).fetchall()
            return [_entry(row) for row in rows]

        return await self._read(find)

    @property
    def finds_due_by_tenant(self) -> bool:
        return True

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        now_text = format_timestamp(require_utc(now, "now"))
        if limit <= 0:
            return []
        cursors: dict[str, tuple[str, str]] = {
            TenantId(tenant): (
                format_timestamp(require_utc(cursor.due_at, "after.due_at")),
                ServiceCallId(cursor.service_call_id),
            )
            for tenant, cursor in after.items()
        }

        def find(connection: sa.Connection) -> list[TimerEntry]:
            driver = _driver_of(connection)
            active = [row[0] for row in driver.execute(_DUE_TENANTS, (now_text,))]
            found: list[TimerEntry] = []
            # Rounds: every tenant still active gets an equal share; those that filled it
            # may take what the others left in the next round.
            while len(found) < limit and active:
                share = max(1, (limit - len(found)) // len(active))
                active = active[: limit - len(found)]  # one each at least, longest waiting
                wanted = [[tenant, *cursors.get(tenant, ("", ""))] for tenant in active]
                rows = driver.execute(
                    _FIND_DUE_OF_TENANTS, (json.dumps(wanted), now_text, share)
                ).fetchall()
                taken: dict[str, int] = {}
                for row in rows:
                    taken[row[0]] = taken.get(row[0], 0) + 1
                    last = cursors.get(row[0])
                    if last is None or (row[3], row[1]) > last:
                        cursors[row[0]] = (row[3], row[1])
                found += [_entry(row) for row in rows]
                active = [tenant for tenant in active if taken.get(tenant, 0) == share]
            found.sort(key=DueCursor.of)
            return found[:limit]

        return await self._read(find)

    async def find_due_for_tenant(
        self, tenant_id: TenantId, now: datetime, limit: int
    ) -> list[TimerEntry]:
        args = (TenantId(tenant_id), format_timestamp(require_utc(now, "now")), limit)
        if limit <= 0:
            return []

        def find(connection: sa.Connection) -> list[TimerEntry]:
            rows = _driver_of(connection).execute(_FIND_DUE_FOR_TENANT, args).fetchall()
            return [_entry(row) for row in rows]

        return await self._read(find)

    async def find_by_correlation(
        self, tenant_id: TenantId, correlation_id: CorrelationId
    ) -> list[TimerEntry]:
        params = {"tenant": TenantId(tenant_id), "correlation": CorrelationId(correlation_id)}

        def find(connection: sa.Connection) -> list[TimerEntry]:
            return [_entry(row) for row in connection.execute(_FIND_BY_CORRELATION, params)]

        return await self._read(find)

    async def list_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        limit: int = 1000,
        after: ServiceCallId | None = None,
    ) -> list[TimerEntry]:
        # "" sorts before every valid id, so one statement serves the first page too.
        params = {
            "tenant": TenantId(tenant_id),
            "after": "" if after is None else ServiceCallId(after),
            "limit": limit,
        }
        if limit <= 0:
            return []

        def find(connection: sa.Connection) -> list[TimerEntry]:
            return [_entry(row) for row in connection.execute(_LIST_FOR_TENANT, params)]

        return await self._read(find)

    async def next_due_at(self) -> datetime | None:
        def find(connection: sa.Connection) -> datetime | None:
            (due_at,) = _driver_of(connection).execute(_NEXT_DUE_AT).fetchone()
            return None if due_at is None else _read_timestamp(due_at)

        return await self._read(find)

    async def count_scheduled_for_tenant(self, tenant_id: TenantId) -> int:
        args = (TenantId(tenant_id),)

        def count(connection: sa.Connection) -> int:
            (found,) = _driver_of(connection).execute(_COUNT_SCHEDULED_FOR_TENANT, args).fetchone()
            return int(found)

        return await self._read(count)

    async def count_scheduled(self) -> int:
        def count(connection: sa.Connection) -> int:
            return int(connection.execute(_COUNT_SCHEDULED).scalar_one())

        return await self._read(count)


def _changes_since(last: int | None, connection: sa.Connection) -> tuple[int, datetime | None]:
    """``(data_version, earliest due time)`` when another connection committed since
    ``last``; the due time is None when nothing changed (or nothing is scheduled)."""
    driver = _driver_of(connection)
    (version,) = driver.execute("PRAGMA data_version").fetchone()
    if last is None or version == last:
        return version, None
    (due_at,) = driver.execute(_NEXT_DUE_AT).fetchone()
    return version, None if due_at is None else _read_timestamp(due_at)


def schedule_in_transaction(
    connection: sa.Connection | sqlalchemy.orm.Session,
    command: ScheduleTimer,
    *,
    now: datetime,
    correlation_id: str | None = None,
) -> CommandOutcome:
    """Schedule (or reschedule) a timer inside the caller's own transaction on the database.

    The timer exists if and only if that transaction commits; a running
    :class:`SqliteTimerStore` on the same file notices the commit within its
    ``watch_interval_s`` and wakes its worker (see ``watch_remote_schedules``). ``now`` is the
    caller's clock reading (the timer's ``registered_at``); adapters never read the clock.
    ``connection`` is a SQLAlchemy :class:`~sqlalchemy.Connection` or ORM
    :class:`~sqlalchemy.orm.Session` on the store's SQLite file, with any driver (a
    transaction is begun if none is; on SQLAlchemy's asyncio API, call this through
    ``run_sync``); the timer schema must be there (start the store once, or call
    :func:`migrate`).

    Returns ``SCHEDULED``, or ``IGNORED_REACHED`` when the timer already fired (it is never
    re-armed). Raises ``ValueError`` when the connection runs without transactions, and
    :class:`~timer_core.errors.StoreError` (``StoreUnavailable`` when the database is
    locked) when the write fails; the caller's transaction is then theirs to roll back.
    """
    entry = scheduled_entry(command, now, correlation_id=correlation_id)
    (outcome,) = _write_in_transaction(connection, _as_ops([entry]))
    return outcome


def cancel_in_transaction(
    connection: sa.Connection | sqlalchemy.orm.Session, command: CancelTimer
) -> CommandOutcome:
    """Cancel a ``Scheduled`` timer inside the caller's own transaction (see
    :func:`schedule_in_transaction`): ``CANCELLED`` once that commits, or ``CANCEL_NOOP``
    when the timer is unknown or already fired."""
    key = TimerKey(command.tenant_id, command.service_call_id)
    (outcome,) = _write_in_transaction(connection, _as_ops([key]))
    return outcome


def _write_in_transaction(
    connection: sa.Connection | sqlalchemy.orm.Session, ops: list[_Op]
) -> list[CommandOutcome]:
    if isinstance(connection, sqlalchemy.orm.Session):
        connection = connection.connection()
    if connection.dialect.name != "sqlite":
        raise ValueError(
            f"timer_adapters_sqlite needs a SQLite connection, got {connection.dialect.name}"
        )
    if not connection.in_transaction():
        connection.begin()
    where = str(connection.engine.url.database)
    # The driver's own view (sqlite3 or aiosqlite): SQLAlchemy's transaction is only a
    # promise when the driver runs without transactions (isolation_level=None).
    driver = connection.connection.driver_connection
    if not getattr(driver, "in_transaction", True) and (
        getattr(driver, "isolation_level", "") is None
    ):
        raise ValueError(
            f"the connection to {where} runs without transactions (its sqlite3 connection has "
            "isolation_level=None, as SqliteTimerStore.engine's do) and none is open, so the "
            "timer would be committed at once: use an engine of your own "
            "(sqlalchemy.create_engine('sqlite:///...')) or open one with BEGIN first"
        )
    try:
        return _write_ops(_HostCursor(connection), ops)
    except sqlalchemy.exc.DBAPIError as exc:
        error = translate_error(exc, where)
        if "no such table" in str(exc.orig):
            error = StoreError(f"{error} (start a SqliteTimerStore on it once, or call migrate())")
        raise error from exc
