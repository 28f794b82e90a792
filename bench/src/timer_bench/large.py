"""The service on a large table: ``--pending`` timers (1,000,000; 10,000,000 for the figures)
due over the next 30 days across 1,000 tenants, plus ``--reached`` fired timers past the
retention (fired 7-14 days ago), on SQLite (one service) or PostgreSQL (one and two).

The rows go in by bulk SQL behind the store's back (SQLite: one ``INSERT ... SELECT`` from a
recursive counter; PostgreSQL: ``INSERT ... SELECT FROM generate_series``), the store's
secondary indexes dropped first and built after, into the schema the store's own migrations
made. Then, measured:

- **sizes**: table and index bytes per timer (SQLite ``dbstat``, PostgreSQL
  ``pg_relation_size``);
- **plans** of the store's statements at that size: SQLite ``EXPLAIN QUERY PLAN`` of every
  statement of the store's SQL module; PostgreSQL ``auto_explain`` (``ANALYZE``,
  ``BUFFERS``, a sample of the service's own statements) from the server's log;
- **schedule rate** into the large table against into an empty one, alternated rounds:
  ``--commands`` commands waiting in ``TIMER_COMMANDS`` before the service starts;
- **steady**: ``--rates`` new timers a second, each due 1-2 s ahead, through the real
  service on the large table (and at the first rate on an empty one): lateness, the fire
  rate, every service's RSS, and what retention (the default ``TIMER_RETENTION``, 7 days)
  purged meanwhile of the expired fired rows, with the file's size (SQLite) or the table's
  size and autovacuum's work (PostgreSQL) sampled along the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import pkgutil
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from timer_bench import kit
from timer_bench import sqlite as bench_sqlite
from timer_bench.e2e import future_commands, steady_lateness
from timer_bench.kit import mib, now_ms, percentiles
from timer_bench.procs import (
    DURABLE_PG,
    Broker,
    CheckFailed,
    Service,
    Usage,
    nats_server_version,
    postgres,
    postgres_version,
    vm_kib,
    with_children,
)
from timer_core import FindsDueByTenant
from timer_core.horizon import edge_for

TENANTS = 1000
DAY_MS = 86_400_000
HORIZON_MS = 30 * DAY_MS
#: The loaded timers fall due from this long after the load: none during a run.
LEAD_MS = 2 * 3_600_000
#: Fired rows are loaded past the default retention (7 days): every one is the purge's.
RETENTION_MS = 7 * DAY_MS
#: A sample of the service's statements with their plans (ANALYZE, BUFFERS) in the log.
AUTO_EXPLAIN = {
    "session_preload_libraries": "auto_explain",
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_buffers": "on",
    "auto_explain.log_format": "json",
    "auto_explain.sample_rate": "0.02",
}


# -- the stores ------------------------------------------------------------------------------


class Large(Protocol):
    kind: str

    def store(self, db: str) -> Any: ...
    def create(self, name: str) -> str: ...
    def load(self, db: str, pending: int, reached: int, base_ms: int) -> None: ...
    def env(self, db: str, index: int) -> dict[str, str]: ...
    def sizes(self, db: str) -> dict[str, Any]: ...
    def sample(self, db: str) -> dict[str, Any]: ...
    def purgeable(self, db: str, now: int) -> int: ...
    def any_due(self, db: str) -> bool: ...
    def scheduled(self, db: str) -> int: ...
    def stored(self, db: str, prefix: str) -> int: ...
    def first_registered(self, db: str, prefix: str) -> float: ...
    def static_plans(self, db: str) -> dict[str, list[str]]: ...
    def log_offset(self) -> int: ...
    def server_pids(self) -> list[int]: ...
    def logged_plans(self, since: int) -> list[dict[str, Any]]: ...


_SQLITE_STAMP = (
    "strftime('%Y-%m-%dT%H:%M:%S', {ms} / 1000, 'unixepoch') || printf('.%03dZ', {ms} % 1000)"
)


def _sqlite_stamp(ms: str) -> str:
    return _SQLITE_STAMP.format(ms=f"({ms})")


class SqliteLarge:
    """One SQLite file per database, one service on it."""

    kind = "sqlite"

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, db: str) -> Path:
        return self.root / db / "timer.db"

    def create(self, name: str) -> str:
        bench_sqlite.create(self.path(name))
        return name

    def load(self, db: str, pending: int, reached: int, base_ms: int) -> None:
        connection = bench_sqlite.connect(self.path(db), synchronous="OFF")
        try:
            connection.execute("PRAGMA cache_size = -1048576")
            indexes = connection.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                f"AND tbl_name = '{bench_sqlite.TABLE}' AND sql IS NOT NULL"
            ).fetchall()
            connection.execute("BEGIN IMMEDIATE")
            for name, _ in indexes:
                connection.execute(f"DROP INDEX {name}")
            counter = (
                "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?)"
            )
            tenant = f"'tenant-' || printf('%02d', i % {TENANTS})"
            # As the store writes them once its first poll set the far edge: a timer due at
            # or after the edge is far, by its 10-minute bucket (timer_core.horizon).
            base = datetime.fromtimestamp(base_ms / 1000, UTC)
            edge = kit.stamp(int(edge_for(base).timestamp() * 1000))
            connection.execute(
                "INSERT INTO timer_horizon (id, edge) VALUES (1, ?) "
                "ON CONFLICT (id) DO UPDATE SET edge = excluded.edge",
                (edge,),
            )
            connection.execute(
                f"INSERT INTO {bench_sqlite.TABLE} "
                "(tenant_id, service_call_id, correlation_id, due_at, registered_at, far_bucket) "
                f"{counter}, d(i, due) AS ("
                f"SELECT i, {_sqlite_stamp(f'{base_ms + LEAD_MS} + abs(random()) % {HORIZON_MS}')} "
                f"FROM n) SELECT {tenant}, printf('large-%09d', i), printf('trace-%09d', i), due, "
                f"{_sqlite_stamp(str(base_ms))}, CASE WHEN due >= ?2 THEN substr(due, 1, 15) END "
                "FROM d",
                (pending, edge),
            )
            reached_ms = f"{base_ms - RETENTION_MS - 3_600_000} - abs(random()) % {RETENTION_MS}"
            connection.execute(
                f"INSERT INTO {bench_sqlite.TABLE} "
                "(tenant_id, service_call_id, correlation_id, due_at, registered_at, state, "
                f"reached_at) {counter}, r(i, at) AS (SELECT i, {reached_ms} FROM n) "
                f"SELECT {tenant}, printf('fired-%09d', i), printf('trace-f%09d', i), "
                f"{_sqlite_stamp('at - 5')}, {_sqlite_stamp('at - 60000')}, 'Reached', "
                f"{_sqlite_stamp('at')} FROM r",
                (reached,),
            )
            for _, sql in indexes:
                connection.execute(sql)
            connection.execute("COMMIT")
            connection.execute("ANALYZE")
            connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            connection.close()

    def env(self, db: str, index: int) -> dict[str, str]:
        return {"TIMER_DB_PATH": str(self.path(db))}

    def store(self, db: str) -> Any:
        from timer_adapters_sqlite import SqliteTimerStore

        return SqliteTimerStore(self.path(db))

    def _one(self, db: str, sql: str, args: tuple[Any, ...] = ()) -> Any:
        connection = bench_sqlite.connect(self.path(db))
        try:
            return connection.execute(sql, args).fetchone()[0]
        finally:
            connection.close()

    def sizes(self, db: str) -> dict[str, Any]:
        connection = bench_sqlite.connect(self.path(db))
        try:
            parts = dict(
                connection.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
            )
            rows = connection.execute(f"SELECT count(*) FROM {bench_sqlite.TABLE}").fetchone()[0]
        finally:
            connection.close()
        table = int(parts.get(bench_sqlite.TABLE, 0))
        indexes = {
            name: int(size)
            for name, size in parts.items()
            if name.startswith(("idx_timer_schedules", "sqlite_autoindex_timer_schedules"))
        }
        return {
            "rows": rows,
            "file_bytes": self.path(db).stat().st_size,
            "table_bytes": table,
            "index_bytes": indexes,
            "bytes_per_timer": round((table + sum(indexes.values())) / max(rows, 1), 1),
        }

    def sample(self, db: str) -> dict[str, Any]:
        path = self.path(db)
        wal = Path(f"{path}-wal")
        connection = bench_sqlite.connect(path)
        try:
            free = connection.execute("PRAGMA freelist_count").fetchone()[0]
            page = connection.execute("PRAGMA page_size").fetchone()[0]
        finally:
            connection.close()
        return {
            "file_mib": mib(path.stat().st_size / 1024),
            "wal_mib": mib(wal.stat().st_size / 1024) if wal.exists() else 0.0,
            "free_mib": mib(free * page / 1024),
        }

    def any_due(self, db: str) -> bool:
        return bench_sqlite.any_due(self.path(db))

    def purgeable(self, db: str, now: int) -> int:
        return int(
            self._one(
                db,
                f"SELECT count(*) FROM {bench_sqlite.TABLE} "
                "INDEXED BY idx_timer_schedules_reached_at "
                "WHERE state = 'Reached' AND reached_at < ?",
                (kit.stamp(now - RETENTION_MS),),
            )
        )

    def scheduled(self, db: str) -> int:
        return int(
            self._one(
                db,
                f"SELECT (SELECT count(*) FROM {bench_sqlite.TABLE} "
                "INDEXED BY idx_timer_schedules_scheduled_due "
                "WHERE state = 'Scheduled' AND far_bucket IS NULL) + "
                f"(SELECT count(*) FROM {bench_sqlite.TABLE} INDEXED BY idx_timer_schedules_far "
                "WHERE far_bucket IS NOT NULL)",
            )
        )

    def first_registered(self, db: str, prefix: str) -> float:
        return bench_sqlite.first_of(self.path(db), "registered_at", prefix)

    def stored(self, db: str, prefix: str) -> int:
        return int(
            self._one(
                db,
                f"SELECT count(*) FROM {bench_sqlite.TABLE} WHERE service_call_id GLOB ? "
                "AND state = 'Scheduled'",
                (f"{prefix}-*",),
            )
        )

    def static_plans(self, db: str) -> dict[str, list[str]]:
        """``EXPLAIN QUERY PLAN`` of every statement of the store's SQL modules (whatever
        they are named), parameters NULL: the plan SQLite picks at this size."""
        package = importlib.import_module("timer_adapters_sqlite")
        statements: dict[str, str] = {}  # text -> where it is (modules re-export)
        for info in pkgutil.iter_modules(package.__path__, "timer_adapters_sqlite."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                text = getattr(value, "text", value)
                if isinstance(text, str) and re.match(
                    r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\b", text
                ):
                    statements.setdefault(text, f"{info.name.rsplit('.', 1)[1]}.{name}")
        connection = sqlite3.connect(f"file:{self.path(db)}?mode=ro", uri=True)
        plans: dict[str, list[str]] = {}
        try:
            for text, name in sorted(statements.items(), key=lambda item: item[1]):
                names = re.findall(r"(?<![:\w]):(\w+)", text)
                numbered = [int(n) for n in re.findall(r"\?(\d+)", text)]
                args: Any = (
                    dict.fromkeys(names)
                    if names
                    else [None] * (max(numbered) if numbered else text.count("?"))
                )
                try:
                    rows = connection.execute(f"EXPLAIN QUERY PLAN {text}", args).fetchall()
                    plans[name] = [str(row[-1]) for row in rows]
                except sqlite3.Error as exc:
                    plans[name] = [f"(not planned here: {exc})"]
        finally:
            connection.close()
        return plans

    def log_offset(self) -> int:
        return 0

    def server_pids(self) -> list[int]:
        return []

    def logged_plans(self, since: int) -> list[dict[str, Any]]:
        return []


def secondary_indexes(conn: Any) -> list[tuple[str, str]]:
    """Name and definition of each index of ``timer_schedules`` but its primary key: what a
    bulk load drops first and builds after."""
    rows = conn.execute(
        "SELECT i.indexname, i.indexdef FROM pg_indexes i "
        "WHERE i.tablename = 'timer_schedules' AND NOT EXISTS ("
        "  SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)"
    ).fetchall()
    return [(name, sql) for name, sql in rows]


class PostgresLarge:
    """Databases of one durable PostgreSQL cluster whose log keeps a sample of plans."""

    kind = "postgres"

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def create(self, name: str) -> str:
        from timer_adapters_postgres import PostgresTimerStore

        url = self.cluster.create_database(name)

        async def migrate() -> None:
            async with PostgresTimerStore(url, owner_id="large", listen=False):
                pass

        asyncio.run(migrate())
        return name

    def connect(self, db: str) -> Any:
        import psycopg

        return psycopg.connect(self.cluster.conninfo(db), autocommit=True)

    def load(self, db: str, pending: int, reached: int, base_ms: int) -> None:
        from timer_core.horizon import AHEAD, BUCKET

        tenant = (
            f"'tenant-' || CASE WHEN i % {TENANTS} < 10 THEN '0' ELSE '' END || (i % {TENANTS})"
        )
        base = f"to_timestamp({base_ms} / 1000.0)"
        with self.connect(db) as conn:
            indexes = secondary_indexes(conn)
            with conn.transaction():
                conn.execute("SET LOCAL maintenance_work_mem = '512MB'")
                for name, _ in indexes:
                    conn.execute(f'DROP INDEX "{name}"')
                # As the store writes them: the far edge set from the load's now (raised
                # only), each timer due at or past it far (in its bucket, out of the
                # due-order indexes).
                bucket = f"interval '{int(BUCKET.total_seconds())} seconds'"
                conn.execute(
                    "INSERT INTO timer_horizon AS h (id, edge) VALUES (1, date_bin("
                    f"{bucket}, {base} + interval '{int(AHEAD.total_seconds())} seconds', "
                    "TIMESTAMPTZ 'epoch')) "
                    "ON CONFLICT (id) DO UPDATE SET edge = greatest(h.edge, excluded.edge)"
                )
                conn.execute(
                    "INSERT INTO timer_schedules "
                    "(tenant_id, service_call_id, correlation_id, due_at, registered_at, "
                    "far_bucket) "
                    f"SELECT {tenant}, 'large-' || lpad(i::text, 9, '0'), "
                    "'trace-' || lpad(i::text, 9, '0'), due, "
                    f"{base}, CASE WHEN due >= h.edge THEN date_bin({bucket}, due, "
                    "TIMESTAMPTZ 'epoch') END "
                    f"FROM (SELECT i, date_trunc('milliseconds', {base} "
                    f"+ interval '{LEAD_MS} milliseconds' "
                    f"+ random() * interval '{HORIZON_MS} milliseconds') AS due "
                    f"FROM generate_series(0, {pending - 1}) AS i) AS g, timer_horizon AS h"
                )
                conn.execute(
                    "INSERT INTO timer_schedules (tenant_id, service_call_id, correlation_id, "
                    "due_at, registered_at, state, reached_at) "
                    f"SELECT {tenant}, 'fired-' || lpad(i::text, 9, '0'), "
                    "'trace-f' || lpad(i::text, 9, '0'), at - interval '5 milliseconds', "
                    "at - interval '1 minute', 'Reached', at FROM ("
                    f"SELECT i, date_trunc('milliseconds', {base} "
                    f"- interval '{RETENTION_MS + 3_600_000} milliseconds' "
                    f"- random() * interval '{RETENTION_MS} milliseconds') AS at "
                    f"FROM generate_series(0, {reached - 1}) AS i) AS r"
                )
                for _, sql in indexes:
                    conn.execute(sql)
            conn.execute("VACUUM ANALYZE timer_schedules")
            # The loaded pages to the data files now, not in the first measured round.
            conn.execute("CHECKPOINT")

    def store(self, db: str) -> Any:
        from timer_adapters_postgres import PostgresTimerStore

        return PostgresTimerStore(self.cluster.url(db), owner_id="calls", listen=False)

    def env(self, db: str, index: int) -> dict[str, str]:
        return {
            "TIMER_DATABASE_URL": str(self.cluster.url(db)),
            "TIMER_INSTANCE_ID": f"large-{index}",
        }

    def _one(self, db: str, sql: str, args: tuple[Any, ...] = ()) -> Any:
        with self.connect(db) as conn:
            return conn.execute(sql, args).fetchone()[0]

    def sizes(self, db: str) -> dict[str, Any]:
        with self.connect(db) as conn:
            rows = conn.execute("SELECT count(*) FROM timer_schedules").fetchone()[0]
            table = conn.execute("SELECT pg_table_size('timer_schedules')").fetchone()[0]
            indexes = dict(
                conn.execute(
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) "
                    "FROM pg_index WHERE indrelid = 'timer_schedules'::regclass"
                ).fetchall()
            )
        return {
            "rows": rows,
            "table_bytes": table,
            "index_bytes": indexes,
            "bytes_per_timer": round((table + sum(indexes.values())) / max(rows, 1), 1),
        }

    def sample(self, db: str) -> dict[str, Any]:
        with self.connect(db) as conn:
            row = conn.execute(
                "SELECT n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count, "
                "pg_table_size(relid), pg_indexes_size(relid) "
                "FROM pg_stat_user_tables WHERE relname = 'timer_schedules'"
            ).fetchone()
            running = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
            ).fetchone()[0]
        live, dead, vacuums, analyzes, table, index = row
        return {
            "live": live,
            "dead": dead,
            "autovacuums": vacuums,
            "autoanalyzes": analyzes,
            "autovacuum_running": running,
            "table_mib": mib(table / 1024),
            "indexes_mib": mib(index / 1024),
        }

    def any_due(self, db: str) -> bool:
        return bool(
            self._one(
                db,
                "SELECT count(*) FROM (SELECT 1 FROM timer_schedules WHERE state = 'Scheduled' "
                "AND due_at <= now() LIMIT 1) AS due",
            )
        )

    def purgeable(self, db: str, now: int) -> int:
        return int(
            self._one(
                db,
                "SELECT count(*) FROM timer_schedules WHERE state = 'Reached' "
                "AND reached_at < to_timestamp(%s / 1000.0)",
                (now - RETENTION_MS,),
            )
        )

    def scheduled(self, db: str) -> int:
        return int(self._one(db, "SELECT count(*) FROM timer_schedules WHERE state = 'Scheduled'"))

    def stored(self, db: str, prefix: str) -> int:
        return int(
            self._one(
                db,
                "SELECT count(*) FROM timer_schedules WHERE service_call_id LIKE %s "
                "AND state = 'Scheduled'",
                (f"{prefix}-%",),
            )
        )

    def first_registered(self, db: str, prefix: str) -> float:
        first = self._one(
            db,
            "SELECT min(registered_at) FROM timer_schedules WHERE service_call_id LIKE %s",
            (f"{prefix}-%",),
        )
        if first is None:
            raise CheckFailed(f"no timer of {prefix} stored")
        return float(first.timestamp() * 1000)

    def static_plans(self, db: str) -> dict[str, list[str]]:
        return {}

    def server_pids(self) -> list[int]:
        return with_children(self.cluster.pid)

    @property
    def log(self) -> Path:
        return Path(self.cluster.root) / "postgres.log"

    def log_offset(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def logged_plans(self, since: int) -> list[dict[str, Any]]:
        """The sampled plans auto_explain logged since ``since``, one per statement: how
        often it was sampled, its mean and worst duration, and the worst one's plan."""
        with self.log.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        entries = re.split(r"^\S.*? LOG:  duration: ", text, flags=re.M)[1:]
        by_query: dict[str, dict[str, Any]] = {}
        for entry in entries:
            head, _, body = entry.partition(" ms  plan:\n")
            lines = []
            for line in body.splitlines():
                if line and not line[0].isspace():
                    break
                lines.append(line)
            with contextlib.suppress(ValueError):
                duration = float(head)
                plan = json.loads("\n".join(lines))
                query = " ".join(str(plan.get("Query Text", "")).split())
                seen = by_query.setdefault(
                    query, {"query": query, "sampled": 0, "ms": [], "rows": []}
                )
                seen["sampled"] += 1
                seen["ms"].append(duration)
                seen["rows"].append(plan_rows(plan.get("Plan") or {}))
                if duration >= max(seen["ms"]):
                    seen["worst_plan"] = plan.get("Plan")
        out = []
        for seen in by_query.values():
            durations = seen.pop("ms")
            rows = seen.pop("rows")
            seen["mean_ms"] = round(sum(durations) / len(durations), 3)
            seen["mean_rows"] = round(sum(rows) / len(rows), 1)
            seen["max_ms"] = round(max(durations), 3)
            seen["plan_outline"] = outline(seen.get("worst_plan") or {})
            out.append(seen)
        return sorted(out, key=lambda s: -s["mean_ms"] * s["sampled"])


