"""The timer store on PostgreSQL, shared by several timer-service instances through leased claims.

Blocking SQLAlchemy/psycopg calls run in a small thread pool of the store's own; the
claims and the marks of fired batches run on two connections used from the event loop
(see :mod:`._lanes`), and so does the ``LISTEN`` connection (see :mod:`._listener`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from time import monotonic
from typing import Any, TypeVar

import attrs
import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
import sqlalchemy.orm

from timer_adapters_postgres._census import PostgresCensus
from timer_adapters_postgres._clock import DatabaseClock
from timer_adapters_postgres._errors import is_retryable, translate_error
from timer_adapters_postgres._host_connection import (
    HostConnection,
    PsycopgWriter,
    psycopg_connection,
)
from timer_adapters_postgres._lanes import StatementLane, pyformat
from timer_adapters_postgres._listener import ScheduleListener, notify_payload, peer_payload
from timer_adapters_postgres._schema import SCHEMA_VERSION, migrate, schema_version
from timer_adapters_postgres._schema import timer_schedules as t
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ConfigurationError,
    CorrelationId,
    DueCursor,
    PositionedOperation,
    RemoteScheduleCallback,
    ScheduleTimer,
    SchemaNotFound,
    SchemaVersionError,
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
    redact_url,
    require_utc,
    scheduled_entry,
)

__all__ = ["PostgresTimerStore", "cancel_in_transaction", "schedule_in_transaction"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_SCHEDULED = TimerState.SCHEDULED.value
_ATTEMPTS = 5  # for deadlocks, serialisation failures and racing inserts
# Keeps the claim bookkeeping bounded when claims are taken over and never marked here.
_MAX_TRACKED_CLAIMS = 100_000
# The NOTIFY payload's owner for a host's own transactions: no store skips it as its own.
_HOST_TRANSACTION = "host-transaction"

_ENTRY_COLUMNS = (
    t.c.tenant_id,
    t.c.service_call_id,
    t.c.correlation_id,
    t.c.due_at,
    t.c.registered_at,
    t.c.state,
    t.c.reached_at,
    t.c.traceparent,
    t.c.tracestate,
)
_RETURNING = (
    "tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at, "
    "traceparent, tracestate"
)

# Claiming: the LIMIT sits inside the locking subquery, which walks ix_timer_schedules_due in
# order, skips rows another transaction holds, and stops after :limit rows (no sort, no scan
# of the whole backlog). A row whose lease ran out, or that this owner holds, is claimable
# again; every claim bumps lease_token, which fences marks by an earlier claim. The outer
# UPDATE finds the locked rows by ctid (a TID scan): matched by key instead, as
# "(tenant_id, service_call_id) IN (...)", PostgreSQL turns it into a hash semi-join over a
# sequential scan of the whole table for batches of ~1000 and for every generic plan (which
# psycopg's automatic prepared statements lead to). The ctids cannot move meanwhile: this
# statement holds the row locks.
# A claim of the rows its subquery locks: leased to this owner, their token bumped.
_CLAIM_ROWS = """
UPDATE timer_schedules
SET lease_owner = :owner,
    lease_until = now() + CAST(:lease AS interval),
    lease_token = lease_token + 1
WHERE ctid = ANY(ARRAY({locked}))
RETURNING {{returning}}, lease_token
"""
_CLAIM = _CLAIM_ROWS.format(
    locked="""
    SELECT ctid
    FROM timer_schedules
    WHERE state = 'Scheduled'
      AND due_at <= :now
      AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
      {after}
    ORDER BY {order}
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
"""
)
_DUE_ORDER = "due_at, tenant_id, service_call_id"
_CLAIM_FIRST = sa.text(_CLAIM.format(after="", order=_DUE_ORDER, returning=_RETURNING))
_CLAIM_AFTER = sa.text(
    _CLAIM.format(
        after="AND (due_at, tenant_id, service_call_id) > (:after_due, :after_tenant, :after_call)",
        order=_DUE_ORDER,
        returning=_RETURNING,
    )
)

# Claims (find_due and find_due_by_tenant) run on a connection of their own (a lane: see
# ._lanes), planned without sorts and bitmap scans (session settings given when it
# connects; nothing else runs on it): their plans must be walks of an index in its order.
# Statistics that call nothing due (taken while a storm was far off, the usual case) make
# PostgreSQL sort each tenant's share out of all its due rows, read by a bitmap scan or the
# primary key (0.5 ms and 180 rows per tenant of a claim, 8,800 buffers for 100 timers at
# 20,000 due, in bench/scale_out.py), where the walk of ix_timer_schedules_tenant_due in
# its order stops after the share. (Set per transaction instead, the claim took a
# transaction of four round trips: BEGIN, the settings with the tenants, the claim, COMMIT.)
# And without JIT: a plan that must sort anyway (the tenants' list) is costed at 10^10 with
# sorts off, far past jit_above_cost, and compiling it took 60 ms a claim.
_CLAIM_PLANNING = (
    ("enable_sort", "off"),
    ("enable_bitmapscan", "off"),
    ("enable_incremental_sort", "off"),
    ("jit", "off"),
)
# find_due_by_tenant: the tenants with pending timers and their earliest due time, one index
# seek per tenant (a loose scan of ix_timer_schedules_tenant_due), longest waiting first ...
_DUE_TENANTS = sa.text(
    """
WITH RECURSIVE pending AS (
    (SELECT tenant_id, due_at FROM timer_schedules
     WHERE state = 'Scheduled'
     ORDER BY tenant_id, due_at, service_call_id LIMIT 1)
  UNION ALL
    SELECT n.tenant_id, n.due_at FROM pending AS p CROSS JOIN LATERAL (
        SELECT tenant_id, due_at FROM timer_schedules
        WHERE state = 'Scheduled' AND tenant_id > p.tenant_id
        ORDER BY tenant_id, due_at, service_call_id LIMIT 1
    ) AS n
)
SELECT tenant_id, due_at FROM pending
WHERE due_at <= :now ORDER BY due_at, tenant_id LIMIT :limit
"""
)
# (When they were fewer than asked for, i.e. every tenant with due timers, the next claims of
# the drain reuse the list for up to _TENANTS_REUSED_S, less those whose share came back
# short: a claim is then one statement. A tenant that falls due meanwhile waits that long.)
_TENANTS_REUSED_S = 0.1
# ... then every tenant's share in one statement (one round trip, one commit, not one per
# tenant): each tenant's rows claimed like _CLAIM, in its own order after its cursor. Written
# so that only ix_timer_schedules_tenant_due can serve it, whatever the statistics say: the
# tenant is bounded by row comparisons (no plain "tenant_id = ...", which pkey and the
# correlation index serve as well), the order names the tenant, and the connections plan
# without sorts and bitmap scans. Before, with "due_at <= :now", statistics taken while the
# storm was far off (or none yet) had each tenant's LIMIT walk ix_timer_schedules_due across
# every tenant's due timers, or sort the tenant's rows: 6-7 ms (at 10,000 due) and 11-35 ms
# (at 20,000) a claim of 100, against 1-2 ms. Each tenant's share is its own (a limit that
# does not divide evenly among the tenants is not left to a second statement); with sorts
# allowed, that made the generic plan assume a tenth of each tenant's rows and sort them.
_CLAIM_OF_TENANTS = _CLAIM_ROWS.format(
    locked="""
    SELECT c.ctid
    FROM unnest(
        CAST(:tenants AS text[]), CAST(:after_dues AS timestamptz[]),
        CAST(:after_calls AS text[]), CAST(:shares AS int[]))
        AS k(tenant_id, after_due, after_call, share)
    CROSS JOIN LATERAL (
        SELECT ctid
        FROM timer_schedules
        WHERE state = 'Scheduled'
          AND (tenant_id, due_at, service_call_id) > (k.tenant_id, k.after_due, k.after_call)
          AND (tenant_id, due_at) <= (k.tenant_id, CAST(:now AS timestamptz))
          AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
        ORDER BY tenant_id, due_at, service_call_id
        LIMIT k.share
        FOR UPDATE SKIP LOCKED
    ) AS c
