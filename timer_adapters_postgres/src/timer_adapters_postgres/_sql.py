"""The SQL the PostgreSQL store runs, each statement beside the planner notes that shaped it.

Statements the lanes run (claims, marks) also come in psycopg's parameter style (``..._SQL``);
the rest are SQLAlchemy ``text()``. The query-plan tests read them here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from timer_adapters_postgres._lanes import pyformat
from timer_adapters_postgres._schema import FAR_EDGE_LOCK
from timer_adapters_postgres._schema import timer_schedules as t
from timer_core.horizon import AHEAD, BUCKET

RETURNING = (
    "tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at, "
    "traceparent, tracestate"
)

# -- near and far (timer_core.horizon) --------------------------------------------------------
# A timer due at or after the far edge is written far: far_bucket is its due time floored to
# a bucket, and it is in the far indexes only, not in the due-order indexes, which every due
# and claim query below reads through "state = 'Scheduled' AND far_bucket IS NULL" (their
# predicate; ix_timer_schedules_due's adds "due_at > '-infinity'", see ._schema). The
# invariant: every Scheduled timer due before the edge is near.
FAR_BUCKET_INTERVAL = f"interval '{int(BUCKET.total_seconds())} seconds'"


def _bucket_of(due: str) -> str:
    return f"date_bin({FAR_BUCKET_INTERVAL}, {due}, TIMESTAMPTZ 'epoch')"


# The edge as a writer judges it, locked until its transaction ends (see timer_far_edge() in
# ._schema): computed once per statement, in a CTE.
FAR_EDGE_CTE = "far AS MATERIALIZED (SELECT timer_far_edge() AS edge)"


def far_bucket_of(due: str) -> str:
    """The far_bucket a timer due at ``due`` is written with, ``far`` being FAR_EDGE_CTE."""
    return f"CASE WHEN far.edge IS NOT NULL AND {due} >= far.edge THEN {_bucket_of(due)} END"


# A general apply's first statement: the edge's lock, taken before any timer row is locked
# (an advance holding it may wait for a row this transaction would otherwise hold first).
LOCK_FAR_EDGE = sa.text("SELECT timer_far_edge()")
# At start, on a database without an edge: one from the database's clock (a find moves it
# to its own ``now`` anyway). Writers that read no edge wrote every timer near, which the
# invariant allows, so this needs no lock.
FIRST_EDGE = sa.text(
    f"""
INSERT INTO timer_horizon (id, edge)
VALUES (1, {_bucket_of(f"now() + interval '{int(AHEAD.total_seconds())} seconds'")})
ON CONFLICT (id) DO NOTHING
"""
)
READ_EDGE = sa.text("SELECT edge FROM timer_horizon")
# The advance: far timers due before :target made near, a batch at a time, lowest bucket
# first (a walk of ix_timer_schedules_far, no sort). Batches before the last skip rows others
# hold; the last, under the edge's lock, waits for them.
MOVE_NEAR = """
UPDATE timer_schedules SET far_bucket = NULL
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM timer_schedules
    WHERE far_bucket IS NOT NULL AND far_bucket < :target
    ORDER BY far_bucket
    LIMIT :limit
    FOR UPDATE{skip}
))
"""
MOVE_NEAR_SKIPPING = sa.text(MOVE_NEAR.format(skip=" SKIP LOCKED"))
MOVE_NEAR_ALL = sa.text(MOVE_NEAR.format(skip=""))
# Exclusive, without waiting: while any writer holds it shared, the advance tries later
# (queued for it, it would hold up every writer behind a host's long transaction).
TRY_LOCK_FAR_EDGE = sa.text(f"SELECT pg_try_advisory_xact_lock({FAR_EDGE_LOCK})")
RAISE_EDGE = sa.text(
    """