def plan_rows(node: dict[str, Any]) -> int:
    """The rows a sampled statement handled: the most any of its top two levels' nodes
    returned (a ``DELETE``'s are its scan's, its own node returning none)."""
    nodes = [node, *node.get("Plans", [])]
    return max((int(n.get("Actual Rows", 0)) for n in nodes), default=0)


def outline(node: dict[str, Any], depth: int = 0) -> list[str]:
    """A plan's nodes, one line each: type, relation or index, rows, time, buffers."""
    if not node:
        return []
    what = node.get("Node Type", "?")
    on = node.get("Index Name") or node.get("Relation Name")
    hit = node.get("Shared Hit Blocks", 0)
    read = node.get("Shared Read Blocks", 0)
    line = (
        f"{'  ' * depth}{what}{f' on {on}' if on else ''}: rows {node.get('Actual Rows', '?')}"
        f" x{node.get('Actual Loops', 1)}, {node.get('Actual Total Time', '?')} ms,"
        f" buffers hit {hit} read {read}"
    )
    lines = [line]
    for child in node.get("Plans", []):
        lines += outline(child, depth + 1)
    return lines


# -- the runs --------------------------------------------------------------------------------


async def store_calls(store: Large, db: str, samples: int = 5) -> dict[str, float]:
    """The worker's and the service's store calls on the table, through the store's own API,
    nothing due (the earliest pending timer is a minute ahead): median ms of ``samples``."""

    timers = store.store(db)
    calls: dict[str, Callable[[], Any]] = {
        "count_scheduled": timers.count_scheduled,
        "next_due_at": timers.next_due_at,
        "find_due (batch 100)": lambda: timers.find_due(datetime.now(UTC), 100),
    }
    if isinstance(timers, FindsDueByTenant):
        calls["find_due_by_tenant (batch 100)"] = lambda: timers.find_due_by_tenant(
            datetime.now(UTC), 100, after={}
        )
    out: dict[str, float] = {}
    async with timers:
        for name, call in calls.items():
            taken = []
            for _ in range(samples):
                began = time.perf_counter()
                await call()
                taken.append((time.perf_counter() - began) * 1000)
            out[name] = round(kit.median(taken), 2)
    return out