"""
)
_CLAIM_BY_TENANT = sa.text(_CLAIM_OF_TENANTS.format(returning=_RETURNING))


_BEFORE_ALL = datetime(1, 1, 1, tzinfo=UTC)
# Instances say they are there this often on the LISTEN channel, and one not heard for
# _PEER_GONE_S no longer owns tenants (see PostgresTimerStore._by_preference).
_PEER_EVERY_S = 1.0
_PEER_GONE_S = 3.5
# ... and another instance's tenant whose earliest timer waits this much longer than this
# instance's own earliest is claimed as if it were its own (the other is behind).
_HELP_BEHIND = timedelta(seconds=1)
_READ_CLOCK = "SELECT clock_timestamp() AS now"
_ANNOUNCE_SQL = "SELECT pg_notify(%(channel)s, %(payload)s)"


def _assigned(tenant: str, owners: Sequence[str]) -> str:
    """The instance among ``owners`` that claims ``tenant`` first (rendezvous hashing)."""
    return max(owners, key=lambda owner: zlib.crc32(f"{owner}\0{tenant}".encode()))


# The statements the lanes run, in psycopg's parameter style.
_CLAIM_FIRST_SQL = pyformat(_CLAIM_FIRST)
_CLAIM_AFTER_SQL = pyformat(_CLAIM_AFTER)
_DUE_TENANTS_SQL = pyformat(_DUE_TENANTS)
_CLAIM_BY_TENANT_SQL = pyformat(_CLAIM_BY_TENANT)

_LOCK_KEYS = sa.text(
    """
SELECT s.tenant_id, s.service_call_id, s.state, s.command_position
FROM timer_schedules AS s
JOIN unnest(CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]))
    AS k(tenant_id, service_call_id)
  ON s.tenant_id = k.tenant_id AND s.service_call_id = k.service_call_id
ORDER BY s.tenant_id, s.service_call_id
FOR UPDATE OF s
"""
)
# Only for batches with positioned operations: the keys' tombstones (their positions).
_LOCK_TOMBSTONES = sa.text(
    """
SELECT c.tenant_id, c.service_call_id, c.command_position
FROM timer_tombstones AS c
JOIN unnest(CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]))
    AS k(tenant_id, service_call_id)
  ON c.tenant_id = k.tenant_id AND c.service_call_id = k.service_call_id
ORDER BY c.tenant_id, c.service_call_id
FOR UPDATE OF c
"""
)
# The arrays a batch of timers is bound as, and the row they make: written once for the
# insert, the reschedule and the one-statement insert of new timers.
_TIMER_ARRAYS = """
    CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]),
    CAST(:correlation_ids AS text[]), CAST(:due_ats AS timestamptz[]),
    CAST(:registered_ats AS timestamptz[]), CAST(:positions AS bigint[]),
    CAST(:traceparents AS text[]), CAST(:tracestates AS text[])"""
_TIMER_COLUMNS = """v(tenant_id, service_call_id, correlation_id, due_at, registered_at, position,
         traceparent, tracestate)"""
_INSERT = sa.text(
    f"""
INSERT INTO timer_schedules
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, command_position,
     traceparent, tracestate)
SELECT * FROM unnest({_TIMER_ARRAYS})
ON CONFLICT (tenant_id, service_call_id) DO NOTHING
RETURNING tenant_id
"""
)
# Rescheduling drops any lease: the old claim was for the old due time. An unpositioned
# reschedule keeps the stored position.
_RESCHEDULE = sa.text(
    f"""
UPDATE timer_schedules AS s
SET due_at = v.due_at, registered_at = v.registered_at, correlation_id = v.correlation_id,
    command_position = coalesce(v.position, s.command_position),
    traceparent = v.traceparent, tracestate = v.tracestate,
    lease_owner = NULL, lease_until = NULL
FROM unnest({_TIMER_ARRAYS})
    AS {_TIMER_COLUMNS}
WHERE s.tenant_id = v.tenant_id AND s.service_call_id = v.service_call_id
"""
)
_TOMBSTONE = sa.text(
    """
INSERT INTO timer_tombstones AS c (tenant_id, service_call_id, command_position, cancelled_at)
SELECT * FROM unnest(
    CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]),
    CAST(:positions AS bigint[]), CAST(:cancelled_ats AS timestamptz[]))
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    command_position = greatest(c.command_position, excluded.command_position),
    cancelled_at = excluded.cancelled_at
"""
)
_DELETE = sa.text(
    """
DELETE FROM timer_schedules AS s
USING unnest(CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]))
    AS v(tenant_id, service_call_id)
WHERE s.tenant_id = v.tenant_id AND s.service_call_id = v.service_call_id
  AND s.state = 'Scheduled'