INSERT INTO timer_horizon AS h (id, edge) VALUES (1, :target)
ON CONFLICT (id) DO UPDATE SET edge = greatest(h.edge, excluded.edge)
RETURNING edge
"""
)

# Claiming: the LIMIT sits inside the locking subquery, which walks ix_timer_schedules_due in
# order, skips rows another transaction holds, and stops after :limit rows (no sort, no scan
# of the whole backlog). A row whose lease ran out, or that this owner holds, is claimable
# again; every claim bumps lease_token, which fences marks by an earlier claim (the rules of
# timer_core.leases.Lease, here as predicates on the lease columns). The outer
# UPDATE finds the locked rows by ctid (a TID scan): matched by key instead, as
# "(tenant_id, service_call_id) IN (...)", PostgreSQL turns it into a hash semi-join over a
# sequential scan of the whole table for batches of ~1000 and for every generic plan (which
# psycopg's automatic prepared statements lead to). The ctids cannot move meanwhile: this
# statement holds the row locks.
# A claim of the rows its subquery locks: leased to this owner, their token bumped.
CLAIM_ROWS = """
UPDATE timer_schedules
SET lease_owner = :owner,
    lease_until = now() + CAST(:lease AS interval),
    lease_token = lease_token + 1
WHERE ctid = ANY(ARRAY({locked}))
RETURNING {{returning}}, lease_token
"""
CLAIM = CLAIM_ROWS.format(
    locked="""
    SELECT ctid
    FROM timer_schedules
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity'
      AND due_at <= :now
      AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
      {after}
    ORDER BY {order}
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
"""
)
DUE_ORDER = "due_at, tenant_id, service_call_id"
CLAIM_FIRST = sa.text(CLAIM.format(after="", order=DUE_ORDER, returning=RETURNING))
CLAIM_AFTER = sa.text(
    CLAIM.format(
        after="AND (due_at, tenant_id, service_call_id) > (:after_due, :after_tenant, :after_call)",
        order=DUE_ORDER,
        returning=RETURNING,
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
CLAIM_PLANNING = (
    ("enable_sort", "off"),
    ("enable_bitmapscan", "off"),
    ("enable_incremental_sort", "off"),
    ("jit", "off"),
)
# find_due_by_tenant: the tenants with pending timers and their earliest due time, one index
# seek per tenant (a loose scan of ix_timer_schedules_tenant_due), longest waiting first ...
DUE_TENANTS = sa.text(
    """
WITH RECURSIVE pending AS (
    (SELECT tenant_id, due_at FROM timer_schedules
     WHERE state = 'Scheduled' AND far_bucket IS NULL
     ORDER BY tenant_id, due_at, service_call_id LIMIT 1)
  UNION ALL
    SELECT n.tenant_id, n.due_at FROM pending AS p CROSS JOIN LATERAL (
        SELECT tenant_id, due_at FROM timer_schedules
        WHERE state = 'Scheduled' AND far_bucket IS NULL AND tenant_id > p.tenant_id
        ORDER BY tenant_id, due_at, service_call_id LIMIT 1
    ) AS n
)
SELECT tenant_id, due_at FROM pending
WHERE due_at <= :now ORDER BY due_at, tenant_id LIMIT :limit
"""
)
# ... or, cheaper while the backlog is small, from a walk of ix_timer_schedules_due over what
# is due (at most :walk entries; fewer walked means every tenant due was seen): a cost in
# the due timers, not in the tenants with pending ones. The loose scan's seeks also step, in
# each tenant's range of ix_timer_schedules_tenant_due, over the entries of that tenant's
# fired timers until a vacuum (the due index's are mostly marked dead by the claims that
# walk it; these are walked by nothing else, so each is a heap page read): 30 ms at the
# start of a steady run at 10,000,000 pending, 90-170 ms after 40 s of 1,000 firings a
# second, on every backlog of a claim or more.
DUE_TENANTS_NEAR = sa.text(
    """
