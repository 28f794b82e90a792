"""A big backlog's catch-up: ``--timers`` (1,000,000) timers all overdue when the service
starts, on SQLite (one service) or PostgreSQL (``--instances`` services, 2 by default).

The timers go straight into the store's schema (made by the store's own migrations) in one
bulk load, indexes built after, due at random moments of the last hour over 50 tenants; then
the services start on a fresh ``nats-server`` and the clock runs until none is due. Measured:
drain time and rate, each service's peak RSS and its RSS along the drain. Checked from the
events afterwards: each timer fired once, none early, each tenant's in due order (per
instance), every timer ``Reached``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from timer_bench import kit, sqlite
from timer_bench.kit import TENANTS, mib, now_ms, stamp
from timer_bench.procs import Broker, CheckFailed, Service, postgres, vm_kib

SPREAD_MS = 3_600_000  # overdue by up to an hour
RSS_PARTS = ("RssAnon", "RssFile", "RssShmem")


def overdue_rows(count: int, base_ms: int, tenants: int) -> Iterator[sqlite.Row]:
    registered = stamp(base_ms - SPREAD_MS - 1000)
    rng = random.Random(14)
    for i in range(count):
        due = stamp(base_ms - SPREAD_MS + rng.randrange(SPREAD_MS - 1000))
        yield (f"tenant-{i % tenants:02d}", f"backlog-{i:08d}", f"trace-{i:08d}", due, registered)


class Backlog(Protocol):
    instances: int

    def preload(self, count: int, base_ms: int, tenants: int) -> None: ...
    def env(self, index: int) -> dict[str, str]: ...
    def any_due(self) -> bool: ...
    def states(self) -> dict[str, int]: ...
    def fired_by(self) -> dict[str, str] | None: ...


class SqliteBacklog:
    """One SQLite file, one service."""

    instances = 1

    def __init__(self, root: Path) -> None:
        self.db = root / "timer.db"

    def preload(self, count: int, base_ms: int, tenants: int) -> None:
        rows = overdue_rows(count, base_ms, tenants)
        sqlite.insert_rows(sqlite.create(self.db), rows, rebuild_indexes=True)

    def env(self, index: int) -> dict[str, str]:
        return {"TIMER_DB_PATH": str(self.db)}

    def any_due(self) -> bool:
        return sqlite.any_due(self.db)

    def states(self) -> dict[str, int]:
        return sqlite.state_counts(self.db)

    def fired_by(self) -> None:
        return None


# Bench instrumentation, not the store's: the mark to Reached clears the claim's lease; this
# keeps its owner, so the check knows which instance fired each timer.
_KEEP_FIRER = """
CREATE FUNCTION backlog_keep_firer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.lease_owner := OLD.lease_owner;
    NEW.lease_until := OLD.lease_until;
    RETURN NEW;
END $$;
CREATE TRIGGER backlog_keep_firer BEFORE UPDATE ON timer_schedules FOR EACH ROW
WHEN (NEW.state = 'Reached' AND OLD.state = 'Scheduled')
EXECUTE FUNCTION backlog_keep_firer();
"""


class PostgresBacklog:
    """``instances`` services on one database of a durable PostgreSQL cluster."""

    def __init__(self, cluster: Any, instances: int) -> None:
        self.instances = instances
        self.cluster = cluster
        self.url = cluster.create_database("backlog")

    def rows(self, sql: str) -> list[Any]:
        import psycopg

        with psycopg.connect(self.cluster.conninfo("backlog"), autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def preload(self, count: int, base_ms: int, tenants: int) -> None:
        import psycopg

        from timer_adapters_postgres import PostgresTimerStore
        from timer_bench.large import secondary_indexes

        async def migrate() -> None:
            async with PostgresTimerStore(self.url, owner_id="preload", listen=False):
                pass

        asyncio.run(migrate())
        with psycopg.connect(self.cluster.conninfo("backlog"), autocommit=True) as conn:
            indexes = secondary_indexes(conn)
            with conn.transaction():
                for name, _ in indexes:
                    conn.execute(f'DROP INDEX "{name}"')
                columns = "tenant_id, service_call_id, correlation_id, due_at, registered_at"
                with conn.cursor().copy(f"COPY timer_schedules ({columns}) FROM STDIN") as copy:
                    chunk = io.StringIO()
                    for n, row in enumerate(overdue_rows(count, base_ms, tenants), 1):
                        chunk.write("\t".join(str(cell) for cell in row) + "\n")
                        if n % 50_000 == 0:
                            copy.write(chunk.getvalue())
                            chunk = io.StringIO()
                    copy.write(chunk.getvalue())
                for _, sql in indexes:
                    conn.execute(sql)
            conn.execute(_KEEP_FIRER)
            conn.execute("VACUUM ANALYZE timer_schedules")

    def env(self, index: int) -> dict[str, str]:
        return {"TIMER_DATABASE_URL": self.url, "TIMER_INSTANCE_ID": f"backlog-{index}"}

    def any_due(self) -> bool:
        return bool(
            self.rows(
                "SELECT 1 FROM timer_schedules WHERE state = 'Scheduled' AND due_at <= now() "
                "LIMIT 1"
            )
        )

    def states(self) -> dict[str, int]:
        return dict(self.rows("SELECT state, count(*) FROM timer_schedules GROUP BY state"))

    def fired_by(self) -> dict[str, str]:
        return dict(self.rows("SELECT service_call_id, lease_owner FROM timer_schedules"))


def order_checks(
    events: list[tuple[str, str, str, str]], fired_by: dict[str, str] | None
) -> dict[str, Any]:
    """Early firings, and due order in the stream within each tenant (reported) and within
    each tenant's timers fired by one instance (the check: one firer keeps due order; two
    publish their batches side by side). Events are ``(tenant, call, dueAt, reachedAt)``;
    the wire's instants are fixed-width UTC text, so they sort as they compare."""
    early = tenant_inversions = instance_inversions = 0
    worst_ms = 0.0
    latest_of_tenant: dict[str, str] = {}
    latest_of_instance: dict[tuple[str, str], str] = {}
    for tenant, call, due, reached in events:
        early += reached < due
        latest = latest_of_tenant.get(tenant, "")
        if due < latest:
            tenant_inversions += 1
            worst_ms = max(worst_ms, kit.epoch_ms(latest) - kit.epoch_ms(due))
        else:
            latest_of_tenant[tenant] = due
        key = (tenant, "" if fired_by is None else fired_by.get(call, "?"))
        if due < latest_of_instance.get(key, ""):
            instance_inversions += 1
        else:
            latest_of_instance[key] = due
    return {
        "events": len(events),
        "distinct_timers": len({call for _, call, _, _ in events}),
        "tenants_seen": len(latest_of_tenant),
        "early": early,
        "out_of_due_order_within_tenant_and_instance": instance_inversions,
        "out_of_due_order_within_tenant": tenant_inversions,
        "worst_inversion_ms": worst_ms,
    }