"""
)
_NOTIFY = sa.text("SELECT pg_notify(:channel, :payload)")
# The common batch, only new timers (no row, no tombstone for any key): inserted, and the
# earliest announced, in one statement, so one round trip (and in autocommit one commit)
# instead of locking the keys, their tombstones, inserting and notifying in four. Any key
# already there (or inserted meanwhile by another transaction) and the batch goes the
# general way, which sees what this statement may have inserted as its own reschedules.
_INSERT_NEW = f"""
WITH v AS (
    SELECT * FROM unnest({_TIMER_ARRAYS})
        AS {_TIMER_COLUMNS}
), inserted AS (
    INSERT INTO timer_schedules
        (tenant_id, service_call_id, correlation_id, due_at, registered_at, command_position,
         traceparent, tracestate)
    SELECT * FROM v
    WHERE NOT EXISTS (
            SELECT FROM timer_schedules AS s JOIN v AS k
              ON s.tenant_id = k.tenant_id AND s.service_call_id = k.service_call_id)
      AND NOT EXISTS (
            SELECT FROM timer_tombstones AS c JOIN v AS k
              ON c.tenant_id = k.tenant_id AND c.service_call_id = k.service_call_id)
    ON CONFLICT (tenant_id, service_call_id) DO NOTHING
    RETURNING 1
), counted AS (
    SELECT count(*) AS inserted FROM inserted
)
SELECT inserted{{notify}} FROM counted
"""
_INSERT_NEW_QUIETLY = sa.text(_INSERT_NEW.format(notify=""))
_INSERT_NEW_AND_NOTIFY = sa.text(
    _INSERT_NEW.format(
        notify=", CASE WHEN inserted > 0 THEN pg_notify(:channel, :payload) IS NULL END"
    )
)
# Marking and releasing find each timer by its key, one primary-key lookup per timer (the
# locking LATERAL subquery is planned per row, never flattened into a join), and update the
# rows they locked by TID, like a claim. Joined to the keys as "FROM unnest(...) WHERE s.key =
# v.key", statistics taken before a storm (which call ~10 timers Scheduled) made PostgreSQL
# hash every Scheduled timer, read through ix_timer_schedules_due, for each batch: a mark of
# 100 read ~9,500 rows at 10,000 due (3-4 ms, O(backlog) per batch), and the bench's raw
# pipeline hit the same with a nested loop re-reading its 1,000 keys for each row.
_LOCKED_BY_KEY = """
UPDATE timer_schedules
SET {set}
WHERE ctid = ANY(ARRAY(
    SELECT m.ctid
    FROM unnest(
        CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]), {arrays})
        AS v(tenant_id, service_call_id, {columns})
    CROSS JOIN LATERAL (
        SELECT s.ctid
        FROM timer_schedules AS s
        WHERE s.tenant_id = v.tenant_id AND s.service_call_id = v.service_call_id
          AND s.state = 'Scheduled' AND {fence}
        FOR UPDATE
    ) AS m
))
"""
# The fence: a timer this store claimed is marked only under that very claim (same owner,
# same token: nobody claimed it since); one it never claimed only if nobody holds it now.
# One statement per reached_at (a firing batch shares one).
_MARK = sa.text(
    _LOCKED_BY_KEY.format(
        set="state = 'Reached', reached_at = :reached_at, lease_owner = NULL, lease_until = NULL",
        arrays="CAST(:due_ats AS timestamptz[]), CAST(:tokens AS bigint[])",
        columns="due_at, token",
        fence="""s.due_at = v.due_at
          AND CASE WHEN v.token IS NULL
              THEN s.lease_owner IS NULL OR s.lease_owner = :owner OR s.lease_until < now()
              ELSE s.lease_owner = :owner AND s.lease_token = v.token
          END""",
    )
)
_MARK_SQL = pyformat(_MARK)
_RELEASE = sa.text(
    _LOCKED_BY_KEY.format(
        set="lease_owner = NULL, lease_until = NULL",
        arrays="CAST(:tokens AS bigint[])",
        columns="token",
        fence="s.lease_owner = :owner AND s.lease_token = v.token",
    )
)
# Timers leased by another instance are left out: it is firing them, and counting them would
# make this worker spin on a due time it cannot claim. Expired leases count again.
_NEXT_DUE = sa.text(
    """
SELECT min(due_at) FROM timer_schedules
WHERE state = 'Scheduled'
  AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
"""
)
_PURGE = sa.text(
    """
DELETE FROM timer_schedules
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM timer_schedules
    WHERE state = 'Reached' AND reached_at < :before
    ORDER BY reached_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
))
"""
)
_PURGE_TOMBSTONES = sa.text(
    """
