"""The operator's console and the census at ``--timers`` (default 10,000,000) stored timers,
on SQLite (``console-sqlite``) or PostgreSQL (``console-postgres``).

The timers are written by bulk SQL straight into the store's own schema (made by its
migrations; secondary indexes dropped, the rows inserted in key order by one ``INSERT ...
SELECT`` over a generated series, the indexes built again, statistics taken): 1,000 tenants
of equal size; one timer in ten fired (``Reached``) a day or more ago; one in a thousand
overdue by up to an hour; the rest pending, due over the next 30 days; a correlation id
shared by three timers.

Measured, with the console served by the same ``HealthEndpoint`` and ``Console`` as
``timer-service run`` (no broker: the dead-letter page is left out) and asked for by a client
thread over loopback HTTP: each page's response time, 100 requests after 3 warm-ups (and the
overview's first, cold answer, which reads the tenant ranking); the census (``take_census``
at the default ``TIMER_CENSUS_CAP``) in alternated rounds with the store's full
``count_scheduled`` (the pending gauge's count) as the yardstick: wall and CPU time (this
process's, plus PostgreSQL's backends'), and the share of one core it takes at the default
``TIMER_CENSUS_INTERVAL``.

    flock /tmp/timer-bench.lock uv run python -m timer_bench console-sqlite
    flock /tmp/timer-bench.lock uv run python -m timer_bench console-postgres
    uv run python -m timer_bench console-sqlite --quick      # 100,000 timers

``--db PATH`` keeps (and reuses) the SQLite file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from timer_bench import kit
from timer_bench.procs import postgres, postgres_version
from timer_core import QuarantinedTimer, SystemClock, TimerKey, TimerStore
from timer_service.access import HttpAccess
from timer_service.census import take_census
from timer_service.console import Console
from timer_service.http import HealthEndpoint
from timer_service.settings import Settings

TENANTS = 1000
REQUESTS = 100
WARMUP = 3
ROUNDS = 15
_DAY_S = 86_400

# Seconds from now each row i is due: one in ten fired 1-8 days ago, one in a thousand
# overdue by up to an hour, the rest over the next 30 days (a multiplicative hash spreads
# them). The same integer arithmetic in both dialects.
_DUE_S = (
    "CASE WHEN i % 10 = 0 THEN -(86400 + (i * 7919) % (7 * 86400)) "
    "WHEN i % 1000 = 1 THEN -((i * 31) % 3600) "
    "ELSE 1 + (i * 2654435761) % (30 * 86400) END"
)


def _sqlite_insert(count: int, now_s: float) -> str:
    def stamp(seconds: str) -> str:
        return f"strftime('%Y-%m-%dT%H:%M:%fZ', {seconds}, 'unixepoch')"

    due = f"({now_s} + ({_DUE_S}))"
    return f"""
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {count - 1})
INSERT INTO timer_schedules
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at)
SELECT 'tenant-' || printf('%04d', i / {count // TENANTS}), 'call-' || printf('%09d', i),
       'corr-' || printf('%09d', i / 3), {stamp(due)}, {stamp(f"{now_s} - 40 * 86400")},
       CASE WHEN i % 10 = 0 THEN 'Reached' ELSE 'Scheduled' END,
       CASE WHEN i % 10 = 0 THEN {stamp(due + " + 0.05")} END
FROM n
"""


def load_sqlite(path: Path, count: int, now_s: float) -> None:
    import sqlite3

    from timer_adapters_sqlite import migrate

    migrate(path)
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA synchronous = OFF")
        db.execute("PRAGMA cache_size = -262144")
        indexes = db.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
            "AND tbl_name = 'timer_schedules'"
        ).fetchall()
        db.execute("BEGIN")
        for name, _ in indexes:
            db.execute(f"DROP INDEX {name}")
        db.execute(_sqlite_insert(count, now_s))
        for _, sql in indexes:
            db.execute(sql)
        db.execute("COMMIT")
        db.execute("ANALYZE")
    finally:
        db.close()


def _pg_insert(count: int, now_s: float) -> str:
    def stamp(seconds: str) -> str:
        return f"date_trunc('milliseconds', to_timestamp({seconds}))"

    due = f"({now_s} + ({_DUE_S}))"
    return f"""
INSERT INTO timer_schedules
    (tenant_id, service_call_id, correlation_id, due_at, registered_at, state, reached_at)
SELECT 'tenant-' || lpad((i / {count // TENANTS})::text, 4, '0'),
       'call-' || lpad(i::text, 9, '0'), 'corr-' || lpad((i / 3)::text, 9, '0'),
       {stamp(due)}, {stamp(f"{now_s} - 40 * 86400")},
       CASE WHEN i % 10 = 0 THEN 'Reached' ELSE 'Scheduled' END,
       CASE WHEN i % 10 = 0 THEN {stamp(due + " + 0.05")} END
FROM generate_series(0::bigint, {count - 1}) AS i
"""


def load_postgres(url: str, conninfo: str, count: int, now_s: float) -> None:
    import psycopg

    from timer_adapters_postgres import PostgresTimerStore

    async def migrate() -> None:
        store = PostgresTimerStore(url, owner_id="preload", listen=False)
        await store.start()
        await store.aclose()

    asyncio.run(migrate())
    with psycopg.connect(conninfo, autocommit=True) as conn:
        indexes = conn.execute(
            "SELECT i.indexname, i.indexdef FROM pg_indexes i "
            "WHERE i.tablename = 'timer_schedules' AND NOT EXISTS ("
            "  SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)"
        ).fetchall()
        conn.execute("SET maintenance_work_mem = '1GB'")
        with conn.transaction():
            for name, _ in indexes:
                conn.execute(f'DROP INDEX "{name}"')
            conn.execute(_pg_insert(count, now_s))
            for _, sql in indexes:
                conn.execute(sql)
        conn.execute("VACUUM ANALYZE timer_schedules")


class _NoQuarantine:
    """A worker's quarantine with nothing in it (the bench runs no worker)."""

    @property
    def quarantined(self) -> list[QuarantinedTimer]:
        return []

    def retry_quarantined(self, keys: Iterable[TimerKey] | None = None) -> int:
        return 0


def get(port: int, path: str) -> tuple[int, float, int]:
    """One GET on a fresh connection (as the endpoint answers one request per connection):
    status, seconds, body bytes."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    return response.status, time.perf_counter() - started, len(body)


async def measure_pages(port: int, pages: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def run(path: str) -> list[float]:
        times = []
        for n in range(WARMUP + REQUESTS):
            status, seconds, _ = get(port, path)
            assert status in (200, 303), (path, status)  # a search by key redirects
            if n >= WARMUP:
                times.append(seconds)
        return times

    cold_status, cold_s, _ = await asyncio.to_thread(get, port, "/console")
    assert cold_status == 200
    results["overview (cold: reads the tenant ranking)"] = {"seconds": round(cold_s, 3)}
    for name, path in pages.items():
        times = await asyncio.to_thread(run, path)
        results[name] = {"path": path, **kit.percentiles([t * 1000 for t in times])}
    return results


def _cpu(pg_pid: int | None) -> float:
    """CPU seconds of this process, plus PostgreSQL's (the postmaster's children) if given."""
    used = time.process_time()
    if pg_pid is not None:
        import psutil

        for child in psutil.Process(pg_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                times = child.cpu_times()
                used += times.user + times.system
    return used


async def measure_census(
    store: Any, cap: int, interval_s: float, pg_pid: int | None
) -> dict[str, Any]:
    """Alternated rounds: the census, then the full count of pending timers (yardstick)."""

    async def timed(work: Callable[[], Any]) -> tuple[float, float]:
        cpu, wall = _cpu(pg_pid), time.perf_counter()
        await work()
        return time.perf_counter() - wall, _cpu(pg_pid) - cpu

    census_wall, census_cpu, count_wall, count_cpu, ratios = [], [], [], [], []
    readings: list[Any] = []

    async def census() -> None:
        readings.append(await take_census(store, datetime.now(UTC), cap=cap))

    for _ in range(ROUNDS):
        wall, cpu = await timed(census)
        census_wall.append(wall)
        census_cpu.append(cpu)
        wall2, cpu2 = await timed(store.count_scheduled)
        count_wall.append(wall2)
        count_cpu.append(cpu2)
        ratios.append(wall / wall2)
    last = readings[-1]
    return {
        "cap": cap,
        "interval_s": interval_s,
        "counts": last.counts,
        "oldest_overdue_s": last.oldest_overdue_s,
        "census_wall_ms_median": kit.median(census_wall) * 1000,
        "census_cpu_ms_median": kit.median(census_cpu) * 1000,
        "census_core_share_at_interval": kit.median(census_cpu) / interval_s,
        "full_count_wall_ms_median": kit.median(count_wall) * 1000,
        "full_count_cpu_ms_median": kit.median(count_cpu) * 1000,
        "census_to_full_count_wall_ratio_median": kit.median(ratios),
        "rounds": ROUNDS,
    }


async def serve_and_measure(store: TimerStore, count: int, pg_pid: int | None) -> dict[str, Any]:
    settings = Settings()
    endpoint: HealthEndpoint | None = None

    def port() -> int:
        assert endpoint is not None
        return endpoint.port

    access = HttpAccess(None)
    console = Console(
        store=store,
        quarantine=_NoQuarantine(),
        clock=SystemClock(),
        access=access,
        port=port,
        census_cap=settings.census_cap,
    )
    endpoint = HealthEndpoint(
        "127.0.0.1", 0, CollectorRegistry(), lambda: (True, {}), access=access, app=console
    )
    async with store:
        await endpoint.start()
        try:
            per_tenant = count // TENANTS
            middle = TENANTS // 2
            tenant = f"tenant-{middle:04d}"
            call = f"call-{middle * per_tenant + 123:09d}"
            deep = datetime.now(UTC).timestamp() + 15 * _DAY_S
            deep_cursor = datetime.fromtimestamp(deep, UTC).isoformat(timespec="milliseconds")
            pages = {
                "overview": "/console",
                "tenant, pending, first page": f"/console/tenant?tenant={tenant}",
                "tenant, pending, a page 15 days in": (
                    f"/console/tenant?tenant={tenant}&after={deep_cursor.replace('+00:00', 'Z')}|-"
                ),
                "tenant, all states": f"/console/tenant?tenant={tenant}&state=all",
                "tenant, fired only (filtered scan)": (
                    f"/console/tenant?tenant={tenant}&state=reached"
                ),
                "timer": f"/console/timer?tenant={tenant}&call={call}",
                "search by key": f"/console/search?tenant={tenant}&call={call}",
                "search by correlation id (all tenants)": (
                    f"/console/search?correlation=corr-{(middle * per_tenant + 123) // 3:09d}"
                ),
                "quarantine": "/console/quarantine",
            }
            census = await measure_census(
                store, settings.census_cap, settings.census_interval_s, pg_pid
            )
            return {"pages": await measure_pages(endpoint.port, pages), "census": census}
        finally:
            await endpoint.aclose()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="100,000 timers")
    parser.add_argument("--timers", type=int, default=10_000_000)
    parser.add_argument("--db", type=Path, help="SQLite file to keep and reuse")


def main(args: argparse.Namespace) -> int:
    kind = args.scenario.removeprefix("console-")
    timers = 100_000 if args.quick else args.timers
    now_s = round(time.time(), 3)
    document: dict[str, Any] = {"date": kit.today(), "store": kind, "timers": timers}
    with tempfile.TemporaryDirectory(prefix="timer-console-bench-") as root:
        started = time.perf_counter()
        if kind == "sqlite":
            from timer_adapters_sqlite import SqliteTimerStore

            document["machine"] = kit.machine()
            path = args.db or Path(root) / "timer.db"
            if path.exists():
                kit.progress(f"reusing {path} (its timers are due relative to its loading)")
                document["reused_load_s"] = None  # unknown here: say so in the results
            else:
                kit.progress(f"loading {timers:,} timers into {path}")
                load_sqlite(path, timers, now_s)
            document["load_s"] = round(time.perf_counter() - started, 1)
            document["database_bytes"] = path.stat().st_size
            kit.progress("measuring")
            store: TimerStore = SqliteTimerStore(path, pragmas={"cache_size": -32768})
            document |= asyncio.run(serve_and_measure(store, timers, None))
        else:
            from timer_adapters_postgres import PostgresTimerStore

            document["machine"] = kit.machine(postgres=postgres_version())
            with postgres({"shared_buffers": "1GB"}) as cluster:
                url = cluster.create_database("console")
                kit.progress(f"loading {timers:,} timers into PostgreSQL")
                load_postgres(url, cluster.conninfo("console"), timers, now_s)
                document["load_s"] = round(time.perf_counter() - started, 1)
                kit.progress("measuring")
                store = PostgresTimerStore(url, owner_id="bench", listen=False)
                document |= asyncio.run(serve_and_measure(store, timers, cluster.process.pid))
    kit.write_result(document, args.output)
    return 0
