"""The SQL the SQLite store runs: every statement's text, and which forms this SQLite runs.

The statements the poller and the writer run per batch go straight to the sqlite3 driver
(``?`` parameters); the rest are SQLAlchemy ``text()`` (``:name`` parameters). Bench and the
query-plan tests read them here.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Mapping, Sequence

import sqlalchemy as sa

from timer_adapters_sqlite._schema import HORIZON, TABLE, TOMBSTONES

COLUMNS = (
    "tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at, "
    "traceparent, tracestate"
)

# Each write comes in two forms from one template: one row per execution, its values bound
# to numbered parameters (for executemany), or every row of a batch at once, read from a JSON
# array of arrays bound to the one parameter. executemany takes the GIL back between every two
# rows, and while the event loop keeps another thread busy each of those waits up to a switch
# interval (5 ms) for it (measured: 0.3-3k upserts/s that way, 8k/s as one statement, the
# event loop running on meanwhile), so the store uses the JSON form where SQLite has it.
_SCHEDULE_VALUES = (
    "tenant_id",
    "service_call_id",
    "correlation_id",
    "due_at",
    "registered_at",
    "position",
    "traceparent",
    "tracestate",
)
_MARK_VALUES = ("reached_at", "tenant_id", "service_call_id", "due_at")


def _parameters(columns: Sequence[str]) -> dict[str, str]:
    """Each value from its numbered parameter, in the order of ``columns``."""
    return {column: f"?{number}" for number, column in enumerate(columns, 1)}


def _json_rows(columns: Sequence[str], alias: str) -> tuple[dict[str, str], str]:
    """Each value from the rows (arrays in the order of ``columns``) of the JSON parameter,
    as the subquery ``alias`` with the arrays' index as ``key``: the values and the FROM."""
    values = ",\n           ".join(
        f"json_extract(value, '$[{index}]') AS {column}" for index, column in enumerate(columns)
    )
    source = f"\nFROM (\n    SELECT key, {values}\n    FROM json_each(?)\n) AS {alias}"
    return {column: f"{alias}.{column}" for column in columns}, source


# A timer's due time in 10-minute buckets: the first 15 characters of its stored text
# (YYYY-MM-DDTHH:M), which sort as the instants do.
BUCKET_CHARS = 15


# The far edge: the one row of timer_horizon, read by its key (none: no edge yet).
EDGE = f"SELECT edge FROM {HORIZON} WHERE id = 1"


def _far_bucket(due_at: str) -> str:
    """``far_bucket`` of a timer written with ``due_at``: its bucket when it is due at or
    after the far edge, else NULL (near; also while there is no edge). The subquery is
    uncorrelated: SQLite reads the edge once per statement."""
    return f"CASE WHEN {due_at} >= ({EDGE}) THEN substr({due_at}, 1, {BUCKET_CHARS}) END"


def _insert(value: Mapping[str, str], source: str = "", *, new_only: bool = False) -> str:
    """Insert timers (what timer_core.replay decided); ``new_only``: the one-statement form
    of a batch of new timers (timer_core.replay.new_timers), which skips a key that holds a
    timer or a tombstone (its batch then goes the general way)."""
    where = " WHERE true"  # an INSERT ... SELECT needs a WHERE before ON CONFLICT
    if new_only:
        where = f"""
WHERE NOT EXISTS (
    SELECT 1 FROM {TOMBSTONES} AS c
    WHERE c.tenant_id = {value["tenant_id"]} AND c.service_call_id = {value["service_call_id"]})
ON CONFLICT (tenant_id, service_call_id) DO NOTHING"""
    return f"""
INSERT INTO {TABLE}
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, state, command_position,
     traceparent, tracestate, far_bucket)
SELECT {value["tenant_id"]}, {value["service_call_id"]}, {value["correlation_id"]},
       {value["due_at"]}, {value["registered_at"]}, 'Scheduled', {value["position"]},
       {value["traceparent"]}, {value["tracestate"]}, {_far_bucket(value["due_at"])}{source}{where}
"""