DELETE FROM timer_tombstones
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM timer_tombstones
    WHERE cancelled_at < :before
    ORDER BY cancelled_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
))
"""
)


@attrs.frozen
class _Claim:
    token: int
    due_at: datetime


def _key_of(op: TimerOperation) -> TimerKey:
    if isinstance(op, PositionedOperation):
        return op.key
    return op.key if isinstance(op, TimerEntry) else TimerKey(*op)


class _RacingInsert(Exception):
    """Another transaction inserted a key this apply saw absent; run the apply again."""


# The store's own row reader: the checks its rows need, not the constructor's converters.
_from_store = TimerEntry._from_store
_STATES = {state.value: state for state in TimerState}


def _entry(row: Any) -> TimerEntry:
    traceparent = row.traceparent
    return _from_store(
        row.tenant_id,
        row.service_call_id,
        row.due_at,
        row.registered_at,
        row.correlation_id,
        _STATES.get(row.state, row.state),
        row.reached_at,
        None if traceparent is None else TraceContext(traceparent, row.tracestate),
    )


def _due_order(entry: TimerEntry) -> tuple[datetime, str, str]:
    return (entry.due_at, entry.tenant_id, entry.service_call_id)


# Arrays go to PostgreSQL as array literals built here, each read by a CAST(... AS type[]):
# psycopg adapts a list element by element in Python, which was an eighth of a service's CPU
# on the fire path (4 arrays of 100 a mark, 8 of 1,000 a stored command batch).
def _text_array(values: Sequence[str | None]) -> str:
    """A ``text[]`` literal of ``values`` (None: NULL)."""
    if not values:
        return "{}"
    if None not in values:
        joined = '","'.join(values)  # type: ignore[arg-type]
        if '"' not in joined and "\\" not in joined:  # identifiers: nothing to escape
            return '{"' + joined + '"}'
    return (
        "{"
        + ",".join(
            "NULL" if value is None else '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            for value in values
        )
        + "}"
    )


def _timestamp_array(values: Sequence[datetime]) -> str:
    """A ``timestamptz[]`` literal of aware datetimes."""
    return "{" + ",".join([value.isoformat() for value in values]) + "}"


def _int_array(values: Sequence[int | None]) -> str:
    """A ``bigint[]`` literal of ``values`` (None: NULL)."""
    return "{" + ",".join(["NULL" if value is None else str(value) for value in values]) + "}"


def _columns(
    entries: Iterable[TimerEntry], positions: dict[TimerKey, int | None]
) -> dict[str, str]:
    rows = list(entries)
    contexts: list[TraceContext | None] = [e.trace_context for e in rows]
    return {
        "tenant_ids": _text_array([e.tenant_id for e in rows]),
        "service_call_ids": _text_array([e.service_call_id for e in rows]),
        "correlation_ids": _text_array([e.correlation_id for e in rows]),
        "due_ats": _timestamp_array([e.due_at for e in rows]),
        "registered_ats": _timestamp_array([e.registered_at for e in rows]),
        "positions": _int_array([positions.get(e.key) for e in rows]),
        "traceparents": _text_array([None if c is None else c.traceparent for c in contexts]),
        "tracestates": _text_array([None if c is None else c.tracestate for c in contexts]),
    }


def _key_columns(keys: Sequence[TimerKey]) -> dict[str, str]:
    return {
        "tenant_ids": _text_array([key.tenant_id for key in keys]),
        "service_call_ids": _text_array([key.service_call_id for key in keys]),
    }


def _new_timers(ops: list[TimerOperation]) -> tuple[list[TimerEntry], dict[TimerKey, int | None]]:
    """The timers ``ops`` schedule, with their positions, if the batch only schedules and
    names each timer once (else none: such a batch goes the general way)."""
    entries: list[TimerEntry] = []
    positions: dict[TimerKey, int | None] = {}
    for op in ops:
        position = None
        if isinstance(op, PositionedOperation):
            position, op = op.position, op.operation
        if not isinstance(op, TimerEntry) or op.key in positions:
            return [], {}
        entries.append(op)
        positions[op.key] = position
    return entries, positions


def _insert_new(
    conn: sa.Connection,
    ops: list[TimerOperation],
    channel: str,
    owner_id: str,
    wake_at_of: Callable[[list[TimerEntry]], datetime | None],
) -> tuple[list[CommandOutcome], datetime | None] | None:
    """Apply ``ops`` in one statement if they only schedule new timers: their outcomes and
    the wake-up sent; None (and maybe some inserted) when the general way must run."""
    entries, positions = _new_timers(ops)
    if not entries:
        return None
    wake_at = wake_at_of(entries)
    params: dict[str, Any] = {**_columns(entries, positions)}
    statement = _INSERT_NEW_QUIETLY
    if wake_at is not None:
        statement = _INSERT_NEW_AND_NOTIFY
        params.update(channel=channel, payload=notify_payload(wake_at, owner_id))
    if conn.execute(statement, params).scalar_one() != len(entries):
        return None
    return [CommandOutcome.SCHEDULED] * len(entries), wake_at


def _apply_operations(
    conn: sa.Connection,
    ops: list[TimerOperation],
    channel: str,
    owner_id: str,
    wake_at_of: Callable[[list[TimerEntry]], datetime | None],
) -> tuple[list[CommandOutcome], datetime | None]:
    """Apply ``ops`` in order in the transaction open on ``conn`` and ``NOTIFY`` the earliest
    new due time (``wake_at_of``) on ``channel``: the store's transactions and a host's own
    (:func:`schedule_in_transaction`) write timers through this one function. Raises
    :class:`_RacingInsert` when another transaction inserted one of the keys meanwhile."""
    keys = list(dict.fromkeys(_key_of(op) for op in ops))
    found = conn.execute(_LOCK_KEYS, _key_columns(keys)).all()
    initial = {TimerKey(row.tenant_id, row.service_call_id): row.state for row in found}
    # Replay the operations over the locked rows: later ones see earlier ones' effects.
    current: dict[TimerKey, str | None] = {key: initial.get(key) for key in keys}
    # The highest command position applied per key, where there is one.
    seen: dict[TimerKey, int] = {}
    if any(isinstance(op, PositionedOperation) for op in ops):
        stored = {
            TimerKey(row.tenant_id, row.service_call_id): row.command_position for row in found
        }
        seen = {key: value for key, value in stored.items() if value is not None}
        for row in conn.execute(_LOCK_TOMBSTONES, _key_columns(keys)):
            key = TimerKey(row.tenant_id, row.service_call_id)
            seen[key] = max(seen.get(key, row.command_position), row.command_position)
    final: dict[TimerKey, TimerEntry | None] = {}
    positions: dict[TimerKey, int | None] = {}
    tombstones: dict[TimerKey, tuple[int, datetime]] = {}
    outcomes: list[CommandOutcome] = []
    for op in ops:
        position: int | None = None
        at = None
        if isinstance(op, PositionedOperation):
            position, at = op.position, require_utc(op.at, "at")
            key = op.key
            if key in seen and position < seen[key]:
                outcomes.append(CommandOutcome.STALE)
                continue
            op = op.operation
        if isinstance(op, TimerEntry):
            if current[op.key] == TimerState.REACHED.value:
                outcomes.append(CommandOutcome.IGNORED_REACHED)
                continue
            current[op.key] = _SCHEDULED
            final[op.key] = op
            if position is not None:
                positions[op.key] = seen[op.key] = position
            outcomes.append(CommandOutcome.SCHEDULED)
            continue
        key = TimerKey(*op)
        if position is not None and at is not None:
            seen[key] = position
            tombstones[key] = (position, at)
        if current[key] == _SCHEDULED:
            current[key] = None
            final[key] = None
            positions.pop(key, None)
            outcomes.append(CommandOutcome.CANCELLED)
        else:
            outcomes.append(CommandOutcome.CANCEL_NOOP)
    inserts = [e for k, e in final.items() if e is not None and initial.get(k) is None]
    updates = [e for k, e in final.items() if e is not None and initial.get(k) is not None]
    deletes = [k for k, e in final.items() if e is None and initial.get(k) is not None]
    if inserts:
        inserted = conn.execute(_INSERT, _columns(inserts, positions)).all()
        if len(inserted) != len(inserts):
            raise _RacingInsert
    if updates:
        conn.execute(_RESCHEDULE, _columns(updates, positions))
    if deletes:
        conn.execute(_DELETE, _key_columns(deletes))
    if tombstones:
        marked = list(tombstones)
        conn.execute(
            _TOMBSTONE,
            {
                **_key_columns(marked),
                "positions": _int_array([tombstones[key][0] for key in marked]),
                "cancelled_ats": _timestamp_array([tombstones[key][1] for key in marked]),
            },
        )
    wake_at = wake_at_of(inserts + updates)
    if wake_at is not None:
        # Delivered on commit only, so listeners never look for an uncommitted timer.
        conn.execute(_NOTIFY, {"channel": channel, "payload": notify_payload(wake_at, owner_id)})
    return outcomes, wake_at


def _scheduled_as_batch() -> None:
    """Run the calling thread (one of the store's) as batch work on Linux (SCHED_BATCH).

    A thread the event loop hands a statement to, when woken on a busy machine, preempted
    the loop's thread, which still held the GIL it needed: both waited, and the switches
    cost CPU. A batch thread does not preempt on waking; it gets the same share of CPU. With
    four instances on two cores this cut a fired timer's CPU (services, PostgreSQL and
    nats-server) from 0.098-0.105 to 0.084-0.085 ms (bench/README.md, issue 14). Elsewhere,
    or where it is not allowed, threads keep the default policy.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:  # a sandbox refusing it: the default policy works, only slower
        log.debug("could not run the PostgreSQL store's threads as SCHED_BATCH", exc_info=True)


# Raises synchronous_commit from off to on for the session; any other level (local,
# remote_write, on, remote_apply) already waits for the local WAL flush and is kept.
_SYNCHRONOUS_COMMIT = (
    "SELECT set_config('synchronous_commit', 'on', false) "
    "WHERE current_setting('synchronous_commit') = 'off'"
)


def _commit_synchronously(dbapi_connection: Any, _record: object) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True  # a SELECT must not leave a transaction open
    try:
        dbapi_connection.execute(_SYNCHRONOUS_COMMIT)
    finally:
        dbapi_connection.autocommit = autocommit


def _default_owner_id() -> str:
    return f"{socket.gethostname()[:160]}-{os.getpid()}-{secrets.token_hex(4)}"


def _sqlalchemy_url(url: str) -> sa.URL:
    try:
        parsed = sa.make_url(url)
    except sqlalchemy.exc.ArgumentError as exc:
        raise ValueError(f"not a PostgreSQL URL: {redact_url(url)!r}") from exc
    backend, _, driver = parsed.drivername.partition("+")
    if backend not in ("postgresql", "postgres") or driver not in ("", "psycopg"):
        raise ValueError(
            f"not a PostgreSQL URL for psycopg 3: {redact_url(parsed.render_as_string())!r} "
            "(use postgresql://user:password@host:port/database)"
        )
    return parsed.set(drivername="postgresql+psycopg")