SELECT tenant_id, min(due_at) AS due_at, sum(count(*)) OVER () AS walked
FROM (
    SELECT tenant_id, due_at FROM timer_schedules
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity' AND due_at <= :now
    ORDER BY due_at, tenant_id, service_call_id
    LIMIT :walk
) AS due
GROUP BY tenant_id
"""
)
# ... unless everything claimable that is due fits in the claim: then there is nothing to
# share out and CLAIM_FIRST takes it all. This count walks ix_timer_schedules_due for at most
# limit + 1 entries, where DUE_TENANTS seeks once per tenant with pending timers, due or not
# (17 ms a claim at a thousand tenants, on every pass of a steady stream coming due).
DUE_FITS = sa.text(
    """
SELECT count(*) <= :limit FROM (
    SELECT 1 FROM timer_schedules
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity'
      AND due_at <= :now
      AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
    ORDER BY due_at, tenant_id, service_call_id
    LIMIT :limit + 1
) AS due
"""
)
# ... then every tenant's share in one statement (one round trip, one commit, not one per
# tenant): each tenant's rows claimed like CLAIM, in its own order after its cursor. Written
# so that only ix_timer_schedules_tenant_due can serve it, whatever the statistics say: the
# order names the tenant, and the connections plan without sorts and bitmap scans (pkey and
# the correlation index serve "tenant_id = ..." as well, but not in this order). The walk
# starts at the cursor (a row comparison) and ends at the first entry due after :now: that
# takes plain bounds, "tenant_id = ... AND due_at <= :now". Bounded by a row comparison,
# "(tenant_id, due_at) <= (k.tenant_id, :now)", PostgreSQL checked the bound on every entry
# but stopped only at the next tenant's, so each tenant whose share came back short walked
# all of its pending timers: 70-140 index pages a tenant at 10,000,000 pending over 1,000
# tenants, 20-150 ms a claim of 100. Before that, with "due_at <= :now" alone, statistics
# taken while the storm was far off (or none yet) had each tenant's LIMIT walk
# ix_timer_schedules_due across every tenant's due timers, or sort the tenant's rows: 6-7 ms
# (at 10,000 due) and 11-35 ms (at 20,000) a claim of 100, against 1-2 ms (the planner
# settings of the connections rule that out now). Each tenant's share is its own (a limit that
# does not divide evenly among the tenants is not left to a second statement); with sorts
# allowed, that made the generic plan assume a tenth of each tenant's rows and sort them.
CLAIM_OF_TENANTS = CLAIM_ROWS.format(
    locked="""
    SELECT c.ctid
    FROM unnest(
        CAST(:tenants AS text[]), CAST(:after_dues AS timestamptz[]),
        CAST(:after_calls AS text[]), CAST(:shares AS int[]))
        AS k(tenant_id, after_due, after_call, share)
    CROSS JOIN LATERAL (
        SELECT ctid
        FROM timer_schedules
        WHERE state = 'Scheduled' AND far_bucket IS NULL
          AND (tenant_id, due_at, service_call_id) > (k.tenant_id, k.after_due, k.after_call)
          AND tenant_id = k.tenant_id AND due_at <= CAST(:now AS timestamptz)
          AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
        ORDER BY tenant_id, due_at, service_call_id
        LIMIT k.share
        FOR UPDATE SKIP LOCKED
    ) AS c
"""
)
CLAIM_BY_TENANT = sa.text(CLAIM_OF_TENANTS.format(returning=RETURNING))


# The statements the lanes run, in psycopg's parameter style.
CLAIM_FIRST_SQL = pyformat(CLAIM_FIRST)
CLAIM_AFTER_SQL = pyformat(CLAIM_AFTER)
DUE_TENANTS_SQL = pyformat(DUE_TENANTS)
DUE_TENANTS_NEAR_SQL = pyformat(DUE_TENANTS_NEAR)
DUE_FITS_SQL = pyformat(DUE_FITS)
CLAIM_BY_TENANT_SQL = pyformat(CLAIM_BY_TENANT)

LOCK_KEYS = sa.text(
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
LOCK_TOMBSTONES = sa.text(
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
TIMER_ARRAYS = """
    CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]),
    CAST(:correlation_ids AS text[]), CAST(:due_ats AS timestamptz[]),
    CAST(:registered_ats AS timestamptz[]), CAST(:positions AS bigint[]),
    CAST(:traceparents AS text[]), CAST(:tracestates AS text[])"""
TIMER_COLUMNS = """v(tenant_id, service_call_id, correlation_id, due_at, registered_at, position,
         traceparent, tracestate)"""
INSERT = sa.text(
    f"""