def _reschedule(value: Mapping[str, str], source: str = "") -> str:
    """Reschedule ``Scheduled`` timers (timer_core.replay's updates), position included."""
    return f"""
UPDATE {TABLE}
SET due_at = {value["due_at"]}, correlation_id = {value["correlation_id"]},
    registered_at = {value["registered_at"]}, command_position = {value["position"]},
    traceparent = {value["traceparent"]}, tracestate = {value["tracestate"]},
    far_bucket = {_far_bucket(value["due_at"])}{source}
WHERE {TABLE}.tenant_id = {value["tenant_id"]}
  AND {TABLE}.service_call_id = {value["service_call_id"]} AND {TABLE}.state = 'Scheduled'
"""


def _mark_reached(value: Mapping[str, str], source: str = "", index: str = "") -> str:
    return f"""
UPDATE {TABLE}{index}
SET state = 'Reached', reached_at = {value["reached_at"]}, far_bucket = NULL{source}
WHERE {TABLE}.tenant_id = {value["tenant_id"]}
  AND {TABLE}.service_call_id = {value["service_call_id"]}
  AND {TABLE}.state = 'Scheduled' AND {TABLE}.due_at = {value["due_at"]}
"""


INSERT_NEW = _insert(_parameters(_SCHEDULE_VALUES), new_only=True)
INSERT_NEW_JSON = _insert(*_json_rows(_SCHEDULE_VALUES, "v"), new_only=True)
INSERT = _insert(_parameters(_SCHEDULE_VALUES))
INSERT_JSON = _insert(*_json_rows(_SCHEDULE_VALUES, "v"))
RESCHEDULE = _reschedule(_parameters(_SCHEDULE_VALUES))
RESCHEDULE_JSON = _reschedule(*_json_rows(_SCHEDULE_VALUES, "v"))
MARK_REACHED = _mark_reached(_parameters(_MARK_VALUES))
# INDEXED BY: the batch's keys are found through the primary key (a timer far ahead, marked
# without having been found due, is in no due-order index).
MARK_REACHED_JSON = _mark_reached(
    *_json_rows(_MARK_VALUES, "marks"), index=" INDEXED BY sqlite_autoindex_timer_schedules_1"
)
CANCEL = f"""
DELETE FROM {TABLE} WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled'
"""
# What timer_core.replay reads of a key: (state, position) of its timer and its tombstone's
# position; NULLs where absent.
POSITIONS = f"""
SELECT (SELECT state FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id = ?2),
       (SELECT command_position FROM {TABLE} WHERE tenant_id = ?1 AND service_call_id = ?2),
       (SELECT command_position FROM {TOMBSTONES} WHERE tenant_id = ?1 AND service_call_id = ?2)
"""
# The same three for the distinct keys of a batch, as JSON arrays.
POSITIONS_JSON = f"""
SELECT s.state, s.command_position, c.command_position
FROM json_each(?) AS j
LEFT JOIN {TABLE} AS s ON s.tenant_id = json_extract(j.value, '$[0]')
    AND s.service_call_id = json_extract(j.value, '$[1]')
LEFT JOIN {TOMBSTONES} AS c ON c.tenant_id = json_extract(j.value, '$[0]')
    AND c.service_call_id = json_extract(j.value, '$[1]')
ORDER BY j.key
"""
CANCEL_JSON = f"""
DELETE FROM {TABLE} WHERE state = 'Scheduled' AND (tenant_id, service_call_id) IN (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?))
"""


def _tombstone(rows: str) -> str:
    """Remember a positioned cancel per key: the highest position, the latest time."""
    return f"""
INSERT INTO {TOMBSTONES} AS c (tenant_id, service_call_id, command_position, cancelled_at)
{rows}
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    command_position = max(c.command_position, excluded.command_position),
    cancelled_at = excluded.cancelled_at
"""


TOMBSTONE = _tombstone("VALUES (?1, ?2, ?3, ?4)")
# WHERE true: an INSERT ... SELECT needs a WHERE before ON CONFLICT to parse as an upsert.
TOMBSTONE_JSON = _tombstone(
    "SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), "
    "json_extract(value, '$[2]'),\n       json_extract(value, '$[3]')\nFROM json_each(?) WHERE true"
)


