"""Big-backlog catch-up: ``--timers`` (default 1,000,000) timers all overdue when the service
starts, on SQLite (one service) or PostgreSQL (``--instances``, default 2, sharing it).

The timers are written straight into the store's schema (made by the store's own migrations:
``migrate()`` on SQLite, ``PostgresTimerStore.start()`` on PostgreSQL) by a bulk insert
(SQLite ``executemany``, PostgreSQL ``COPY``, indexes built after), as after a long
downtime: due at random moments of the last hour, over 50 tenants. Then the service(s) start
on a fresh ``nats-server`` and the clock runs from the first service's start until no
``Scheduled`` timer is due. Measured: drain time and rate, and each service's peak RSS
(``VmHWM``), plus its RSS sampled along the drain (does memory grow with the backlog?).

Checked afterwards from the ``DueTimeReached`` events in ``TIMER_EVENTS`` (a cheap pull
consumer that keeps per event only what the checks need, after the services stopped, so it
takes no CPU from them): every timer fired exactly once, none early (``reachedAt >=
dueAt``), and each tenant's events in due order (tenant fairness interleaves tenants by
design, so the order across tenants is only reported), and the store holds them all
``Reached``.

    flock /tmp/timer-bench.lock uv run --all-packages python bench/backlog.py --store sqlite
    flock /tmp/timer-bench.lock uv run --all-packages python bench/backlog.py --store postgres
    uv run --all-packages python bench/backlog.py --store sqlite --timers 100000   # a quick one

Writes ``bench/results/backlog-<store>.json`` and prints a summary; exits 1 when a check
failed or a service's peak RSS passed ``--rss-limit-mib`` (200).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # tests.pg, tests.timer_service.process

import nats  # noqa: E402
from harness import (  # noqa: E402
    RESULTS,
    TENANTS,
    Broker,
    connect_db,
    create_db,
    free_port,
    insert_rows,
    now_ms,
    stamp,
)
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy  # noqa: E402

SPREAD_MS = 3_600_000  # overdue by up to an hour
RSS_LIMIT_MIB = 200.0


def overdue_rows(
    count: int, base_ms: int, tenants: int = TENANTS
) -> Iterator[tuple[str, str, str, str, str]]:
    """``count`` timers over ``tenants`` tenants, due at random moments of the hour before
    ``base_ms``, as ``(tenant, call, correlation, due, registered)`` in the store's text."""
    registered = stamp(base_ms - SPREAD_MS - 1000)
    rng = random.Random(14)
    for i in range(count):
        yield (
            f"tenant-{i % tenants:02d}",
            f"backlog-{i:08d}",
            f"trace-backlog-{i:08d}",
            stamp(base_ms - SPREAD_MS + rng.randrange(SPREAD_MS - 1000)),
            registered,
        )