class PostgresTimerStore(TimerStore, PostgresCensus):
    """:class:`~timer_core.ports.TimerStore` on PostgreSQL, for one or several instances.

    :meth:`find_due` *claims* what it returns: each timer is leased to this store's
    ``owner_id`` for ``lease_s`` seconds, so concurrent instances never get the same timer;
    an instance that dies leaves its claims to be taken over when the lease runs out.
    :meth:`mark_reached` is fenced: it only marks a claimed timer while this store's claim is
    the latest one. Lease expiry is judged by the database clock (``now()``), the one clock
    every instance shares; due times are judged by the ``now`` the core passes in, which
    :meth:`shared_clock` reads from the same database clock (see
    :class:`~timer_core.ports.SharedClockStore`).

    Scheduling sends ``NOTIFY`` on ``notify_channel`` with the due time; every started store
    (``listen=True``) ``LISTEN``\\ s and calls ``on_remote_schedule(due_at)`` for timers
    scheduled by other stores, so the worker wakes for them: :class:`~timer_core.Timer`
    registers its worker through :meth:`watch_remote_schedules`. The poll stays the safety net.
    """

    def __init__(
        self,
        url: str,
        *,
        owner_id: str | None = None,
        lease_s: float = 30.0,
        on_remote_schedule: Callable[[datetime], None] | None = None,
        listen: bool = True,
        notify_channel: str = "timer_schedules",
        notify_horizon_s: float | None = None,
        pool_size: int = 5,
        connect_timeout_s: float = 5.0,
        statement_timeout_s: float | None = 30.0,
        migrate: bool = True,
        clock_skew_warning_s: float | None = 1.0,
    ) -> None:
        """Configure the store; nothing connects before :meth:`start`.

        ``url``: ``postgresql://user:password@host:port/database`` (``postgresql+psycopg://``
        too). ``owner_id`` names this instance in leases (default: host, pid and a random
        suffix). ``notify_horizon_s``: only timers due at most this long after they were
        registered are announced (None: all); later ones are found by the poll anyway.
        ``migrate=False`` refuses a database whose schema is not already current.
        ``pool_size`` connections read and write; claims and marks take two more of their own
        (used from the event loop), the database clock one more, and ``listen=True`` one for
        ``LISTEN``. ``clock_skew_warning_s``: a WARNING is logged while this host's wall clock
        is further than this off the database's (None: never; see :meth:`shared_clock`).
        """
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self._url = _sqlalchemy_url(url)
        self._owner_id = owner_id or _default_owner_id()
        if len(self._owner_id) > 200:
            raise ValueError("owner_id must be at most 200 characters")
        self._lease_s = float(lease_s)
        self._lease = timedelta(seconds=lease_s)
        self.on_remote_schedule = on_remote_schedule
        """Called on the event loop with the due time of each timer another store scheduled."""
        self._listen = listen
        self._channel = notify_channel
        self._horizon = None if notify_horizon_s is None else timedelta(seconds=notify_horizon_s)
        self._pool_size = pool_size
        self._connect_timeout_s = connect_timeout_s
        self._statement_timeout_s = statement_timeout_s
        self._migrate = migrate
        self._engine: sa.Engine | None = None
        self._autocommit: sa.Engine | None = None
        # Claims, and the marks of fired batches: the drain's statements, run from the loop.
        self._claiming: StatementLane | None = None
        self._marking: StatementLane | None = None
        # The tenants the last claim by tenant shared among (all those due), its limit, and
        # when they were read (time.monotonic()).
        # The tenants a drain's next claim may reuse: (tenants, limit, read at, earliest due).
        self._tenants: tuple[list[str], int, float, dict[str, datetime]] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._listener: ScheduleListener | None = None
        self._announcing: asyncio.Task[None] | None = None
        # The other instances the tenants were last shared with (None: no claim yet).
        self._sharing: tuple[str, ...] | None = None
        self._lifecycle = asyncio.Lock()
        self._claims: dict[TimerKey, _Claim] = {}
        self._clock_lane: StatementLane | None = None
        self._clock = DatabaseClock(
            self._read_clock,
            skew_warning_s=clock_skew_warning_s,
            where=f"PostgreSQL {self._url.host or 'local'}:{self._url.port or 5432}",
        )

    @property
    def owner_id(self) -> str:
        """This store's name in the leases it takes."""
        return self._owner_id

    @property
    def claim_lease_s(self) -> float:
        """How long a timer returned by :meth:`find_due` stays claimed by this store."""
        return self._lease_s

    def shared_clock(self) -> DatabaseClock:
        """The database's clock (``clock_timestamp()``), read at :meth:`start` and every 2 s
        after on a connection of its own: ``now`` is never ahead of the database, whatever
        this host's wall clock says, and its ``skew_s`` is how far this host's is off."""
        return self._clock

    async def _read_clock(self) -> datetime:
        lane = self._clock_lane
        if lane is None:
            raise StoreUnavailable("the PostgreSQL timer store is not started (or closed)")
        (row,) = await lane.fetch("read the database clock", _READ_CLOCK, {})
        return require_utc(row.now, "the database clock")

    @property
    def listener(self) -> ScheduleListener | None:
        """The ``LISTEN`` side, once started with ``listen=True``."""
        return self._listener

    def __repr__(self) -> str:
        return (
            f"PostgresTimerStore({redact_url(self._url.render_as_string())!r}, "
            f"owner_id={self._owner_id!r})"
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, migrate the schema (or check it) and start listening. Idempotent."""
        async with self._lifecycle:
            if self._engine is not None:
                return
            engine = self._create_engine()
            executor = ThreadPoolExecutor(
                self._pool_size,
                thread_name_prefix="timer-postgres",
                initializer=_scheduled_as_batch,
            )
            listener: ScheduleListener | None = None
            try:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(executor, self._prepare_schema, engine)
                if self._listen:
                    listener = ScheduleListener(
                        self._conninfo(),
                        self._channel,
                        self._owner_id,
                        self._on_remote_schedule,
                        connect_timeout_s=self._connect_timeout_s,
                    )
                    await listener.start()
                self._clock_lane = self._lane()
                await self._clock.start()
            except BaseException:
                executor.shutdown(wait=False)
                engine.dispose()
                if listener is not None:
                    await listener.aclose()
                await self._close_clock()
                raise
            self._engine = engine
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            self._claiming = self._lane(_CLAIM_PLANNING)
            self._marking = self._lane()
            self._executor = executor
            self._listener = listener
            if listener is not None:
                self._announcing = asyncio.create_task(
                    self._announce(), name=f"timer-announce-{self._channel}"
                )
            log.info("timer store started on %r as %s", self, self._owner_id)

    async def aclose(self) -> None:
        """Stop listening, let the calls in flight finish, close the connections."""
        async with self._lifecycle:
            announcing, self._announcing = self._announcing, None
            if announcing is not None:
                announcing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await announcing
            await self._close_clock()
            listener, self._listener = self._listener, None
            engine, self._engine, self._autocommit = self._engine, None, None
            lanes = [lane for lane in (self._claiming, self._marking) if lane is not None]
            self._claiming = self._marking = None
            executor, self._executor = self._executor, None
            if listener is not None:
                await listener.aclose()
            for lane in lanes:
                await lane.aclose()
            if executor is not None:
                await asyncio.to_thread(executor.shutdown, wait=True)
            if engine is not None:
                engine.dispose()
            self._claims.clear()
            self._tenants = None
            self._sharing = None

    async def _close_clock(self) -> None:
        await self._clock.aclose()
        lane, self._clock_lane = self._clock_lane, None
        if lane is not None:
            await lane.aclose()

    async def _announce(self) -> None:
        """Say on the ``LISTEN`` channel that this instance is there, every _PEER_EVERY_S."""
        params = {"channel": self._channel, "payload": peer_payload(self._owner_id)}
        while (lane := self._marking) is not None:
            try:
                await lane.execute("announce this instance", _ANNOUNCE_SQL, params)
            except StoreError as exc:  # the others take its tenants over meanwhile
                log.debug("could not announce this instance: %s", exc)
            await asyncio.sleep(_PEER_EVERY_S)

    def _options(self, settings: Sequence[tuple[str, str]] = ()) -> str:
        """libpq ``options``: the session settings every connection of the store starts with."""
        options = "-c TimeZone=UTC"
        if self._statement_timeout_s is not None:
            options += f" -c statement_timeout={round(self._statement_timeout_s * 1000)}"
        return options + "".join(f" -c {name}={value}" for name, value in settings)

    def _conninfo(self) -> str:
        """The URL as psycopg's own connections (the listener's, the lanes') take it."""
        return self._url.set(drivername="postgresql").render_as_string(hide_password=False)

    def _lane(self, settings: Sequence[tuple[str, str]] = ()) -> StatementLane:
        return StatementLane(
            self._conninfo(),
            options=self._options(settings),
            connect_timeout_s=self._connect_timeout_s,
        )

    def _create_engine(self) -> sa.Engine:
        engine = sa.create_engine(
            self._url,
            pool_size=self._pool_size,
            max_overflow=0,
            pool_use_lifo=True,
            pool_timeout=self._connect_timeout_s,
            connect_args={
                "connect_timeout": max(1, round(self._connect_timeout_s)),
                "options": self._options(),
                "application_name": "timer",
            },
        )
        # The pool's connections store the commands the service then acknowledges: their
        # commits wait for the WAL flush whatever the server's default (the marks' and
        # claims' lanes keep it: a lost mark or claim only means a duplicate publish).
        sa.event.listen(engine, "connect", _commit_synchronously)
        return engine

    def _prepare_schema(self, engine: sa.Engine) -> None:
        try:
            with engine.begin() as conn:
                if self._migrate:
                    migrate(conn)
                    return
                found = schema_version(conn)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise translate_error(exc, "prepare the timer schema") from exc
        if found == 0:
            raise SchemaNotFound(f"no Timer schema in {redact_url(self._url.render_as_string())}")
        if found > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the database has Timer schema version {found}, newer than {SCHEMA_VERSION}"
            )
        if found < SCHEMA_VERSION:
            raise StoreError(
                f"the database has Timer schema version {found}, not {SCHEMA_VERSION}, and "
                "migrations are turned off"
            )

    def watch_remote_schedules(self, callback: RemoteScheduleCallback | None) -> bool:
        """Have ``callback(due_at)`` called for timers other stores schedule (``LISTEN``).

        Returns False when the store was made with ``listen=False`` (nothing is reported).
        """
        self.on_remote_schedule = callback
        return self._listen

    def _on_remote_schedule(self, due_at: datetime) -> None:
        callback = self.on_remote_schedule
        if callback is not None:
            callback(due_at)

    # -- running blocking work -----------------------------------------------------------

    async def _run(
        self,
        action: str,
        work: Callable[[sa.Connection], _T],
        *,
        atomic: bool = False,
    ) -> _T:
        """Run ``work`` in the store's threads: one transaction if ``atomic``, else autocommit."""
        engine = self._engine if atomic else self._autocommit
        executor = self._executor
        if engine is None or executor is None:
            raise StoreUnavailable("the PostgreSQL timer store is not started (or closed)")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, self._attempt, engine, action, work)
        except RuntimeError as exc:  # the executor was shut down under us
            if self._executor is None:
                raise StoreUnavailable("the PostgreSQL timer store is closed") from exc
            raise

    @staticmethod
    def _attempt(engine: sa.Engine, action: str, work: Callable[[sa.Connection], _T]) -> _T:
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with engine.begin() as conn:
                    return work(conn)
            except _RacingInsert:
                log.debug("%s raced with another writer; attempt %d", action, attempt)
            except sqlalchemy.exc.DBAPIError as exc:
                if not is_retryable(exc) or attempt == _ATTEMPTS:
                    raise translate_error(exc, action) from exc
                log.debug("%s conflicted (%s); attempt %d", action, exc.orig, attempt)
            except sqlalchemy.exc.SQLAlchemyError as exc:
                raise translate_error(exc, action) from exc
        raise StoreUnavailable(f"PostgreSQL: could not {action} after {_ATTEMPTS} attempts")

    # -- writes ----------------------------------------------------------------------------

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        if not operations:
            return []
        ops = list(operations)
        for op in ops:
            inner = op.operation if isinstance(op, PositionedOperation) else op
            if isinstance(inner, TimerEntry) and not inner.is_scheduled:
                raise ValueError(f"only Scheduled timers can be scheduled, got {inner}")
            if isinstance(op, PositionedOperation) and (
                type(op.position) is not int or op.position < 0
            ):
                raise ValueError(f"a command position is a non-negative int, got {op.position!r}")
        # New timers only (the usual batch): one autocommit statement. Should it find any
        # already there, the general way runs, in a transaction of its own; a partial insert
        # (another writer raced it for a key) is then already durable, as after an apply
        # whose acknowledgement was lost, and is re-applied as the same schedule.
        applied = await self._run(
            "apply timer commands",
            lambda conn: _insert_new(conn, ops, self._channel, self._owner_id, self._wake_at),
        )
        if applied is None:
            applied = await self._run(
                "apply timer commands", lambda conn: self._apply(conn, ops), atomic=True
            )
        outcomes, wake_at = applied
        log.debug("applied %d operations (wake-up sent for %s)", len(ops), wake_at)
        return outcomes

    def _apply(
        self, conn: sa.Connection, ops: list[TimerOperation]
    ) -> tuple[list[CommandOutcome], datetime | None]:
        return _apply_operations(conn, ops, self._channel, self._owner_id, self._wake_at)

    def _wake_at(self, scheduled: list[TimerEntry]) -> datetime | None:
        horizon = self._horizon
        due = [
            e.due_at for e in scheduled if horizon is None or e.due_at - e.registered_at <= horizon
        ]
        return min(due, default=None)

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        if not entries:
            return 0
        for entry in entries:
            if entry.reached_at is None:
                raise ValueError(f"timer {entry.tenant_id}/{entry.service_call_id} is not Reached")
        tokens: list[int | None] = []
        for entry in entries:
            claim = self._claims.pop(entry.key, None)
            tokens.append(None if claim is None else claim.token)
        # A firing batch shares one reached_at: one statement then, else one per value.
        groups: dict[datetime | None, list[int]] = {}
        for index, entry in enumerate(entries):
            groups.setdefault(entry.reached_at, []).append(index)
        statements = [
            {
                "owner": self._owner_id,
                "reached_at": reached_at,
                "tenant_ids": _text_array([entries[i].tenant_id for i in indexes]),
                "service_call_ids": _text_array([entries[i].service_call_id for i in indexes]),
                "due_ats": _timestamp_array([entries[i].due_at for i in indexes]),
                "tokens": _int_array([tokens[i] for i in indexes]),
            }
            for reached_at, indexes in groups.items()
        ]

        if len(statements) == 1:  # a fired batch: one autocommit statement, from the loop
            return await self._lane_of("marking").execute(
                "mark timers reached", _MARK_SQL, statements[0]
            )

        def mark(conn: sa.Connection) -> int:
            return sum(conn.execute(_MARK, params).rowcount for params in statements)

        return await self._run("mark timers reached", mark, atomic=True)

    def _lane_of(self, name: str) -> StatementLane:
        lane = self._claiming if name == "claiming" else self._marking
        if lane is None:
            raise StoreUnavailable("the PostgreSQL timer store is not started (or closed)")
        return lane

    async def release_claims(self, entries: Sequence[TimerEntry]) -> None:
        """Drop this store's claims on ``entries`` so any instance may claim them at once."""
        claimed = [(e.key, claim) for e in entries if (claim := self._claims.pop(e.key, None))]
        if not claimed:
            return
        params = {
            "owner": self._owner_id,
            "tenant_ids": _text_array([key.tenant_id for key, _ in claimed]),
            "service_call_ids": _text_array([key.service_call_id for key, _ in claimed]),
            "tokens": _int_array([claim.token for _, claim in claimed]),
        }
        await self._run("release timer claims", lambda conn: conn.execute(_RELEASE, params))

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        if limit <= 0:
            return 0
        before = require_utc(reached_before)

        def purge(conn: sa.Connection) -> int:
            deleted: int = conn.execute(_PURGE, {"before": before, "limit": limit}).rowcount
            if deleted < limit:
                rest = {"before": before, "limit": limit - deleted}
                deleted += conn.execute(_PURGE_TOMBSTONES, rest).rowcount
            return deleted

        return await self._run("purge reached timers", purge)

    # -- claiming ----------------------------------------------------------------------------

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        """Claim up to ``limit`` due timers (see :class:`PostgresTimerStore`), in due order."""
        if limit <= 0:
            return []
        params: dict[str, Any] = {
            "owner": self._owner_id,
            "lease": self._lease,
            "now": require_utc(now),
            "limit": limit,
        }
        statement = _CLAIM_FIRST_SQL
        if after is not None:
            statement = _CLAIM_AFTER_SQL
            params.update(
                after_due=after.due_at,
                after_tenant=after.tenant_id,
                after_call=after.service_call_id,
            )
        # On the claiming connection too: with no statistics yet (a new table's first
        # storm), the walk of ix_timer_schedules_due became a bitmap scan of every due timer
        # and a sort, 16 ms against 0.4 for a claim of 100 at 20,000 due.
        rows = await self._lane_of("claiming").fetch("claim due timers", statement, params)
        return self._track_claims(rows)

    @property
    def finds_due_by_tenant(self) -> bool:
        return True

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        """Claim up to ``limit`` due timers shared among tenants (see the port)."""
        if limit <= 0:
            return []
        now = require_utc(now)
        cursors: dict[str, tuple[datetime, str]] = {
            tenant: (cursor.due_at, cursor.service_call_id) for tenant, cursor in after.items()
        }
        base = {"owner": self._owner_id, "lease": self._lease, "now": now}
        known, self._tenants = self._tenants, None
        reused: list[str] | None = None
        earliest: dict[str, datetime] = {}
        read_at = monotonic()
        if known is not None and known[1] == limit and read_at - known[2] < _TENANTS_REUSED_S:
            reused, read_at, earliest = known[0], known[2], known[3]

        lane = self._lane_of("claiming")
        action = "claim due timers by tenant"

        async def claim() -> tuple[list[Any], list[str] | None]:
            """The rows claimed, and the tenants the next claim may share among."""
            active = reused
            if active is None:
                # At most ``limit`` tenants take part (one timer each at least): the others
                # are not even listed, so a backlog over many tenants costs no memory per
                # tenant.
                listed = await lane.fetch(action, _DUE_TENANTS_SQL, {"now": now, "limit": limit})
                active = [row.tenant_id for row in listed]
                earliest.update((row.tenant_id, row.due_at) for row in listed)
            # Every tenant due was listed: those that fill their share are listed again next.
            complete = len(active) < limit
            again: list[str] = []
            rows: list[Any] = []
            # This instance's own tenants first, the others' only for what they leave.
            for group in self._by_preference(active, earliest):
                if len(rows) >= limit:
                    again += group  # not reached: all of them may share the next claim
                    continue
                await take(group, rows, again)
            return rows, again if complete and len(rows) >= limit else None

        async def take(active: list[str], rows: list[Any], again: list[str]) -> None:
            """Claim shares of ``active``'s tenants into ``rows`` (up to ``limit``)."""
            first = True
            while len(rows) < limit and active:
                # Longest waiting first: when fewer are left than tenants, the first get one;
                # what does not divide evenly goes one each to the first ones.
                left = limit - len(rows)
                tenants = active[:left]
                share, extra = divmod(left, len(tenants))
                shares = [share + 1] * extra + [share] * (len(tenants) - extra)
                starts = [cursors.get(tenant, (_BEFORE_ALL, "")) for tenant in tenants]
                params = {
                    **base,
                    "tenants": _text_array(tenants),
                    "after_dues": _timestamp_array([start[0] for start in starts]),
                    "after_calls": _text_array([start[1] for start in starts]),
                    "shares": _int_array(shares),
                }
                claimed: dict[str, list[Any]] = {}
                for row in await lane.fetch(action, _CLAIM_BY_TENANT_SQL, params):
                    claimed.setdefault(row.tenant_id, []).append(row)
                more = []
                for tenant, wanted in zip(tenants, shares, strict=True):
                    mine = sorted(
                        claimed.get(tenant, ()), key=lambda row: (row.due_at, row.service_call_id)
                    )
                    rows += mine
                    if mine:
                        cursors[tenant] = (mine[-1].due_at, mine[-1].service_call_id)
                    if len(mine) == wanted:
                        more.append(tenant)  # it may use what others leave of their share
                if first:
                    again += more + active[len(tenants) :]
                first = False
                active = more

        rows, again = await claim()
        if again:
            self._tenants = (again, limit, read_at, earliest)
        return self._track_claims(rows)

    @property
    def sharing_with(self) -> tuple[str, ...]:
        """The other instances this store shares the tenants with: those heard on the
        ``LISTEN`` channel in the last ``_PEER_GONE_S`` (none when not listening)."""
        listener = self._listener
        return () if listener is None else tuple(listener.peers(_PEER_GONE_S))

    def _by_preference(
        self, tenants: list[str], earliest: Mapping[str, datetime]
    ) -> list[list[str]]:
        """``tenants`` (in their order) as this instance's own, then the others'.

        Instances that hear each other on the ``LISTEN`` channel (each says it is there
        every ``_PEER_EVERY_S``) share the tenants out by rendezvous hashing over those heard
        in the last ``_PEER_GONE_S``: each claims its own tenants' timers first and the
        others' only when its own cannot fill a batch, so no instance walks past the timers
        another one leased, nor works on the same pages. A tenant whose instance went quiet
        is taken over once it has not been heard for ``_PEER_GONE_S``; one whose earliest
        due timer (``earliest``) waits ``_HELP_BEHIND`` longer than this instance's own
        earliest is claimed as if it were this instance's own, so a slow instance's tenants
        do not fall behind the others'.
        """
        peers = self.sharing_with
        if peers != self._sharing:
            self._sharing = peers
            log.info(
                "%s shares the tenants with %s",
                self._owner_id,
                ", ".join(peers) if peers else "no other instance",
            )
        if not peers:
            return [tenants]
        owners = (self._owner_id, *peers)
        own = {tenant for tenant in tenants if _assigned(tenant, owners) == self._owner_id}
        dues = [earliest[tenant] for tenant in own if tenant in earliest]
        if dues:
            behind = min(dues) - _HELP_BEHIND
            own.update(t for t in tenants if t in earliest and earliest[t] < behind)
        return [[t for t in tenants if t in own], [t for t in tenants if t not in own]]

    def _track_claims(self, rows: Sequence[Any]) -> list[TimerEntry]:
        """The claimed rows as entries in due order, their claims remembered for the fence."""
        claimed = sorted(
            ((_entry(row), row.lease_token) for row in rows), key=lambda p: _due_order(p[0])
        )
        for entry, token in claimed:
            self._claims.pop(entry.key, None)  # re-inserted last: the dict stays in claim order
            self._claims[entry.key] = _Claim(token, entry.due_at)
        while len(self._claims) > _MAX_TRACKED_CLAIMS:
            del self._claims[next(iter(self._claims))]
        return [entry for entry, _ in claimed]

    # -- reads -----------------------------------------------------------------------------

    async def get(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> TimerEntry | None:
        statement = sa.select(*_ENTRY_COLUMNS).where(
            t.c.tenant_id == tenant_id, t.c.service_call_id == service_call_id
        )
        row = await self._run("read a timer", lambda conn: conn.execute(statement).first())
        return None if row is None else _entry(row)

    async def find_due_for_tenant(
        self, tenant_id: TenantId, now: datetime, limit: int
    ) -> list[TimerEntry]:
        if limit <= 0:
            return []
        statement = (
            sa.select(*_ENTRY_COLUMNS)
            .where(
                t.c.tenant_id == tenant_id,
                t.c.state == sa.literal_column("'Scheduled'"),
                t.c.due_at <= require_utc(now),
            )
            .order_by(t.c.due_at, t.c.service_call_id)
            .limit(limit)
        )
        return await self._entries("read a tenant's due timers", statement)

    async def find_by_correlation(
        self, tenant_id: TenantId, correlation_id: CorrelationId
    ) -> list[TimerEntry]:
        statement = (
            sa.select(*_ENTRY_COLUMNS)
            .where(t.c.tenant_id == tenant_id, t.c.correlation_id == correlation_id)
            .order_by(t.c.service_call_id)
        )
        return await self._entries("read timers by correlation id", statement)

    async def list_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        limit: int = 1000,
        after: ServiceCallId | None = None,
    ) -> list[TimerEntry]:
        if limit <= 0:
            return []
        statement = sa.select(*_ENTRY_COLUMNS).where(t.c.tenant_id == tenant_id)
        if after is not None:
            statement = statement.where(t.c.service_call_id > after)
        statement = statement.order_by(t.c.service_call_id).limit(limit)
        return await self._entries("list a tenant's timers", statement)

    async def next_due_at(self) -> datetime | None:
        params = {"owner": self._owner_id}
        value = await self._run(
            "read the next due time", lambda conn: conn.execute(_NEXT_DUE, params).scalar()
        )
        return None if value is None else require_utc(value)

    async def count_scheduled_for_tenant(self, tenant_id: TenantId) -> int:
        statement = (
            sa.select(sa.func.count())
            .select_from(t)
            .where(t.c.tenant_id == tenant_id, t.c.state == sa.literal_column("'Scheduled'"))
        )
        return int(
            await self._run(
                "count a tenant's scheduled timers",
                lambda conn: conn.execute(statement).scalar_one(),
            )
        )

    async def count_scheduled(self) -> int:
        statement = (
            sa.select(sa.func.count())
            .select_from(t)
            .where(t.c.state == sa.literal_column("'Scheduled'"))
        )
        return int(
            await self._run(
                "count scheduled timers", lambda conn: conn.execute(statement).scalar_one()
            )
        )

    def _entry_of(self, row: Any) -> TimerEntry:
        return _entry(row)

    async def _entries(self, action: str, statement: sa.Select[Any]) -> list[TimerEntry]:
        rows = await self._run(action, lambda conn: conn.execute(statement).all())
        return [_entry(row) for row in rows]