def _json_statements_supported() -> bool:
    """Whether this SQLite has JSON functions and UPDATE ... FROM (3.33; JSON built in 3.38)."""
    try:
        with contextlib.closing(sqlite3.connect(":memory:")) as probe:
            probe.execute("CREATE TABLE t (a, b)")
            probe.execute("UPDATE t SET b = j.value FROM json_each('[1]') AS j WHERE t.a = j.key")
    except sqlite3.Error:
        return False
    return True


JSON_STATEMENTS = _json_statements_supported()
# INDEXED BY pins the plans the EXPLAIN QUERY PLAN tests prove: statistics from a host's
# ANALYZE must never turn the poll into a scan whose cost grows with the table.
FIND_DUE = f"""
SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at <= ?
ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
# How many due timers there are, up to ?2: a walk of the due index that reads no row (a
# tenth of FIND_DUE's cost for the same entries), telling whether a claim fits them all.
COUNT_DUE = f"""
SELECT count(*) FROM (
    SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at <= ? LIMIT ?
)
"""
FIND_DUE_AFTER = f"""
SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL AND due_at <= ?
  AND (due_at, tenant_id, service_call_id) > (?, ?, ?)
ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
FIND_DUE_FOR_TENANT = f"""
SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
WHERE tenant_id = ? AND state = 'Scheduled' AND far_bucket IS NULL AND due_at <= ?
ORDER BY due_at, service_call_id LIMIT ?
"""
# find_due_by_tenant in two statements whatever the number of tenants (statements, not rows,
# are what a read costs while the event loop holds the GIL): the tenants with pending timers
# and their earliest due time, by a loose scan of the tenant-first partial index (a few seeks
# per tenant), longest waiting first ...
DUE_TENANTS = f"""
WITH RECURSIVE pending(tenant_id) AS (
    SELECT (SELECT min(tenant_id) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
            WHERE state = 'Scheduled' AND far_bucket IS NULL)
  UNION ALL
    SELECT (SELECT min(tenant_id) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
            WHERE state = 'Scheduled' AND far_bucket IS NULL AND tenant_id > pending.tenant_id)
    FROM pending WHERE pending.tenant_id IS NOT NULL
)
SELECT tenant_id, (
    SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
    WHERE state = 'Scheduled' AND far_bucket IS NULL AND tenant_id = pending.tenant_id) AS earliest
FROM pending WHERE tenant_id IS NOT NULL AND earliest <= ?1 ORDER BY earliest, tenant_id
LIMIT ?2
"""
# ... then up to ?3 due timers of each tenant of a JSON array of [tenant, after due_at,
# after service_call_id] ("" sorts before every valid value: no cursor), in its own order.
FIND_DUE_OF_TENANTS = f"""
SELECT {", ".join(f"s.{column}" for column in COLUMNS.split(", "))}
FROM json_each(?1) AS j
JOIN {TABLE} AS s ON s.rowid IN (
    SELECT rowid FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
    WHERE tenant_id = json_extract(j.value, '$[0]') AND state = 'Scheduled' AND far_bucket IS NULL
      AND due_at <= ?2
      AND (due_at, service_call_id)
          > (json_extract(j.value, '$[1]'), json_extract(j.value, '$[2]'))
    ORDER BY due_at, service_call_id LIMIT ?3
)
"""
# min() is answered by one seek to the first entry of the partial index: the earliest near
# timer, which is the earliest of all when it is due before the far edge.
NEXT_DUE_AT = f"""
SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL
"""
# The earliest far timer: a walk of the lowest far bucket's entries (a bucket's worth).
NEXT_FAR_DUE_AT = f"""
SELECT min(due_at) FROM {TABLE} INDEXED BY idx_timer_schedules_far
WHERE far_bucket IS NOT NULL AND far_bucket = (
    SELECT min(far_bucket) FROM {TABLE} INDEXED BY idx_timer_schedules_far
    WHERE far_bucket IS NOT NULL)
"""
# The far timers of the buckets before ?1 (an edge) moved near, ?2 at most, in bucket order.
MOVE_NEAR = f"""
UPDATE {TABLE} SET far_bucket = NULL WHERE rowid IN (
    SELECT rowid FROM {TABLE} INDEXED BY idx_timer_schedules_far
    WHERE far_bucket IS NOT NULL AND far_bucket < substr(?1, 1, {BUCKET_CHARS})
    ORDER BY far_bucket LIMIT ?2)
"""
# The edge only moves forward, whoever moves it.
SET_EDGE = f"""
INSERT INTO {HORIZON} AS h (id, edge) VALUES (1, ?1)
ON CONFLICT (id) DO UPDATE SET edge = max(h.edge, excluded.edge)
"""
GET = sa.text(
    f"SELECT {COLUMNS} FROM {TABLE} WHERE tenant_id = :tenant AND service_call_id = :call"
)
# Without stats the planner prefers the primary key (it yields service_call_id order) and
# would walk the whole tenant; a correlation id matches a handful of rows, so seek on it.
FIND_BY_CORRELATION = sa.text(
    f"SELECT {COLUMNS} FROM {TABLE} INDEXED BY idx_timer_schedules_correlation_id "
    "WHERE correlation_id = :correlation AND tenant_id = :tenant ORDER BY service_call_id"
)
LIST_FOR_TENANT = sa.text(
    f"SELECT {COLUMNS} FROM {TABLE} "
    "WHERE tenant_id = :tenant AND service_call_id > :after ORDER BY service_call_id LIMIT :limit"
)
COUNT_SCHEDULED_FOR_TENANT = f"""
SELECT (SELECT count(*) FROM {TABLE} INDEXED BY idx_timer_schedules_tenant_due
        WHERE tenant_id = ?1 AND state = 'Scheduled' AND far_bucket IS NULL)
     + (SELECT count(*) FROM {TABLE} INDEXED BY idx_timer_schedules_far_tenant
        WHERE tenant_id = ?1 AND far_bucket IS NOT NULL)
"""
# count_scheduled counts in slices of the partial due index, each a read of its own, so that
# the poll, which shares the reader thread, never waits behind a count of the whole index
# (half a second at ten million pending timers). The key of the ?4-th entry after a key ...
COUNT_SCHEDULED_BOUNDARY = f"""
SELECT due_at, tenant_id, service_call_id FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL
  AND (due_at, tenant_id, service_call_id) > (?1, ?2, ?3)
ORDER BY due_at, tenant_id, service_call_id LIMIT 1 OFFSET ?4 - 1
"""
# ... and, past the last such key, how many are left (fewer than ?4).
COUNT_SCHEDULED_REST = f"""
SELECT count(*) FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND far_bucket IS NULL
  AND (due_at, tenant_id, service_call_id) > (?1, ?2, ?3)
"""
# The far timers in the same slices, by (bucket, rowid) ...
COUNT_FAR_BOUNDARY = f"""
SELECT far_bucket, rowid FROM {TABLE} INDEXED BY idx_timer_schedules_far
WHERE far_bucket IS NOT NULL AND (far_bucket, rowid) > (?1, ?2)
ORDER BY far_bucket, rowid LIMIT 1 OFFSET ?3 - 1
"""
COUNT_FAR_REST = f"""
SELECT count(*) FROM {TABLE} INDEXED BY idx_timer_schedules_far
WHERE far_bucket IS NOT NULL AND (far_bucket, rowid) > (?1, ?2)
"""
# By rowid: the key would cost each row one more walk down the primary key's index, a
# random page on a large table (a fifth of a purged row's time at 10,000,000 rows).
PURGE_REACHED = sa.text(
    f"DELETE FROM {TABLE} WHERE rowid IN ("
    f"SELECT rowid FROM {TABLE} INDEXED BY idx_timer_schedules_reached_at "
    "WHERE state = 'Reached' AND reached_at < :before ORDER BY reached_at LIMIT :limit)"
)
PURGE_TOMBSTONES = sa.text(
    f"DELETE FROM {TOMBSTONES} WHERE (tenant_id, service_call_id) IN ("
    f"SELECT tenant_id, service_call_id FROM {TOMBSTONES} "
    "INDEXED BY idx_timer_tombstones_cancelled_at "
    "WHERE cancelled_at < :before ORDER BY cancelled_at LIMIT :limit)"
)