WITH {FAR_EDGE_CTE}
INSERT INTO timer_schedules
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, command_position,
     traceparent, tracestate, far_bucket)
SELECT v.*, {far_bucket_of("v.due_at")}
FROM unnest({TIMER_ARRAYS})
    AS {TIMER_COLUMNS}
CROSS JOIN far
ON CONFLICT (tenant_id, service_call_id) DO NOTHING
RETURNING tenant_id
"""
)
# Rescheduling drops any lease: the old claim was for the old due time. The position is the
# one timer_core.replay decided (an unpositioned reschedule's is the stored one).
RESCHEDULE = sa.text(
    f"""
WITH {FAR_EDGE_CTE}
UPDATE timer_schedules AS s
SET due_at = v.due_at, registered_at = v.registered_at, correlation_id = v.correlation_id,
    command_position = v.position,
    traceparent = v.traceparent, tracestate = v.tracestate,
    lease_owner = NULL, lease_until = NULL, far_bucket = {far_bucket_of("v.due_at")}
FROM unnest({TIMER_ARRAYS})
    AS {TIMER_COLUMNS}
CROSS JOIN far
WHERE s.tenant_id = v.tenant_id AND s.service_call_id = v.service_call_id
"""
)
TOMBSTONE = sa.text(
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
DELETE = sa.text(
    """
DELETE FROM timer_schedules AS s
USING unnest(CAST(:tenant_ids AS text[]), CAST(:service_call_ids AS text[]))
    AS v(tenant_id, service_call_id)
WHERE s.tenant_id = v.tenant_id AND s.service_call_id = v.service_call_id
  AND s.state = 'Scheduled'
"""
)
NOTIFY = sa.text("SELECT pg_notify(:channel, :payload)")
# The lowest far bucket (one seek into ix_timer_schedules_far), and the earliest due time of
# "near" (a CTE with due_at) and the far timers; shared by next_due_at and the census.
LOWEST_FAR = (
    "lowest AS (SELECT min(far_bucket) AS bucket FROM timer_schedules WHERE far_bucket IS NOT NULL)"
)
EARLIEST_OF_NEAR_AND_FAR = """CASE
    WHEN lowest.bucket IS NULL OR near.due_at < lowest.bucket THEN near.due_at
    ELSE (SELECT least(near.due_at, min(f.due_at)) FROM timer_schedules AS f
          WHERE f.far_bucket = lowest.bucket)