def start_services(
    store: Large, db: str, root: Path, label: str, broker_url: str, instances: int
) -> list[Service]:
    return [
        Service(
            root,
            f"{label}-{index}",
            {
                "TIMER_BROKER_URL": broker_url,
                "TIMER_LOG_LEVEL": "WARNING",
                **store.env(db, index),
            },
        ).start()
        for index in range(instances)
    ]


async def schedule_rate(store: Large, db: str, root: Path, commands: int, label: str) -> float:
    """``commands`` ScheduleTimer waiting before one service starts; from the first stored
    one's ``registered_at`` until the consumer has none pending or unacknowledged."""
    async with Broker(root / label) as broker:
        await broker.send_schedules(future_commands(commands, label))
        (service,) = start_services(store, db, root, label, broker.url, 1)
        try:
            deadline = time.monotonic() + 120 + commands / 200
            while await broker.command_backlog() > 0:
                service.check_alive()
                if time.monotonic() > deadline:
                    raise CheckFailed(f"{label}: commands still unacked")
                await asyncio.sleep(0.02)
            done = time.time() * 1000
            service.stop()
        finally:
            service.kill()
    stored = await asyncio.to_thread(store.stored, db, label)
    if stored != commands:
        raise CheckFailed(f"{label}: {stored:,} of {commands:,} acked commands stored")
    first = await asyncio.to_thread(store.first_registered, db, label)
    return kit.rate(commands, (done - first) / 1000)