def schedule_in_transaction(
    connection: HostConnection,
    command: ScheduleTimer,
    *,
    now: datetime,
    correlation_id: str | None = None,
    notify_channel: str = "timer_schedules",
) -> CommandOutcome:
    """Schedule (or reschedule) a timer inside the caller's own transaction on the database.

    The timer exists if and only if that transaction commits. A ``NOTIFY`` on
    ``notify_channel`` (the stores' ``notify_channel``) goes out in the same transaction, so
    PostgreSQL delivers it on commit only: every listening :class:`PostgresTimerStore` then
    reports it (``watch_remote_schedules``) and its worker wakes. ``now`` is the caller's
    clock reading (the timer's ``registered_at``); adapters never read the clock.
    ``connection`` is on the stores' database: a SQLAlchemy :class:`~sqlalchemy.Connection`
    or ORM :class:`~sqlalchemy.orm.Session` (a transaction is begun if none is; on
    SQLAlchemy's asyncio API, call this through ``run_sync``), a plain psycopg
    ``Connection`` not in autocommit mode (the write opens its transaction; the caller
    commits), or a wrapper of one such as Django's ``django.db.connection`` inside
    ``transaction.atomic()``. The timer schema must be there (start a store once, or call
    :func:`migrate`). The correlation id is ``correlation_id`` or the command's own.

    Returns ``SCHEDULED``, or ``IGNORED_REACHED`` when the timer already fired (it is never
    re-armed). The timer's row stays locked until the transaction ends. Raises
    :class:`~timer_core.errors.StoreError` when the write fails; the caller's transaction is
    then theirs to roll back.
    """
    entry = scheduled_entry(command, now, correlation_id=correlation_id)
    (outcome,) = _write_in_transaction(connection, [entry], notify_channel)
    return outcome


