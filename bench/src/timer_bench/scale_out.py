"""Several ``timer-service`` processes sharing one PostgreSQL database and one ``nats-server``,
against hand-written raw pipelines on the same servers, in rounds (raw first, then 1, 2, 4
instances); the CPU of every part counted per timer.

Schedule path: commands wait in ``TIMER_COMMANDS`` behind a paused consumer; the clock runs
from its first delivery until every command is stored and acked. Fire path: every stored
timer moved to one due time a few seconds ahead, timed from then until every timer is
published (acked) and marked ``Reached``. ``scale-out-steady``: 1,000 timers/s due 1-2 s
ahead through ``TIMER_COMMANDS``, lateness per instance count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import psycopg

from timer_bench import kit
from timer_bench.e2e import steady_lateness
from timer_bench.kit import TENANTS, percentiles
from timer_bench.procs import (
    CONSUMER,
    DURABLE_PG,
    Broker,
    CheckFailed,
    Service,
    Usage,
    nats_server_version,
    package_versions,
    postgres,
    postgres_version,
    with_children,
)
from timer_bench.yardsticks import due_event

OWN = ("services", "postgres", "nats-server")
FAR = datetime(2100, 1, 1, tzinfo=UTC)
# The storm falls due this long after it is written: every instance's next poll (1 s) sees it.
STORM_LEAD_S = 2.5
TIME_LIMIT_S = 300.0
RAW_BATCH = 1000
STEADY_RATE = 1000


@dataclass(frozen=True)
class Measured:
    """One path of one configuration in one round; ``instances`` 0 is the raw pipeline."""

    round: int
    instances: int
    path: str
    timers: int
    seconds: float
    cores: dict[str, float]
    xacts: int

    def cpu_ms(self, group: str) -> float:
        """CPU ms per timer of ``group`` (the raw pipeline runs in the bench: its "services")."""
        if group == "services" and self.instances == 0:
            group = "bench"
        return self.cores.get(group, 0.0) * self.seconds * 1000.0 / self.timers

    @property
    def own_cpu_ms(self) -> float:
        return sum(self.cpu_ms(group) for group in OWN)


class Rig:
    """A database of the cluster, a ``nats-server`` and ``instances`` services (none: the
    raw pipelines run in this process), with CPU accounting over them."""

    def __init__(self, cluster: Any, root: Path, instances: int, settings: dict[str, Any]):
        self.cluster = cluster
        self.root = root
        self.instances = instances
        self.settings = settings
        self.database = f"bench_{instances}_{time.time_ns()}"
        self.broker = Broker(root / self.database)
        self.services: list[Service] = []
        self.started = 0.0

    @property
    def conninfo(self) -> str:
        return str(self.cluster.conninfo(self.database))

    async def __aenter__(self) -> Rig:
        url = self.cluster.create_database(self.database)
        await self.broker.__aenter__()
        if self.instances == 0:
            from timer_adapters_postgres import PostgresTimerStore

            async with PostgresTimerStore(url, owner_id="raw", listen=False):
                pass  # the service's schema
        for index in range(self.instances):
            service = Service(
                self.root,
                f"{self.database}-{index}",
                {
                    "TIMER_DATABASE_URL": url,
                    "TIMER_BROKER_URL": self.broker.url,
                    "TIMER_POLLING_INTERVAL": 1000,
                    "TIMER_BATCH_SIZE": self.settings["batch_size"],
                    "TIMER_COMMAND_BATCH_SIZE": self.settings["command_batch_size"],
                    "TIMER_INSTANCE_ID": f"bench-{index}",
                    # The schedule path holds its backlog behind the paused shared consumer.
                    "TIMER_INTAKE": "shared",
                    "TIMER_LOG_LEVEL": "WARNING",
                },
            )
            self.services.append(service.start())
        for service in self.services:
            await service.wait_healthy()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for service in self.services:
            try:
                service.stop()
            except CheckFailed:
                service.kill()
        await self.broker.__aexit__()
        self.cluster.drop_database(self.database)

    def usage(self) -> tuple[Usage, int]:
        groups = {
            "services": [s.pid for s in self.services],
            "postgres": with_children(self.cluster.pid),
            "nats-server": [self.broker.pid] if self.broker.pid else [],
            "bench": [os.getpid()],
        }
        return Usage.now(groups), self.count(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )

    def check(self) -> None:
        """Fail rather than wait forever: an instance died, or the path outlasts its limit."""
        for service in self.services:
            service.check_alive()
        if time.perf_counter() - self.started > TIME_LIMIT_S:
            raise CheckFailed(f"no result after {TIME_LIMIT_S:.0f}s")

    def count(self, sql: str) -> int:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0

    async def measured(
        self, round_: int, path: str, timers: int, before: tuple[Usage, int]
    ) -> Measured:
        after = await asyncio.to_thread(self.usage)
        return Measured(
            round_,
            self.instances,
            path,
            timers,
            after[0].wall - before[0].wall,
            before[0].cores(after[0]),
            after[1] - before[1],
        )

    async def storm(self, lead_s: float) -> datetime:
        """Every stored timer due at one instant ``lead_s`` ahead (whole milliseconds)."""
        due = datetime.now(UTC) + timedelta(seconds=lead_s)
        due = due.replace(microsecond=due.microsecond // 1000 * 1000)

        def move() -> None:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                # Near too: a timer stored far ahead is out of the due-order indexes.
                conn.execute("UPDATE timer_schedules SET due_at = %s, far_bucket = NULL", (due,))

        await asyncio.to_thread(move)
        return due


async def send_commands(rig: Rig, timers: int) -> None:
    """``timers`` ScheduleTimer commands, far in the future, over the tenants."""
    await rig.broker.send_schedules(
        [
            (
                f"tenant-{n % TENANTS}",
                f"call-{n:08d}",
                int((FAR + timedelta(milliseconds=n)).timestamp() * 1000),
            )
            for n in range(timers)
        ]
    )


async def schedule_path(rig: Rig, round_: int, timers: int) -> Measured:
    js = rig.broker.client.jetstream(timeout=10)
    await js.pause_consumer("TIMER_COMMANDS", CONSUMER, "2099-01-01T00:00:00Z")
    await send_commands(rig, timers)
    rig.started = time.perf_counter()
    await js.resume_consumer("TIMER_COMMANDS", CONSUMER)
    # The clock starts at the first delivery: nats-server does not serve the pull requests
    # already waiting on a paused consumer when it resumes (they wait out their expiry, the
    # instances' fetch timeout of 1 s), a wait no consumer in use has.
    while (await js.consumer_info("TIMER_COMMANDS", CONSUMER)).delivered.stream_seq == 0:
        rig.check()
        await asyncio.sleep(0.002)
    before = await asyncio.to_thread(rig.usage)
    while await rig.broker.command_backlog():
        rig.check()
        await asyncio.sleep(0.05)
    result = await rig.measured(round_, "schedule", timers, before)
    stored = rig.count("SELECT count(*) FROM timer_schedules")
    if stored != timers:
        raise CheckFailed(f"{stored} of {timers} commands stored")
    return result


async def fire_path(rig: Rig, round_: int, timers: int) -> Measured:
    due = await rig.storm(STORM_LEAD_S)
    await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds() - 0.02))
    usage, xacts = await asyncio.to_thread(rig.usage)
    # The clock starts at the due time itself, not when this process woke up for it.
    shift = (due - datetime.now(UTC)).total_seconds()
    before = (replace(usage, wall=usage.wall + shift), xacts)
    rig.started = time.perf_counter()
    # Watched through the stream first (counting rows every 50 ms costs PostgreSQL CPU that
    # would be charged to Timer), then the marks that follow the publishes.
    while await rig.broker.stream_messages() < timers:
        rig.check()
        await asyncio.sleep(0.05)
    reached = "SELECT count(*) FROM timer_schedules WHERE state = 'Reached'"
    while await asyncio.to_thread(rig.count, reached) < timers:
        rig.check()
        await asyncio.sleep(0.01)
    result = await rig.measured(round_, "fire", timers, before)
    if (events := await rig.broker.stream_messages()) != timers:
        raise CheckFailed(f"{events} events for {timers} timers")
    return result


# -- the raw pipelines: the same work by hand on the same servers ----------------------------

_RAW_UPSERT = """
INSERT INTO timer_schedules AS s (tenant_id, service_call_id, correlation_id, due_at,
    registered_at)
SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]::timestamptz[],
    %s::text[]::timestamptz[])
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    due_at = excluded.due_at, correlation_id = excluded.correlation_id,
    registered_at = excluded.registered_at, lease_owner = NULL, lease_until = NULL
WHERE s.state = 'Scheduled'
"""
_RAW_CLAIM = """
UPDATE timer_schedules
SET lease_owner = 'raw', lease_until = now() + interval '30 seconds',
    lease_token = lease_token + 1
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM timer_schedules
    WHERE state = 'Scheduled' AND due_at <= now()
      AND (lease_until IS NULL OR lease_until < now())
    ORDER BY due_at, tenant_id, service_call_id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
))
RETURNING tenant_id, service_call_id, correlation_id, due_at, lease_token
"""
# Each key looked up in the primary key (the locking LATERAL keeps the planner from turning
# it into a join): as "FROM unnest(...) WHERE s.key = v.key", a storm the statistics had
# not seen got a nested loop re-reading the 1,000 keys for every Scheduled row.
_RAW_MARK = """
UPDATE timer_schedules
SET state = 'Reached', reached_at = now(), lease_owner = NULL, lease_until = NULL
WHERE ctid = ANY(ARRAY(
    SELECT m.ctid
    FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS v(tenant_id, service_call_id, token)
    CROSS JOIN LATERAL (
        SELECT s.ctid FROM timer_schedules AS s
        WHERE s.tenant_id = v.tenant_id AND s.service_call_id = v.service_call_id
          AND s.state = 'Scheduled' AND s.lease_owner = 'raw' AND s.lease_token = v.token
        FOR UPDATE
    ) AS m
))
"""


async def raw_schedule_path(rig: Rig, round_: int, timers: int) -> Measured:
    """Pull fetch 1,000 -> ``json.loads`` -> one ``unnest`` upsert (autocommit) -> ack each."""
    await send_commands(rig, timers)
    js = rig.broker.client.jetstream(timeout=10)
    subscription = await js.pull_subscribe_bind(CONSUMER, "TIMER_COMMANDS")
    async with await psycopg.AsyncConnection.connect(rig.conninfo, autocommit=True) as conn:
        rig.started = time.perf_counter()
        before = await asyncio.to_thread(rig.usage)
        stored = 0
        while stored < timers:
            rig.check()
            try:
                messages = await subscription.fetch(RAW_BATCH, timeout=1)
            except TimeoutError:
                continue
            registered = datetime.now(UTC).isoformat()
            columns: tuple[list[str | None], ...] = ([], [], [], [], [])
            for message in messages:
                body = json.loads(message.data)
                payload = body["payload"]
                row = (payload["tenantId"], payload["serviceCallId"], body.get("correlationId"))
                for column, value in zip(
                    columns, (*row, payload["dueAt"], registered), strict=True
                ):
                    column.append(value)
            await conn.execute(_RAW_UPSERT, columns)
            for message in messages:
                await message.ack()
            stored += len(messages)
        await rig.broker.client.flush()
        result = await rig.measured(round_, "schedule", timers, before)
    await subscription.unsubscribe()
    return result


async def raw_fire_path(rig: Rig, round_: int, timers: int) -> Measured:
    """Claim 1,000 (``FOR UPDATE SKIP LOCKED``) -> ``publish_async`` each -> fenced mark."""
    due = await rig.storm(1.0)
    nc = await nats.connect(rig.broker.url)
    js = nc.jetstream(timeout=10)
    try:
        async with await psycopg.AsyncConnection.connect(rig.conninfo, autocommit=True) as conn:
            await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()))
            rig.started = time.perf_counter()
            before = await asyncio.to_thread(rig.usage)
            fired = 0
            while fired < timers:
                rig.check()
                rows = await (await conn.execute(_RAW_CLAIM, (RAW_BATCH,))).fetchall()
                if not rows:
                    await asyncio.sleep(0.01)
                    continue
                rows.sort(key=lambda row: (row[3], row[0], row[1]))
                now = datetime.now(UTC).isoformat()
                acks = []
                for tenant, call, correlation, due_at, _ in rows:
                    subject, body, headers = due_event(
                        tenant, call, correlation, due_at.isoformat(), now
                    )
                    acks.append(await js.publish_async(subject, body, headers=headers))
                await asyncio.gather(*acks)
                keys = ([r[0] for r in rows], [r[1] for r in rows], [r[4] for r in rows])
                await conn.execute(_RAW_MARK, keys)
                fired += len(rows)
            result = await rig.measured(round_, "fire", timers, before)
    finally:
        await nc.close()
    reached = rig.count("SELECT count(*) FROM timer_schedules WHERE state = 'Reached'")
    if reached != timers or await rig.broker.stream_messages() != timers:
        raise CheckFailed(f"raw: {reached} Reached of {timers}")
    return result


# -- the runs --------------------------------------------------------------------------------


async def rounds(
    cluster: Any, root: Path, args: argparse.Namespace, settings: dict[str, Any]
) -> list[Measured]:
    """Every configuration once per round, the raw pipelines first in each."""

    async def measure(side: str, round_: int) -> list[Measured]:
        instances = int(side)
        async with Rig(cluster, root, instances, settings) as rig:
            paths = (
                (raw_schedule_path, raw_fire_path) if instances == 0 else (schedule_path, fire_path)
            )
            out = [await path(rig, round_, settings["timers"]) for path in paths]
        for one in out:
            cores = " ".join(f"{g}={c:.2f}" for g, c in one.cores.items())
            kit.progress(
                f"round {round_} instances {instances} {one.path}: "
                f"{one.timers / one.seconds:,.0f}/s (cores {cores})"
            )
        return out

    sides = ["0", *(str(n) for n in settings["instances"])]
    taken = await kit.alternated(args.rounds, sides, measure, rotate=False)
    return [run for one in taken for runs in one.values() for run in runs]


def summary(runs: list[Measured], counts: list[int]) -> dict[str, Any]:
    """Rates of each configuration; one instance against the raw pipelines and N instances'
    CPU per timer against one, each as the median of per-round ratios; CPU per part."""

    def of(n: int, path: str) -> list[Measured]:
        return sorted(
            (r for r in runs if r.instances == n and r.path == path), key=lambda r: r.round
        )

    out: dict[str, Any] = {"rates": {}, "vs_raw": {}, "cpu_vs_one": {}, "cpu_ms": {}}
    for n in [0, *counts]:
        key = "raw" if n == 0 else str(n)
        out["rates"][key] = {
            p: [round(r.timers / r.seconds, 1) for r in of(n, p)] for p in ("schedule", "fire")
        }
        out["cpu_ms"][key] = {
            p: {
                **{g: round(kit.median(r.cpu_ms(g) for r in of(n, p)), 3) for g in OWN},
                "other_cores": round(kit.median(r.cores["other"] for r in of(n, p)), 2),
                "commits_per_timer": round(kit.median(r.xacts / r.timers for r in of(n, p)), 3),
            }
            for p in ("schedule", "fire")
        }
    for p in ("schedule", "fire"):
        one, raw = of(1, p), of(0, p)
        rates = [r.timers / r.seconds for r in one]
        out["vs_raw"][p] = {"rounds": kit.ratios(rates, [r.timers / r.seconds for r in raw])}
        out["vs_raw"][p]["median"] = kit.median_ratio(rates, [r.timers / r.seconds for r in raw])
        for n in counts:
            if n > 1:
                many = [r.own_cpu_ms for r in of(n, p)]
                single = [r.own_cpu_ms for r in one]
                out["cpu_vs_one"].setdefault(str(n), {})[p] = {
                    "median": kit.median_ratio(many, single),
                    "rounds": kit.ratios(many, single),
                }
    return out


async def steady(
    cluster: Any, root: Path, settings: dict[str, Any], seconds: float
) -> dict[str, Any]:
    out = {}
    for instances in settings["instances"]:
        async with Rig(cluster, root, instances, settings) as rig:
            before, _ = await asyncio.to_thread(rig.usage)
            rig.started = time.perf_counter()
            sent, reached, readable, early = await steady_lateness(
                rig.broker, STEADY_RATE, seconds, rig.check
            )
            after, _ = await asyncio.to_thread(rig.usage)
        if len(readable) != sent or early:
            raise CheckFailed(f"steady: {len(readable):,} of {sent:,} events read, {early} early")
        out[str(instances)] = {
            "timers": sent,
            "reached_lateness": percentiles(list(reached.values())),
            "readable_lateness": percentiles(list(readable.values())),
            "cores": {g: round(c, 2) for g, c in before.cores(after).items() if g != "bench"},
        }
        kit.progress(f"steady, {instances} instance(s): {out[str(instances)]}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3,000 timers, one round")
    parser.add_argument("--timers", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instances", default="1,2,4", help="comma-separated instance counts")
    parser.add_argument("--batch-size", type=int, default=100, help="TIMER_BATCH_SIZE")
    parser.add_argument("--command-batch-size", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0, help="scale-out-steady: duration")
    parser.add_argument("--fast-pg", action="store_true", help="fsync off (as in the tests)")


def main(args: argparse.Namespace) -> int:
    import tempfile

    counts = [int(n) for n in args.instances.split(",")]
    settings: dict[str, Any] = {
        "timers": 3_000 if args.quick else args.timers,
        "rounds": 1 if args.quick else args.rounds,
        "instances": counts,
        "batch_size": args.batch_size,
        "command_batch_size": args.command_batch_size,
        "raw_batch": RAW_BATCH,
        "polling_interval_ms": 1000,
        "postgres": {} if args.fast_pg else DURABLE_PG,
    }
    args.rounds = settings["rounds"]
    machine = kit.machine(
        postgres=postgres_version(),
        nats_server=nats_server_version(),
        packages=package_versions("psycopg", "nats-py"),
    )
    root = Path(tempfile.mkdtemp(prefix="timer-scale-"))
    with postgres(None if args.fast_pg else DURABLE_PG) as cluster:
        if args.scenario == "scale-out-steady":
            seconds = 4.0 if args.quick else args.seconds
            settings |= {"rate_per_s": STEADY_RATE, "seconds": seconds}
            document: dict[str, Any] = {
                "date": kit.today(),
                "machine": machine,
                "settings": settings,
            }
            document["instances"] = asyncio.run(steady(cluster, root, settings, seconds))
        else:
            runs = asyncio.run(rounds(cluster, root, args, settings))
            document = {
                "date": kit.today(),
                "machine": machine,
                "settings": settings,
                "summary": summary(runs, counts),
                "runs": [asdict(run) for run in runs],
            }
    kit.write_result(document, args.output)
    from timer_bench import render

    print(
        render.scale_out_steady_block(document)
        if "instances" in document
        else render.scale_out_block(document)
    )
    return 0