async def steady(
    store: Large,
    db: str,
    root: Path,
    label: str,
    instances: int,
    rate: int,
    seconds: float,
    sample_s: float,
) -> dict[str, Any]:
    """``rate`` timers a second due 1-2 s ahead through ``instances`` services on ``db``."""
    async with Broker(root / label) as broker:
        services = start_services(store, db, root, label, broker.url, instances)
        samples: list[dict[str, Any]] = []
        try:
            for service in services:
                await service.wait_healthy()
            # What an earlier run left due (one that fell behind) is fired first, so that
            # this run's lateness is its own.
            drained_by = time.monotonic() + 300
            while await asyncio.to_thread(store.any_due, db) and time.monotonic() < drained_by:
                await asyncio.sleep(0.5)
            started = time.perf_counter()
            offset = store.log_offset()

            def check() -> None:
                for service in services:
                    service.check_alive()

            async def sampler() -> None:
                while True:
                    row = {
                        "s": round(time.perf_counter() - started, 1),
                        "rss_mib": [mib(vm_kib(s.pid, "VmRSS")) for s in services],
                        **await asyncio.to_thread(store.sample, db),
                    }
                    samples.append(row)
                    await asyncio.sleep(sample_s)

            purgeable_at_start = await asyncio.to_thread(store.purgeable, db, now_ms())
            sampling = asyncio.create_task(sampler())
            groups = {
                "services": [s.pid for s in services],
                "database": store.server_pids(),
                "nats-server": [broker.pid] if broker.pid else [],
                "bench": [os.getpid()],
            }
            usage = Usage.now(groups)
            stream_started = time.perf_counter()
            in_stream = asyncio.create_task(purged_in_stream(services, seconds))
            try:
                sent, reached, readable, early = await steady_lateness(
                    broker, rate, seconds, check, prefix=label
                )
            except BaseException:
                in_stream.cancel()
                raise
            stream_s = time.perf_counter() - stream_started
            purged_between, between_s = await in_stream
            cores = usage.cores(Usage.now(groups))
            # Only this run's timers (an earlier run's late ones may fire meanwhile).
            reached = {k: v for k, v in reached.items() if k.startswith(f"{label}-")}
            readable = {k: v for k, v in readable.items() if k.startswith(f"{label}-")}
            purgeable_at_end = await asyncio.to_thread(store.purgeable, db, now_ms())
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            peaks = [service.peak_rss_mb() for service in services]
            tails = [service.tail() for service in services] if len(readable) < sent else []
            codes = [service.stop() for service in services]
        finally:
            for service in services:
                service.kill()
    purged = purgeable_at_start - purgeable_at_end
    fired = len(readable)
    return {
        "label": label,
        "instances": instances,
        "rate_per_s": rate,
        "sent": sent,
        "fired": fired,
        "early": early,
        "stream_s": round(stream_s, 1),
        "sent_per_s": kit.rate(sent, seconds),
        "fired_per_s": kit.rate(fired, seconds),
        "reached_lateness": percentiles(list(reached.values())),
        "readable_lateness": percentiles(list(readable.values())),
        "peak_rss_mib": peaks,
        "exit_codes": codes,
        "purgeable_at_start": purgeable_at_start,
        "purgeable_at_end": purgeable_at_end,
        "purged_per_s": kit.rate(purged, stream_s),
        "purge_vs_fire": round(purged / max(fired, 1), 2),
        "purge_exhausted": purgeable_at_end == 0,
        # From the services' own count (timer_timers_purged_total), from 5 s into the stream
        # to its last send: no idle second before or after the stream in the window.
        "purged_in_stream_per_s": kit.rate(purged_between, between_s),
        "purge_in_stream_vs_fire": round(purged_between / max(rate * between_s, 1), 2),
        "cores": {group: round(used, 3) for group, used in cores.items()},
        "cpu_ms_per_timer": {
            group: round(cores[group] * stream_s * 1000 / max(fired, 1), 4)
            for group in ("services", "database", "nats-server")
        },
        "load": kit.load_average(),
        "samples": samples,
        "plans": store.logged_plans(offset),
        "service_log_tails": tails,
    }