def cancel_in_transaction(
    connection: HostConnection,
    command: CancelTimer,
    *,
    notify_channel: str = "timer_schedules",
) -> CommandOutcome:
    """Cancel a ``Scheduled`` timer inside the caller's own transaction (see
    :func:`schedule_in_transaction`): ``CANCELLED`` once that commits, or ``CANCEL_NOOP``
    when the timer is unknown or already fired."""
    key = TimerKey(command.tenant_id, command.service_call_id)
    (outcome,) = _write_in_transaction(connection, [key], notify_channel)
    return outcome


def _write_in_transaction(
    connection: HostConnection, ops: list[TimerOperation], channel: str
) -> list[CommandOutcome]:
    if isinstance(connection, sqlalchemy.orm.Session):
        connection = connection.connection()
    if isinstance(connection, sa.Connection):
        if connection.dialect.name != "postgresql":
            raise ConfigurationError(
                "timer_adapters_postgres needs a PostgreSQL connection, "
                f"got {connection.dialect.name}"
            )
        if not connection.in_transaction():
            connection.begin()
        writer: Any = connection
    else:
        # Statements go through the caller's psycopg connection as they would through
        # SQLAlchemy's: the same functions write, over an adapter with its few calls.
        writer = PsycopgWriter(psycopg_connection(connection))
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            applied = _insert_new(writer, ops, channel, _HOST_TRANSACTION, _earliest_due)
            if applied is None:
                applied = _apply_operations(writer, ops, channel, _HOST_TRANSACTION, _earliest_due)
            return applied[0]
        except _RacingInsert:
            # The racing transaction has committed (the insert waited for it): its row is
            # visible to the next statement at READ COMMITTED, so looking again is enough.
            log.debug("scheduling in a host transaction raced; attempt %d", attempt)
        except (sqlalchemy.exc.SQLAlchemyError, psycopg.Error) as exc:
            raise translate_error(exc, "schedule a timer in the caller's transaction") from exc
    raise StoreUnavailable(
        f"PostgreSQL: another transaction kept inserting the same timer ({_ATTEMPTS} attempts)"
    )


def _earliest_due(scheduled: list[TimerEntry]) -> datetime | None:
    return min((entry.due_at for entry in scheduled), default=None)