def vm_kib(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak RSS) of a process from /proc, in KiB (0 once it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


_RSS_PARTS = ("RssAnon", "RssFile", "RssShmem")


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


# -- the stores ------------------------------------------------------------------------------


class SqliteBacklog:
    """One SQLite file, one service."""

    name = "sqlite"

    def __init__(self, root: Path, instances: int) -> None:
        if instances != 1:
            raise SystemExit("SQLite serves one instance")
        self.db = root / "timer.db"
        self.instances = 1

    def preload(self, count: int, base_ms: int, tenants: int) -> None:
        create_db(self.db)
        insert_rows(self.db, overdue_rows(count, base_ms, tenants), rebuild_indexes=True)

    def env(self, index: int) -> dict[str, str]:
        return {"TIMER_DB_PATH": str(self.db)}

    def any_due(self) -> bool:
        connection = connect_db(self.db)
        try:
            row = connection.execute(
                "SELECT 1 FROM timer_schedules INDEXED BY idx_timer_schedules_scheduled_due "
                "WHERE state = 'Scheduled' AND due_at <= ? LIMIT 1",
                (stamp(now_ms()),),
            ).fetchone()
        finally:
            connection.close()
        return row is not None

    def states(self) -> dict[str, int]:
        connection = connect_db(self.db)
        try:
            return dict(
                connection.execute("SELECT state, count(*) FROM timer_schedules GROUP BY state")
            )
        finally:
            connection.close()

    def fired_by(self) -> dict[str, str] | None:
        return None  # one instance

    def close(self) -> None:
        pass


# Bench instrumentation, not the store's: the mark to Reached clears the claim's lease; this
# keeps it, so the check knows which instance fired each timer. Called only on that update
# (the WHEN clause), it copies two columns of the row being written (no index among them).
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
    """A throwaway PostgreSQL cluster (durable settings), ``instances`` services on it."""

    name = "postgres"

    def __init__(self, root: Path, instances: int) -> None:
        from tests.pg import start_cluster

        self.instances = instances
        self.pg_root = Path(tempfile.mkdtemp(prefix="timer-backlog-pg-"))
        self.pg = start_cluster(
            self.pg_root, {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
        )
        self.database = "backlog"
        self.url = self.pg.create_database(self.database)

    @property
    def conninfo(self) -> str:
        return self.pg.conninfo(self.database)

    def preload(self, count: int, base_ms: int, tenants: int) -> None:
        import psycopg

        from timer_adapters_postgres import PostgresTimerStore

        async def migrate() -> None:
            store = PostgresTimerStore(self.url, owner_id="preload", listen=False)
            await store.start()
            await store.aclose()

        asyncio.run(migrate())
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            indexes = conn.execute(
                "SELECT i.indexname, i.indexdef FROM pg_indexes i "
                "WHERE i.tablename = 'timer_schedules' AND NOT EXISTS ("
                "  SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)"
            ).fetchall()
            with conn.transaction():
                for name, _ in indexes:
                    conn.execute(f'DROP INDEX "{name}"')
                with conn.cursor().copy(
                    "COPY timer_schedules (tenant_id, service_call_id, correlation_id, due_at,"
                    " registered_at) FROM STDIN"
                ) as copy:
                    chunk = io.StringIO()
                    for n, row in enumerate(overdue_rows(count, base_ms, tenants), 1):
                        chunk.write("\t".join(row) + "\n")
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

    def _one(self, sql: str) -> Any:
        import psycopg

        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def any_due(self) -> bool:
        return bool(
            self._one(
                "SELECT 1 FROM timer_schedules WHERE state = 'Scheduled' AND due_at <= now() "
                "LIMIT 1"
            )
        )

    def states(self) -> dict[str, int]:
        return dict(self._one("SELECT state, count(*) FROM timer_schedules GROUP BY state"))

    def fired_by(self) -> dict[str, str]:
        """Which instance fired each timer (kept by the preload's trigger)."""
        return dict(self._one("SELECT service_call_id, lease_owner FROM timer_schedules"))

    def close(self) -> None:
        self.pg.stop()
        shutil.rmtree(self.pg_root, ignore_errors=True)


# -- the check -------------------------------------------------------------------------------


async def read_events(url: str, expected: int) -> list[tuple[str, str, str, str]]:
    """Every ``DueTimeReached`` of ``TIMER_EVENTS`` once, in stream order, as ``(tenantId,
    serviceCallId, dueAt, reachedAt)`` (a pull consumer without acks)."""
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=30)
    subscription = await js.pull_subscribe(
        "timer.events.>",
        stream="TIMER_EVENTS",
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=60.0
        ),
    )
    events: list[tuple[str, str, str, str]] = []
    idle_until = time.monotonic() + 30
    try:
        while len(events) < expected and time.monotonic() < idle_until:
            try:
                batch = await subscription.fetch(min(10_000, expected - len(events)), timeout=2)
            except TimeoutError:
                continue
            idle_until = time.monotonic() + 30
            for message in batch:
                p = json.loads(message.data)["payload"]
                events.append((p["tenantId"], p["serviceCallId"], p["dueAt"], p["reachedAt"]))
    finally:
        await subscription.unsubscribe()
        await nc.close()
    return events


def order_checks(
    events: list[tuple[str, str, str, str]], fired_by: dict[str, str] | None
) -> dict[str, Any]:
    """Early firings, and due order in the stream: within each tenant (reported), and within
    each tenant's timers fired by one instance (the check: one firer keeps due order; two
    firers publish their batches side by side, so their tenants' timers interleave).

    ``fired_by``: which instance fired each timer (PostgreSQL), None for one instance. The
    wire's instants are fixed-width UTC text: they sort as they compare."""
    early = tenant_inversions = instance_inversions = 0
    worst_ms = 0.0
    latest_of_tenant: dict[str, str] = {}
    latest_of_instance: dict[tuple[str, str], str] = {}
    for tenant, call, due, reached in events:
        early += reached < due
        latest = latest_of_tenant.get(tenant, "")
        if due < latest:
            tenant_inversions += 1
            worst_ms = max(worst_ms, _ms(latest) - _ms(due))
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


def _ms(text: str) -> float:
    return datetime.fromisoformat(text).timestamp() * 1000


# -- the run ---------------------------------------------------------------------------------