async def purged_in_stream(services: list[Service], seconds: float) -> tuple[float, float]:
    """How many timers the services' retention deleted from 5 s into a stream of ``seconds``
    to its end, and over how many seconds (read from their ``timer_timers_purged_total``)."""

    async def total() -> float:
        counts = await asyncio.gather(*(service.metrics() for service in services))
        return sum(series.get("timer_timers_purged_total", 0.0) for series in counts)

    lead = min(5.0, seconds / 4)
    await asyncio.sleep(lead)
    began, first = time.perf_counter(), await total()
    await asyncio.sleep(max(0.0, seconds - lead))
    return await total() - first, time.perf_counter() - began


async def run(store: Large, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    instance_counts = [1] if store.kind == "sqlite" else [int(n) for n in args.instances.split(",")]
    empty = await asyncio.to_thread(store.create, "empty")
    big = await asyncio.to_thread(store.create, "large")
    kit.progress(f"{store.kind}: loading {args.pending:,} pending and {args.reached:,} fired")
    began = time.perf_counter()
    await asyncio.to_thread(store.load, big, args.pending, args.reached, now_ms())
    # The load writes without syncing (about 1.4 GiB of the SQLite file at 10M was still
    # unwritten once it returned); left so, the first checkpoint a measured service runs
    # would flush it, inside the first round. A table of that size has been on disk for
    # long in real life.
    await asyncio.to_thread(os.sync)
    out["load_s"] = round(time.perf_counter() - began, 1)
    out["load_per_s"] = kit.rate(args.pending + args.reached, out["load_s"])
    kit.progress(f"loaded in {out['load_s']} s; sizes and plans")
    out["sizes"] = await asyncio.to_thread(store.sizes, big)
    out["static_plans"] = await asyncio.to_thread(store.static_plans, big)
    out["store_calls_ms"] = await store_calls(store, big)
    kit.progress(f"store calls on the large table, ms: {out['store_calls_ms']}")

    async def measure(side: str, round_: int) -> dict[str, Any]:
        load = kit.load_average()[0]
        per_s = await schedule_rate(
            store, big if side == "large" else empty, root, args.commands, f"sched-{side}-{round_}"
        )
        kit.progress(f"schedule rate into {side}, round {round_}: {per_s:,.0f}/s")
        return {"per_s": per_s, "load": load}

    taken = await kit.alternated(args.rounds, ["empty", "large"], measure)
    out["schedule"] = {
        "commands": args.commands,
        "empty_per_s": [one["empty"]["per_s"] for one in taken],
        "large_per_s": [one["large"]["per_s"] for one in taken],
        "large_vs_empty": kit.median_ratio(
            [one["large"]["per_s"] for one in taken], [one["empty"]["per_s"] for one in taken]
        ),
        "rounds_vs_empty": kit.ratios(
            [one["large"]["per_s"] for one in taken], [one["empty"]["per_s"] for one in taken]
        ),
    }
    runs = []
    plan: list[tuple[str, str, int, int]] = [("empty", empty, instance_counts[0], args.rates[0])]
    plan += [("large", big, n, rate) for n in instance_counts for rate in args.rates]
    for side, db, instances, rate in plan:
        label = f"steady-{side}-{instances}x-{rate}"
        kit.progress(f"{label}: {rate:,}/s for {args.seconds:.0f} s, {instances} service(s)")
        result = await steady(store, db, root, label, instances, rate, args.seconds, args.sample_s)
        result["table"] = side
        kit.progress(
            f"  fired {result['fired']:,}/{result['sent']:,}, lateness "
            f"{result['reached_lateness']}, purged {result['purged_per_s']:,.0f}/s, "
            f"RSS {result['peak_rss_mib']}"
        )
        runs.append(result)
    out["steady"] = runs
    out["sizes_after"] = await asyncio.to_thread(store.sizes, big)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="20,000 rows, short runs")
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--reached", type=int, default=None, help="fired rows (default: pending)")
    parser.add_argument(
        "--rates", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 5000]
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="each steady run")
    parser.add_argument("--commands", type=int, default=20_000, help="schedule rate")
    parser.add_argument("--rounds", type=int, default=3, help="schedule rate rounds")
    parser.add_argument("--instances", default="1,2", help="PostgreSQL: service counts")
    parser.add_argument("--sample-s", type=float, default=5.0)