async def drain(store: Backlog, root: Path, count: int, sample_s: float) -> dict[str, Any]:
    async with Broker(root) as broker:
        services = [
            Service(
                root,
                f"backlog-{index}",
                {
                    "TIMER_BROKER_URL": broker.url,
                    "TIMER_LOG_LEVEL": "WARNING",
                    **store.env(index),
                },
            )
            for index in range(store.instances)
        ]
        samples: list[dict[str, Any]] = []
        try:
            started = time.perf_counter()
            pids = [service.start().pid for service in services]
            next_sample = 0.0
            while await asyncio.to_thread(store.any_due):
                for service in services:
                    service.check_alive()
                elapsed = time.perf_counter() - started
                if elapsed > 120 + count / 500:
                    raise CheckFailed(f"timers still due after {elapsed:.0f}s")
                if elapsed >= next_sample:
                    next_sample += sample_s
                    samples.append(
                        {
                            "s": round(elapsed, 1),
                            "events": await broker.stream_messages(),
                            "rss_mib": [mib(vm_kib(pid, "VmRSS")) for pid in pids],
                            # Heap and stacks; mapped files (libraries, the WAL index); shared.
                            "anon_file_shmem_mib": [
                                [mib(vm_kib(pid, part)) for part in RSS_PARTS] for pid in pids
                            ],
                        }
                    )
                await asyncio.sleep(0.1)
            drain_s = time.perf_counter() - started
            peaks = [service.peak_rss_mb() for service in services]
            ends = [mib(vm_kib(pid, "VmRSS")) for pid in pids]
            codes = [service.stop() for service in services]
        finally:
            for service in services:
                service.kill()
        stored = await broker.stream_messages()
        payloads = await broker.read_events(count)
    events = [(p["tenantId"], p["serviceCallId"], p["dueAt"], p["reachedAt"]) for p in payloads]
    return {
        "drain_s": round(drain_s, 2),
        "per_s": round(count / drain_s, 1),
        "peak_rss_mib": peaks,
        "rss_at_end_mib": ends,
        "exit_codes": codes,
        "stream_messages": stored,
        "rss_samples": samples,
        **order_checks(events, await asyncio.to_thread(store.fired_by)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3,000 timers")
    parser.add_argument("--timers", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=TENANTS)
    parser.add_argument("--instances", type=int, default=2, help="services on PostgreSQL")
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument("--rss-limit-mib", type=float, default=200.0)


def main(args: argparse.Namespace) -> int:
    kind = args.scenario.removeprefix("backlog-")
    timers = 3_000 if args.quick else args.timers
    sample_s = 0.5 if args.quick else args.sample_s
    root = Path(tempfile.mkdtemp(prefix="timer-backlog-"))
    machine = kit.machine()
    try:
        with postgres() if kind == "postgres" else contextlib.nullcontext() as cluster:
            store: Backlog = (
                SqliteBacklog(root) if cluster is None else PostgresBacklog(cluster, args.instances)
            )
            kit.progress(f"preloading {timers:,} overdue timers into {kind}")
            began = time.perf_counter()
            store.preload(timers, now_ms(), args.tenants)
            preload_s = time.perf_counter() - began
            result = asyncio.run(drain(store, root, timers, sample_s))
            states = store.states()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    checks = {
        "every timer fired once": result["events"] == timers == result["stream_messages"]
        and result["distinct_timers"] == timers,
        "none early": result["early"] == 0,
        "each tenant in due order (per instance)": (
            result["out_of_due_order_within_tenant_and_instance"] == 0
        ),
        "store: all Reached": states == {"Reached": timers},
        "clean exit": all(code == 0 for code in result["exit_codes"]),
        f"peak RSS <= {args.rss_limit_mib:g} MiB": max(result["peak_rss_mib"])
        <= args.rss_limit_mib,
    }
    document = {
        "date": kit.today(),
        "store": kind,
        "instances": store.instances,
        "timers": timers,
        "tenants": args.tenants,
        "machine": machine,
        "preload_s": round(preload_s, 1),
        "states": states,
        **result,
        "checks": checks,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import backlog_line

    print(backlog_line(document))
    return kit.report_checks(checks)