async def drain(
    store: SqliteBacklog | PostgresBacklog, root: Path, count: int, sample_s: float
) -> dict[str, Any]:
    from tests.timer_service.process import ServiceProcess

    async with Broker(root) as broker:
        services: list[ServiceProcess] = []
        for index in range(store.instances):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
            env.update(
                TIMER_BROKER_URL=broker.url,
                TIMER_HTTP_PORT=str(free_port()),
                TIMER_LOG_LEVEL="WARNING",
                **store.env(index),
            )
            log = root / f"service-{index}.log"
            services.append(ServiceProcess(env, root, log))
        samples: list[dict[str, Any]] = []
        try:
            started = time.perf_counter()
            for service in services:
                service.start()
            pids = [service.proc.pid for service in services if service.proc is not None]
            next_sample = 0.0
            while await asyncio.to_thread(store.any_due):
                for service in services:
                    assert service.proc is not None
                    if service.proc.poll() is not None:
                        raise RuntimeError(f"a service exited:\n{service.log()[-3000:]}")
                elapsed = time.perf_counter() - started
                if elapsed > 120 + count / 500:
                    raise RuntimeError(f"timers still due after {elapsed:.0f}s")
                if elapsed >= next_sample:
                    next_sample += sample_s
                    fired = await broker.stream_messages("TIMER_EVENTS")
                    samples.append(
                        {
                            "s": round(elapsed, 1),
                            "events": fired,
                            "rss_mib": [mib(vm_kib(pid, "VmRSS")) for pid in pids],
                            # Of which: heap and stacks; mapped files (libraries, SQLite's
                            # WAL index); shared memory.
                            "anon_file_shmem_mib": [
                                [mib(vm_kib(pid, field)) for field in _RSS_PARTS] for pid in pids
                            ],
                        }
                    )
                await asyncio.sleep(0.1)
            drain_s = time.perf_counter() - started
            peaks = [mib(vm_kib(pid, "VmHWM")) for pid in pids]
            ends = [mib(vm_kib(pid, "VmRSS")) for pid in pids]
            codes = [service.terminate(60.0) for service in services]
        finally:
            for service in services:
                service.close()
        stored = await broker.stream_messages("TIMER_EVENTS")
        events = await read_events(broker.url, count)
    checked = order_checks(events, await asyncio.to_thread(store.fired_by))
    del events
    return {
        "drain_s": round(drain_s, 2),
        "per_s": round(count / drain_s, 1),
        "peak_rss_mib": peaks,
        "rss_at_end_mib": ends,
        "exit_codes": codes,
        "stream_messages": stored,
        "rss_samples": samples,
        **checked,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--timers", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=TENANTS, help="tenants of the timers")
    parser.add_argument("--instances", type=int, help="services (SQLite 1, PostgreSQL 2)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument("--rss-limit-mib", type=float, default=RSS_LIMIT_MIB)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    instances = args.instances or (1 if args.store == "sqlite" else 2)
    root = Path(tempfile.mkdtemp(prefix="timer-backlog-"))
    store: SqliteBacklog | PostgresBacklog | None = None
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        store = (SqliteBacklog if args.store == "sqlite" else PostgresBacklog)(root, instances)
        print(f"preloading {args.timers:,} overdue timers into {store.name}", file=sys.stderr)
        began = time.perf_counter()
        store.preload(args.timers, now_ms(), args.tenants)
        preload_s = time.perf_counter() - began
        print(f"preloaded in {preload_s:.1f}s; starting {instances} service(s)", file=sys.stderr)
        result = asyncio.run(drain(store, root, args.timers, args.sample_s))
        states = store.states()
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    checks = {
        "every timer fired once": result["events"] == args.timers == result["stream_messages"]
        and result["distinct_timers"] == args.timers,
        "none early": result["early"] == 0,
        "each tenant in due order (per instance)": result[
            "out_of_due_order_within_tenant_and_instance"
        ]
        == 0,
        "store: all Reached": states == {"Reached": args.timers},
        "clean exit": all(code == 0 for code in result["exit_codes"]),
        f"peak RSS <= {args.rss_limit_mib:g} MiB": max(result["peak_rss_mib"])
        <= args.rss_limit_mib,
    }
    document = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "store": args.store,
        "instances": instances,
        "timers": args.timers,
        "tenants": args.tenants,
        "nproc": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "preload_s": round(preload_s, 1),
        "states": states,
        **result,
        "checks": checks,
    }
    output = args.output or RESULTS / f"backlog-{args.store}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    for sample in result["rss_samples"]:
        print(
            f"  {sample['s']:7.1f}s {sample['events']:>10,} events  RSS MiB {sample['rss_mib']}"
            f" (anon, file, shmem {sample['anon_file_shmem_mib']})",
            file=sys.stderr,
        )
    print(
        f"{args.store}, {instances} service(s): {args.timers:,} overdue drained in "
        f"{result['drain_s']}s ({result['per_s']:,.0f}/s); peak RSS MiB {result['peak_rss_mib']}"
        f" (at the end {result['rss_at_end_mib']}); {result['events']:,} events, "
        f"{result['distinct_timers']:,} distinct, {result['early']} early, "
        f"{result['out_of_due_order_within_tenant_and_instance']} out of due order within a "
        f"tenant and instance ({result['out_of_due_order_within_tenant']:,} within a tenant, "
        f"worst by {result['worst_inversion_ms']:,.0f} ms of due time); "
        f"load {load_start} -> {document['load_average_end']}"
    )
    for name, ok in checks.items():
        print(f"  [{'ok  ' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