def main(args: argparse.Namespace) -> int:
    kind = args.scenario.removeprefix("large-")
    if args.quick:
        args.pending, args.seconds, args.commands, args.rounds = 20_000, 4.0, 2_000, 1
        args.sample_s = 1.0
    if args.reached is None:
        args.reached = args.pending
    machine = kit.machine(
        nats_server=nats_server_version(),
        **({"postgres": postgres_version()} if kind == "postgres" else {}),
    )
    root = Path(tempfile.mkdtemp(prefix="timer-large-"))
    started = time.monotonic()
    try:
        settings = {**DURABLE_PG, **AUTO_EXPLAIN}
        with postgres(settings) if kind == "postgres" else contextlib.nullcontext() as cluster:
            store: Large = SqliteLarge(root) if cluster is None else PostgresLarge(cluster)
            result = asyncio.run(run(store, root, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine["load_average_end"] = kit.load_average()
    steady_runs = result["steady"]
    checks = {
        "every timer fired, none early": all(
            r["fired"] == r["sent"] and r["early"] == 0 for r in steady_runs
        ),
        "clean exits": all(code == 0 for r in steady_runs for code in r["exit_codes"]),
    }
    document = {
        "date": kit.today(),
        "store": kind,
        "pending": args.pending,
        "reached": args.reached,
        "tenants": TENANTS,
        "rates": args.rates,
        "seconds": args.seconds,
        "machine": machine,
        "run_s": round(time.monotonic() - started, 1),
        **result,
        "checks": checks,
    }
    kit.write_result(document, args.output)
    print(summary(document))
    return kit.report_checks(checks)


def summary(document: dict[str, Any]) -> str:
    lines = [
        f"{document['store']}: {document['pending']:,} pending + {document['reached']:,} fired, "
        f"loaded at {document['load_per_s']:,.0f} rows/s; "
        f"{document['sizes']['bytes_per_timer']:,.0f} bytes a timer (table + indexes)",
        f"schedule rate large / empty: {document['schedule']['large_vs_empty']} "
        f"(rounds {document['schedule']['rounds_vs_empty']})",
    ]
    fmt: Callable[[dict[str, float]], str] = lambda p: (  # noqa: E731
        f"{p['p50_ms']:.0f} / {p['p99_ms']:.0f} / {p['max_ms']:.0f} ms"
    )
    for r in document["steady"]:
        lines.append(
            f"{r['label']}: fired {r['fired']:,}/{r['sent']:,} at {r['fired_per_s']:,.0f}/s, "
            f"lateness p50/p99/max {fmt(r['reached_lateness'])}, purge {r['purge_vs_fire']}x "
            f"the fire rate, peak RSS {r['peak_rss_mib']} MiB"
        )
    return "\n".join(lines)