END"""
# The common batch, only new timers (no row, no tombstone for any key: timer_core.replay's
# new_timers): inserted, and the earliest announced, in one statement, so one round trip (and
# in autocommit one commit) instead of locking the keys, their tombstones, inserting and
# notifying in four. Any key already there and the statement inserts nothing; one inserted
# meanwhile by another transaction and, in autocommit, the statement fails on the primary key
# and inserts nothing either (so an apply that then fails the general way has applied none of
# the batch, as the port promises); in a host's transaction it skips that key (ON CONFLICT DO
# NOTHING, not to abort the host's transaction) and the general way, in the same transaction,
# sees what it inserted as its own reschedules.
INSERT_NEW = f"""
WITH v AS (
    SELECT * FROM unnest({TIMER_ARRAYS})
        AS {TIMER_COLUMNS}
), {FAR_EDGE_CTE}, inserted AS (
    INSERT INTO timer_schedules
        (tenant_id, service_call_id, correlation_id, due_at, registered_at, command_position,
         traceparent, tracestate, far_bucket)
    SELECT v.*, {far_bucket_of("v.due_at")} FROM v CROSS JOIN far
    WHERE NOT EXISTS (
            SELECT FROM timer_schedules AS s JOIN v AS k
              ON s.tenant_id = k.tenant_id AND s.service_call_id = k.service_call_id)
      AND NOT EXISTS (
            SELECT FROM timer_tombstones AS c JOIN v AS k
              ON c.tenant_id = k.tenant_id AND c.service_call_id = k.service_call_id)
    {{conflict}}
    RETURNING 1
), counted AS (
    SELECT count(*) AS inserted FROM inserted
)
SELECT inserted{{notify}} FROM counted
"""
NOTIFY_INSERTED = ", CASE WHEN inserted > 0 THEN pg_notify(:channel, :payload) IS NULL END"
SKIP_CONFLICTS = "ON CONFLICT (tenant_id, service_call_id) DO NOTHING"
# (quietly, notifying) in autocommit, and in a host's transaction.
INSERT_NEW_AUTOCOMMIT = (
    sa.text(INSERT_NEW.format(notify="", conflict="")),
    sa.text(INSERT_NEW.format(notify=NOTIFY_INSERTED, conflict="")),
)
INSERT_NEW_IN_TRANSACTION = (
    sa.text(INSERT_NEW.format(notify="", conflict=SKIP_CONFLICTS)),
    sa.text(INSERT_NEW.format(notify=NOTIFY_INSERTED, conflict=SKIP_CONFLICTS)),
)
UNIQUE_VIOLATION = "23505"
# Marking and releasing find each timer by its key, one primary-key lookup per timer (the
# locking LATERAL subquery is planned per row, never flattened into a join), and update the
# rows they locked by TID, like a claim. Joined to the keys as "FROM unnest(...) WHERE s.key =
# v.key", statistics taken before a storm (which call ~10 timers Scheduled) made PostgreSQL
# hash every Scheduled timer, read through ix_timer_schedules_due, for each batch: a mark of
# 100 read ~9,500 rows at 10,000 due (3-4 ms, O(backlog) per batch), and the bench's raw
# pipeline hit the same with a nested loop re-reading its 1,000 keys for each row.
LOCKED_BY_KEY = """
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
# The fence (timer_core.leases.Lease.settles): a timer this store claimed is marked only
# under that very claim (same owner, same token: nobody claimed it since); one it never
# claimed only if nobody holds it now.
# One statement per reached_at (a firing batch shares one).
MARK = sa.text(
    LOCKED_BY_KEY.format(
        set="state = 'Reached', reached_at = :reached_at, lease_owner = NULL, lease_until = NULL, "
        "far_bucket = NULL",
        arrays="CAST(:due_ats AS timestamptz[]), CAST(:tokens AS bigint[])",
        columns="due_at, token",
        fence="""s.due_at = v.due_at
          AND CASE WHEN v.token IS NULL
              THEN s.lease_owner IS NULL OR s.lease_owner = :owner OR s.lease_until < now()
              ELSE s.lease_owner = :owner AND s.lease_token = v.token
          END""",
    )
)
MARK_SQL = pyformat(MARK)
RELEASE = sa.text(
    LOCKED_BY_KEY.format(
        set="lease_owner = NULL, lease_until = NULL",
        arrays="CAST(:tokens AS bigint[])",
        columns="token",
        fence="s.lease_owner = :owner AND s.lease_token = v.token",
    )
)
# Timers leased by another instance are left out: it is firing them, and counting them would
# make this worker spin on a due time it cannot claim. Expired leases count again. The near
# minimum is the first entry of ix_timer_schedules_due; far timers (never leased) are due in
# their bucket or later, so the earliest of them is in the lowest bucket, read only when no
# near timer comes before that bucket (near timers due later than the edge are those written
# before there was one).
NEXT_DUE = sa.text(
    f"""
WITH near AS (
    SELECT min(due_at) AS due_at FROM timer_schedules
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at > '-infinity'
      AND (lease_until IS NULL OR lease_until < now() OR lease_owner = :owner)
), {LOWEST_FAR}
SELECT {EARLIEST_OF_NEAR_AND_FAR} FROM near, lowest
"""
)
# Retention deletes in reached_at order, from where its last batch of this purge ended (the
# latest reached_at it deleted, :after): the entries of the rows it deleted stay in
# ix_timer_schedules_reached until a vacuum, and a scan from the oldest steps over all of
# them (a batch of one timer read 5,500 pages, 72 ms, after 300,000 were purged from a
# table of 13,000,000 rows). Timers fire at the present, never behind a cutoff in the past,
# so no expired row appears behind the cursor; one skipped because another transaction held
# it is found by the next purge, which starts from the oldest again.
PURGE = sa.text(
    """
WITH gone AS (
    DELETE FROM timer_schedules
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM timer_schedules
        WHERE state = 'Reached'
          AND reached_at < :before
          AND reached_at >= COALESCE(CAST(:after AS timestamptz), '-infinity')
        ORDER BY reached_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING reached_at
)
SELECT count(*), max(reached_at) FROM gone
"""
)
PURGE_TOMBSTONES = sa.text(
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


ANNOUNCE = "SELECT pg_notify(%(channel)s, %(payload)s)"


# -- reads: each by its key, a tenant's index or the correlation index ----------------------

ENTRY_COLUMNS = (
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
_IS_SCHEDULED = t.c.state == sa.literal_column("'Scheduled'")
_IS_NEAR = t.c.far_bucket.is_(None)


def select_timer(tenant_id: str, service_call_id: str) -> sa.Select[Any]:
    """The timer with this key."""
    return sa.select(*ENTRY_COLUMNS).where(
        t.c.tenant_id == tenant_id, t.c.service_call_id == service_call_id
    )


def select_due_for_tenant(tenant_id: str, now: datetime, limit: int) -> sa.Select[Any]:
    """A tenant's due timers in its own due order."""
    return (
        sa.select(*ENTRY_COLUMNS)
        .where(t.c.tenant_id == tenant_id, _IS_SCHEDULED, _IS_NEAR, t.c.due_at <= now)
        .order_by(t.c.due_at, t.c.service_call_id)
        .limit(limit)
    )


def select_by_correlation(tenant_id: str, correlation_id: str) -> sa.Select[Any]:
    """A tenant's timers with this correlation id, in key order."""
    return (
        sa.select(*ENTRY_COLUMNS)
        .where(t.c.tenant_id == tenant_id, t.c.correlation_id == correlation_id)
        .order_by(t.c.service_call_id)
    )


def select_for_tenant(tenant_id: str, limit: int, after: str | None) -> sa.Select[Any]:
    """A page of a tenant's timers in ``service_call_id`` order, after ``after``."""
    statement = sa.select(*ENTRY_COLUMNS).where(t.c.tenant_id == tenant_id)
    if after is not None:
        statement = statement.where(t.c.service_call_id > after)
    return statement.order_by(t.c.service_call_id).limit(limit)


# Near ones counted in ix_timer_schedules_due, far ones in ix_timer_schedules_far (far timers
# are all Scheduled: marking one makes it near).
COUNT_SCHEDULED = sa.text(
    """
SELECT (SELECT count(*) FROM timer_schedules WHERE state = 'Scheduled' AND far_bucket IS NULL)
     + (SELECT count(*) FROM timer_schedules WHERE far_bucket IS NOT NULL)
"""
)


# A tenant's near ones in ix_timer_schedules_tenant_due, its far ones in
# ix_timer_schedules_far_tenant (the per-tenant quota asks, off by default).
COUNT_SCHEDULED_FOR_TENANT = sa.text(
    """
SELECT (SELECT count(*) FROM timer_schedules
        WHERE tenant_id = :tenant AND state = 'Scheduled' AND far_bucket IS NULL)
     + (SELECT count(*) FROM timer_schedules
        WHERE tenant_id = :tenant AND far_bucket IS NOT NULL)
"""
)


# The database clock's reading (see ._clock): the instant the statement runs, not the
# transaction's start.
READ_CLOCK = "SELECT clock_timestamp() AS now"
