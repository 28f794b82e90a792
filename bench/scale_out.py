"""Scale-out benchmark: schedule-path and fire-path throughput of 1, 2 and 4 ``timer-service``
processes sharing one PostgreSQL database and one ``nats-server``, with the CPU each part used.

Schedule path: ``ScheduleTimer`` commands wait in ``TIMER_COMMANDS`` behind a paused consumer;
the consumer is resumed and the clock runs until every command is stored and acked (the
instances share the durable consumer). Fire path: every stored timer is moved to one due time
a few seconds ahead (a storm), and the clock runs from that due time until every timer was
published to ``TIMER_EVENTS`` and marked ``Reached``. Both run on real processes: PostgreSQL
(durable settings unless ``--fast-pg``), ``nats-server`` (file storage) and the service.

The measured part of the "Scale-out on PostgreSQL (bench/scale_out.py)" section of
bench/README.md is rewritten between its markers; the prose around them is kept.

    uv run --all-packages python bench/scale_out.py            # 3 rounds of 20,000 timers
    uv run --all-packages python bench/scale_out.py --quick    # small, README untouched
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path

# The repository goes on the import path for the tests' own helpers (the throwaway
# PostgreSQL cluster and the service subprocess).
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))

import attrs  # noqa: E402
import nats  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402
from nats.aio.client import Client  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402
from nats.js.api import DeliverPolicy  # noqa: E402

from tests.pg import PostgresCluster, postgres_bin_dir, start_cluster  # noqa: E402
from tests.timer_service.process import ServiceProcess, free_port  # noqa: E402
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient  # noqa: E402
from timer_adapters_nats.embedded import NatsServerProcess, find_nats_server  # noqa: E402

README = Path(__file__).with_name("README.md")
SECTION = "## Scale-out on PostgreSQL (bench/scale_out.py)"
BEGIN, END = "<!-- scale_out:begin -->", "<!-- scale_out:end -->"
PROFILE_BEGIN, PROFILE_END = "<!-- scale_out:profile:begin -->", "<!-- scale_out:profile:end -->"
STEADY_BEGIN, STEADY_END = "<!-- scale_out:steady:begin -->", "<!-- scale_out:steady:end -->"
#: Timers scheduled a second in the steady scenario (``--steady``), as in bench/run.py.
STEADY_RATE = 1000
CONSUMER = "timer-service"
TENANTS = 50
FAR = datetime(2100, 1, 1, tzinfo=UTC)
# The storm falls due this long after it is written: long enough for every instance's
# next poll (1 s) to see it and go to sleep until it.
STORM_LEAD_S = 2.5
DURABLE_PG = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
GROUPS = ("services", "postgres", "nats-server", "bench", "other")
OWN = ("services", "postgres", "nats-server")
DB_SCHEDULER = "10,600-11,840"
TIME_LIMIT_S = 300.0
#: TIMER_COMMAND_BATCH_SIZE of the instances (``--command-batch-size``; the service's default).
COMMAND_BATCH = 1000


# Where a profiled sample's time went: the leaf-most frame of a known kind names it.
PROFILE_KINDS = (
    ("psycopg (driver, libpq calls)", ("psycopg/", "psycopg_c/", "psycopg_binary/")),
    ("SQLAlchemy", ("sqlalchemy/",)),
    ("nats-py", ("nats/",)),
    (
        "encoding (json, wire format, ids)",
        ("json/", "cattrs/", "timer_core/codec", "timer_core/_shortcuts", "uuid", "_ids.py"),
    ),
    ("asyncio (loop, transports)", ("asyncio/", "selectors.py")),
    ("thread pool hand-off", ("concurrent/futures/", "threading.py", "queue.py")),
    ("Timer's own code", ("timer_core/", "timer_adapters_", "timer_service/")),
    ("prometheus_client", ("prometheus_client/",)),
)


class Profiler:
    """py-spy sampling one service process (threads holding the GIL: its Python CPU time)."""

    def __init__(self, pid: int, output: Path) -> None:
        executable = shutil.which("py-spy")
        if executable is None:
            raise SystemExit("--profile needs py-spy on PATH (uv tool install py-spy)")
        self.output = output
        self.process = subprocess.Popen(
            [
                executable,
                "record",
                *("--pid", str(pid), "--rate", "250", "--gil", "--nonblocking"),
                *("--format", "raw", "--output", str(output)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> dict[str, float]:
        """Stop sampling; the share of samples per kind of code."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(30)
        samples: dict[str, int] = {}
        leaves: dict[str, int] = {}
        for line in self.output.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            kind = next(
                (
                    name
                    for frame in reversed(frames)
                    for name, marks in PROFILE_KINDS
                    if any(mark in frame for mark in marks)
                ),
                "other",
            )
            samples[kind] = samples.get(kind, 0) + int(count)
            leaf = frames[-1]
            leaves[leaf] = leaves.get(leaf, 0) + int(count)
        total = sum(samples.values()) or 1
        top = sorted(leaves.items(), key=lambda item: -item[1])[:15]
        print(f"profile {self.output.name}: hottest leaf frames", file=sys.stderr)
        for leaf, count in top:
            print(f"  {count / total:6.1%} {leaf}", file=sys.stderr)
        return {kind: count / total for kind, count in samples.items()}


@attrs.frozen
class Usage:
    """CPU seconds per group of processes, and the machine's busy seconds, at one moment."""

    wall: float
    cpu: dict[str, float]
    busy: float
    xacts: int

    def cores(self, later: Usage) -> dict[str, float]:
        """Cores each group kept busy between this moment and ``later`` ("other": the rest of
        the machine, e.g. other work sharing it)."""
        wall = later.wall - self.wall
        used = {group: (later.cpu[group] - self.cpu[group]) / wall for group in self.cpu}
        used["other"] = max(0.0, (later.busy - self.busy) / wall - sum(used.values()))
        return used


@attrs.frozen
class Run:
    """One measured path of one configuration."""

    instances: int
    path: str
    timers: int
    seconds: float
    cores: dict[str, float]
    xacts: int
    profile: dict[str, float] | None = None

    @property
    def rate(self) -> float:
        return self.timers / self.seconds

    def cpu_ms(self, group: str) -> float:
        """CPU milliseconds ``group`` spent per timer (a yardstick's pipeline, run in the bench
        process, counts as its "services")."""
        if group == "services" and self.instances == 0:
            group = "bench"
        return self.cores[group] * self.seconds * 1000.0 / self.timers

    @property
    def own_cpu_ms(self) -> float:
        """CPU milliseconds per timer of everything Timer needs (not the rest of the machine)."""
        return sum(self.cpu_ms(group) for group in OWN)


class Rig:
    """PostgreSQL, a nats-server and N service processes, with CPU accounting over them."""

    def __init__(
        self, pg: PostgresCluster, root: Path, instances: int, batch: int, profile: bool
    ) -> None:
        self.pg = pg
        self.profile = profile
        self.root = root
        self.instances = instances
        self.batch = batch
        self.database = f"bench_{instances}_{int(time.time() * 1000)}"
        self.nats = NatsServerProcess(root / f"nats-{self.database}", host="127.0.0.1")
        self.services: list[ServiceProcess] = []

    @property
    def conninfo(self) -> str:
        return self.pg.conninfo(self.database)

    def start(self) -> None:
        url = self.pg.create_database(self.database)
        self.nats.start()
        for index in range(self.instances):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
            env.update(
                TIMER_DATABASE_URL=url,
                TIMER_BROKER_URL=self.nats.url,
                TIMER_HTTP_PORT=str(free_port()),
                TIMER_POLLING_INTERVAL="1000",
                TIMER_BATCH_SIZE=str(self.batch),
                TIMER_COMMAND_BATCH_SIZE=str(COMMAND_BATCH),
                TIMER_INSTANCE_ID=f"bench-{index}",
                TIMER_LOG_LEVEL="WARNING",
            )
            log = self.root / f"service-{self.database}-{index}.log"
            self.services.append(ServiceProcess(env, self.root, log).start())
        for service in self.services:
            service.wait_healthy(60.0)

    def stop(self) -> None:
        for service in self.services:
            try:
                service.terminate(30.0)
            except Exception:  # a hung instance must not keep the others running
                service.kill_group()
        self.nats.stop()
        self.pg.drop_database(self.database)

    def usage(self) -> Usage:
        def seconds(processes: Iterator[psutil.Process]) -> float:
            total = 0.0
            for process in processes:
                try:
                    times = process.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                total += times.user + times.system
            return total

        def pids(*pids: int | None) -> Iterator[psutil.Process]:
            return (psutil.Process(pid) for pid in pids if pid is not None)

        postmaster = psutil.Process(self.pg.pid)
        machine = psutil.cpu_times()
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
        return Usage(
            wall=time.perf_counter(),
            cpu={
                "services": seconds(pids(*(s.proc.pid for s in self.services if s.proc))),
                "postgres": seconds(iter([postmaster, *postmaster.children(recursive=True)])),
                "nats-server": seconds(pids(self.nats.pid)),
                "bench": seconds(pids(os.getpid())),
            },
            busy=machine.user + machine.system + machine.nice + machine.irq + machine.softirq,
            xacts=int(row[0]) if row else 0,
        )

    def profiler(self, path: str) -> Profiler | None:
        """py-spy on the first instance, when profiling."""
        first = self.services[0].proc
        if not self.profile or first is None:
            return None
        return Profiler(first.pid, self.root / f"profile-{self.database}-{path}.txt")

    def check(self, started: float) -> None:
        """Fail rather than wait forever: an instance died, or the path outlasts its limit."""
        for service in self.services:
            if service.proc is not None and service.proc.poll() is not None:
                raise RuntimeError(f"an instance exited:\n{service.log()[-3000:]}")
        if time.perf_counter() - started > TIME_LIMIT_S:
            tail = self.services[0].log()[-3000:]
            raise RuntimeError(f"no result after {TIME_LIMIT_S:.0f}s; first log:\n{tail}")

    def count(self, sql: str) -> int:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0


async def send_schedule_commands(nc: Client, timers: int) -> None:
    """Publish ``timers`` ScheduleTimer commands, far in the future, spread over the tenants."""
    client = TimerClient(nc, publish_window=1024)
    envelopes = [
        client.schedule_envelope(
            f"tenant-{n % TENANTS}", f"call-{n:08d}", FAR + timedelta(milliseconds=n)
        )
        for n in range(timers)
    ]
    for start in range(0, timers, 5000):
        results = await client.send_many(envelopes[start : start + 5000])
        assert not any(results), "publishing the commands failed"


async def schedule_path(rig: Rig, timers: int) -> Run:
    """Commands queued behind a paused consumer, then resumed: time until all are stored."""
    nc = await nats.connect(rig.nats.url)
    try:
        js = nc.jetstream(timeout=10)
        await js.pause_consumer("TIMER_COMMANDS", CONSUMER, "2099-01-01T00:00:00Z")
        await send_schedule_commands(nc, timers)
        profiler = rig.profiler("schedule")
        before = await asyncio.to_thread(rig.usage)
        await js.resume_consumer("TIMER_COMMANDS", CONSUMER)
        # The clock starts at the first delivery: nats-server does not serve the pull
        # requests already waiting on a paused consumer when it resumes (they wait out their
        # expiry, up to the instances' fetch timeout of 1 s), a wait no consumer has in use.
        while (await js.consumer_info("TIMER_COMMANDS", CONSUMER)).delivered.stream_seq == 0:
            rig.check(before.wall)
            await asyncio.sleep(0.002)
        before = attrs.evolve(before, wall=time.perf_counter())
        while True:
            info = await js.consumer_info("TIMER_COMMANDS", CONSUMER)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            rig.check(before.wall)
            await asyncio.sleep(0.05)
        after = await asyncio.to_thread(rig.usage)
        profile = None if profiler is None else profiler.stop()
    finally:
        await nc.close()
    stored = await asyncio.to_thread(rig.count, "SELECT count(*) FROM timer_schedules")
    assert stored == timers, f"{stored} of {timers} commands stored"
    return Run(
        rig.instances,
        "schedule",
        timers,
        after.wall - before.wall,
        before.cores(after),
        after.xacts - before.xacts,
        profile,
    )


async def fire_path(rig: Rig, timers: int) -> Run:
    """Every stored timer moved to one due time: time from it until all are published and
    marked ``Reached``."""
    due = datetime.now(UTC) + timedelta(seconds=STORM_LEAD_S)
    due = due.replace(microsecond=due.microsecond // 1000 * 1000)

    def storm() -> None:
        with psycopg.connect(rig.conninfo, autocommit=True) as conn:
            conn.execute("UPDATE timer_schedules SET due_at = %s", (due,))

    await asyncio.to_thread(storm)
    profiler = rig.profiler("fire")
    await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds() - 0.02))
    before = await asyncio.to_thread(rig.usage)
    # The clock starts at the due time itself, not when this process woke up for it.
    before = attrs.evolve(before, wall=before.wall + (due - datetime.now(UTC)).total_seconds())
    # Watched through the stream first (a count(*) every 50 ms cost PostgreSQL ~5 us of CPU
    # per fired timer, charged to Timer), then the marks that follow the publishes.
    reached = "SELECT count(*) FROM timer_schedules WHERE state = 'Reached'"
    nc = await nats.connect(rig.nats.url)
    try:
        js = nc.jetstream()
        while (await js.stream_info("TIMER_EVENTS")).state.messages < timers:
            rig.check(before.wall)
            await asyncio.sleep(0.05)
        while await asyncio.to_thread(rig.count, reached) < timers:
            rig.check(before.wall)
            await asyncio.sleep(0.01)
        after = await asyncio.to_thread(rig.usage)
        profile = None if profiler is None else profiler.stop()
        info = await js.stream_info("TIMER_EVENTS")
    finally:
        await nc.close()
    assert info.state.messages == timers, f"{info.state.messages} events for {timers} timers"
    return Run(
        rig.instances,
        "fire",
        timers,
        after.wall - before.wall,
        before.cores(after),
        after.xacts - before.xacts,
        profile,
    )


@attrs.frozen
class Steady:
    """Lateness of timers scheduled at a steady rate, each due 1-2 s after it was sent."""

    instances: int
    rate: int
    seconds: float
    timers: int
    reached_ms: list[float]  # reachedAt - dueAt, from each event, sorted
    readable_ms: list[float]  # when this process read the event - dueAt, sorted
    cores: dict[str, float]

    def quantile(self, values: list[float], q: float) -> float:
        """Nearest rank, as bench/run.py's steady scenario."""
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    def line(self) -> str:
        def of(values: list[float]) -> str:
            p50, p99 = self.quantile(values, 0.5), self.quantile(values, 0.99)
            return f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {values[-1]:.1f} ms"

        cores = ", ".join(f"{group} {self.cores[group]:.2f}" for group in (*OWN, "other"))
        return (
            f"{self.instances} instance{'s' if self.instances > 1 else ''}, "
            f"{self.rate:,}/s for {self.seconds:.0f} s ({self.timers:,} timers): "
            f"reachedAt - dueAt {of(self.reached_ms)}; read by a subscriber "
            f"{of(self.readable_ms)}; cores {cores}"
        )


async def steady_path(rig: Rig, rate: int, seconds: float) -> Steady:
    """``rate`` ScheduleTimer commands a second, in ticks of 10 ms, each due 1-2 s after it
    is sent (at a random millisecond), through TIMER_COMMANDS; every event read back from
    TIMER_EVENTS: none early, none missing, and its lateness."""
    per_tick, tick = max(1, rate // 100), 0.01
    reached: dict[str, float] = {}
    readable: dict[str, float] = {}
    early = 0
    nc = await nats.connect(rig.nats.url)
    try:

        async def on_event(message: Msg) -> None:
            nonlocal early
            seen = time.time() * 1000.0
            payload = json.loads(message.data)["payload"]
            due = datetime.fromisoformat(payload["dueAt"]).timestamp() * 1000.0
            at = datetime.fromisoformat(payload["reachedAt"]).timestamp() * 1000.0
            reached[payload["serviceCallId"]] = at - due
            readable[payload["serviceCallId"]] = seen - due
            early += at < due

        js = nc.jetstream(timeout=10)
        subscription = await js.subscribe(
            "timer.events.>",
            stream="TIMER_EVENTS",
            cb=on_event,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )
        client = TimerClient(nc, publish_window=512)
        loop = asyncio.get_running_loop()
        sent = 0
        before = await asyncio.to_thread(rig.usage)
        started = loop.time()
        for n in range(int(seconds / tick)):
            await asyncio.sleep(max(0.0, started + n * tick - loop.time()))
            base = datetime.now(UTC)
            envelopes = [
                client.schedule_envelope(
                    f"tenant-{(sent + i) % TENANTS}",
                    f"steady-{sent + i:08d}",
                    base + timedelta(milliseconds=1000 + random.randrange(1000)),
                )
                for i in range(per_tick)
            ]
            assert not any(await client.send_many(envelopes)), "a command was not acked"
            sent += per_tick
        deadline = time.monotonic() + 30
        while len(readable) < sent and time.monotonic() < deadline:
            rig.check(time.perf_counter())
            await asyncio.sleep(0.05)
        after = await asyncio.to_thread(rig.usage)
        await subscription.unsubscribe()
    finally:
        await nc.close()
    assert len(readable) == sent and early == 0, (
        f"steady: {len(readable):,} of {sent:,} events read, {early} early"
    )
    return Steady(
        rig.instances,
        rate,
        seconds,
        sent,
        sorted(reached.values()),
        sorted(readable.values()),
        before.cores(after),
    )


def steady(pg: PostgresCluster, root: Path, counts: list[int], batch: int, seconds: float) -> str:
    """The steady scenario once per instance count; one line each."""
    lines = []
    for instances in counts:
        rig = Rig(pg, root, instances, batch, False)
        try:
            rig.start()
            result = asyncio.run(steady_path(rig, STEADY_RATE, seconds))
        finally:
            rig.stop()
        print(f"steady: {result.line()}", file=sys.stderr)
        lines.append(f"- {result.line()}")
    return "\n".join(lines)


# -- the yardsticks: hand-written pipelines on the same PostgreSQL and nats-server ----------

#: The raw pipelines' batch: 1,000 commands a fetch and upsert, 1,000 timers a claim and mark.
RAW_BATCH = 1000
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
# it into a join): written as "FROM unnest(...) WHERE s.key = v.key", a storm the statistics
# have not seen got a nested loop re-reading the 1,000 keys for every Scheduled row (160 ms a
# mark at 20,000 due, O(backlog) per batch), which made this yardstick slower than Timer.
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


class RawRig(Rig):
    """PostgreSQL (the service's schema) and a nats-server (its streams and consumer), no
    service: the yardsticks run in this process."""

    def __init__(self, pg: PostgresCluster, root: Path) -> None:
        super().__init__(pg, root, 0, RAW_BATCH, False)
        self.database = f"raw_{int(time.time() * 1000)}"
        self.nats = NatsServerProcess(root / f"nats-{self.database}", host="127.0.0.1")

    def start(self) -> None:
        from timer_adapters_postgres import PostgresTimerStore

        url = self.pg.create_database(self.database)
        self.nats.start()

        async def provision() -> None:
            store = PostgresTimerStore(url, owner_id="raw", listen=False)
            await store.start()
            await store.aclose()
            broker = NatsBroker(NatsSettings(url=self.nats.url))
            await broker.start()
            await broker.aclose()

        asyncio.run(provision())


async def raw_schedule_path(rig: RawRig, timers: int) -> Run:
    """The same commands as :func:`schedule_path`, then pull fetch -> one ``unnest`` upsert
    per batch (its own transaction) -> ack, until all are stored."""
    nc = await nats.connect(rig.nats.url)
    try:
        js = nc.jetstream(timeout=10)
        await send_schedule_commands(nc, timers)
        subscription = await js.pull_subscribe_bind(CONSUMER, "TIMER_COMMANDS")
        conn = await psycopg.AsyncConnection.connect(rig.conninfo, autocommit=True)
        before = await asyncio.to_thread(rig.usage)
        stored = 0
        while stored < timers:
            rig.check(before.wall)
            try:
                messages = await subscription.fetch(RAW_BATCH, timeout=1)
            except TimeoutError:
                continue
            registered = datetime.now(UTC).isoformat()
            columns: tuple[list[str | None], ...] = ([], [], [], [], [])
            for message in messages:
                body = json.loads(message.data)
                payload = body["payload"]
                columns[0].append(payload["tenantId"])
                columns[1].append(payload["serviceCallId"])
                columns[2].append(body.get("correlationId"))
                columns[3].append(payload["dueAt"])
                columns[4].append(registered)
            await conn.execute(_RAW_UPSERT, columns)
            for message in messages:
                await message.ack()
            stored += len(messages)
        await nc.flush()
        after = await asyncio.to_thread(rig.usage)
        await conn.close()
    finally:
        await nc.close()
    count = await asyncio.to_thread(rig.count, "SELECT count(*) FROM timer_schedules")
    assert count == timers, f"raw: {count} of {timers} commands stored"
    return Run(
        0,
        "schedule",
        timers,
        after.wall - before.wall,
        before.cores(after),
        after.xacts - before.xacts,
    )


async def raw_fire_path(rig: RawRig, timers: int) -> Run:
    """The same storm as :func:`fire_path`, fired by claim (``FOR UPDATE SKIP LOCKED``,
    1,000 a time) -> ``publish_async`` with ``Nats-Msg-Id`` -> fenced mark, batch by batch."""
    due = datetime.now(UTC) + timedelta(seconds=1.0)

    def storm() -> None:
        with psycopg.connect(rig.conninfo, autocommit=True) as conn:
            conn.execute("UPDATE timer_schedules SET due_at = %s", (due,))

    await asyncio.to_thread(storm)
    nc = await nats.connect(rig.nats.url)
    conn = await psycopg.AsyncConnection.connect(rig.conninfo, autocommit=True)
    try:
        js = nc.jetstream(timeout=10)
        await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()))
        before = await asyncio.to_thread(rig.usage)
        fired = 0
        while fired < timers:
            rig.check(before.wall)
            rows = await (await conn.execute(_RAW_CLAIM, (RAW_BATCH,))).fetchall()
            if not rows:
                await asyncio.sleep(0.01)
                continue
            rows.sort(key=lambda row: (row[3], row[0], row[1]))
            now = datetime.now(UTC).isoformat()
            acks = []
            for tenant, call, correlation, due_at, _ in rows:
                firing = f"{tenant}.{call}.{due_at.isoformat()}"
                body = {
                    "id": firing,
                    "type": "DueTimeReached",
                    "tenantId": tenant,
                    "aggregateId": call,
                    "correlationId": correlation,
                    "payload": {
                        "_tag": "DueTimeReached",
                        "tenantId": tenant,
                        "serviceCallId": call,
                        "dueAt": due_at.isoformat(),
                        "reachedAt": now,
                    },
                }
                acks.append(
                    await js.publish_async(
                        f"timer.events.{tenant}.{call}",
                        json.dumps(body, separators=(",", ":")).encode(),
                        headers={"Nats-Msg-Id": firing},
                    )
                )
            await asyncio.gather(*acks)
            await conn.execute(
                _RAW_MARK,
                ([r[0] for r in rows], [r[1] for r in rows], [r[4] for r in rows]),
            )
            fired += len(rows)
        after = await asyncio.to_thread(rig.usage)
        info = await js.stream_info("TIMER_EVENTS")
    finally:
        await conn.close()
        await nc.close()
    reached = await asyncio.to_thread(
        rig.count, "SELECT count(*) FROM timer_schedules WHERE state = 'Reached'"
    )
    assert reached == timers == info.state.messages, (
        f"raw: {reached} Reached, {info.state.messages} events of {timers}"
    )
    return Run(
        0, "fire", timers, after.wall - before.wall, before.cores(after), after.xacts - before.xacts
    )


def measure(
    pg: PostgresCluster,
    root: Path,
    counts: list[int],
    timers: int,
    rounds: int,
    batch: int,
    profile: bool = False,
) -> list[Run]:
    """Every configuration once per round, rounds interleaved (the machine's load drifts)."""
    runs: list[Run] = []
    for round_ in range(1, rounds + 1):
        # The yardsticks first in every round (instances 0), then each configuration.
        for instances in [0, *counts] if not profile else counts:
            rig = RawRig(pg, root) if instances == 0 else Rig(pg, root, instances, batch, profile)
            paths = (
                (raw_schedule_path, raw_fire_path) if instances == 0 else (schedule_path, fire_path)
            )
            try:
                rig.start()
                for run in (asyncio.run(paths[0](rig, timers)), asyncio.run(paths[1](rig, timers))):
                    runs.append(run)
                    cores = " ".join(f"{g}={c:.2f}" for g, c in run.cores.items())
                    print(
                        f"round {round_} instances {instances} {run.path}: {run.rate:,.0f}/s "
                        f"({run.seconds:.2f}s, {run.xacts / run.timers:.3f} xact/timer; "
                        f"cores {cores})",
                        file=sys.stderr,
                    )
            finally:
                rig.stop()
    return runs


def machine(durable: bool) -> str:
    """nproc, CPU model, versions and the load at start."""
    model = platform.processor() or "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    pg = subprocess.run(
        [str(postgres_bin_dir() / "postgres"), "--version"], capture_output=True, text=True
    ).stdout.strip()
    server = subprocess.run(
        [str(find_nats_server()), "--version"], capture_output=True, text=True
    ).stdout.strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    settings = "fsync and synchronous_commit on" if durable else "fsync and synchronous_commit off"
    return (
        f"nproc {os.cpu_count()}, {model}, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
        f"Python {platform.python_version()}, {pg} ({settings}), {server}, "
        f"psycopg {version('psycopg')}, nats-py {version('nats-py')}; "
        f"load average at start {load}"
    )


def _rate(runs: list[Run]) -> str:
    rates = sorted(run.rate for run in runs)
    middle = statistics.median(rates)
    if len(rates) == 1:
        return f"{middle:,.0f}"
    return f"{middle:,.0f} ({rates[0]:,.0f}-{rates[-1]:,.0f})"


def ratios(runs: list[Run], counts: list[int]) -> str:
    """The headline: one instance against the yardsticks round by round (each pair ran back
    to back), and the total CPU per timer of N instances against one."""

    def of(n: int, path: str) -> list[Run]:
        return [r for r in runs if r.instances == n and r.path == path]

    out = []
    for path in ("schedule", "fire"):
        pairs = list(zip(of(1, path), of(0, path), strict=False))
        if pairs:
            each = [round(timer.rate / raw.rate, 2) for timer, raw in pairs]
            out.append(
                f"**{path} path, 1 instance / raw pipeline: {statistics.median(each):.2f}** "
                f"(rounds: {' / '.join(str(x) for x in each)}; target >= 0.8)"
            )
        one = of(1, path)
        for n in counts:
            if n > 1 and one and of(n, path):
                ratio = statistics.median(r.own_cpu_ms for r in of(n, path)) / statistics.median(
                    r.own_cpu_ms for r in one
                )
                # Each round's pair too: the host's speed drifts between rounds, and a
                # ratio of medians can pair a fast round's one instance with a slow one's N.
                each = [
                    round(many.own_cpu_ms / single.own_cpu_ms, 2)
                    for many, single in zip(of(n, path), one, strict=False)
                ]
                out.append(
                    f"{path} path, total CPU per timer, {n} instances / 1: {ratio:.2f} "
                    f"(rounds: {' / '.join(str(x) for x in each)}; target <= 1.15)"
                )
    return "; ".join(out) + "."


def tables(runs: list[Run], counts: list[int]) -> str:
    """Throughput, then CPU per timer by component (medians over the rounds)."""
    cores = os.cpu_count() or 1

    def runs_of(n: int, path: str) -> list[Run]:
        return [r for r in runs if r.instances == n and r.path == path]

    def median(values: list[float]) -> float:
        return statistics.median(values)

    lines = [
        "| instances | schedule path, commands/s | fire path, timers/s "
        "| db-scheduler, executions/s |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n in counts:
        theirs = DB_SCHEDULER if n == 4 else ""
        schedule, fire = _rate(runs_of(n, "schedule")), _rate(runs_of(n, "fire"))
        lines.append(f"| {n} | {schedule} | {fire} | {theirs} |")
    if runs_of(0, "fire"):
        schedule, fire = _rate(runs_of(0, "schedule")), _rate(runs_of(0, "fire"))
        lines.append(
            f"| raw pipelines (yardstick), batches of {RAW_BATCH:,} | {schedule} | {fire} | |"
        )
        lines += ["", ratios(runs, counts)]
    lines += [
        "",
        "CPU per timer (ms, median over the rounds) of each part, the rest of the machine's "
        "load meanwhile (cores busy with other work), PostgreSQL commits per timer, and the "
        f"rate {cores} otherwise idle cores would allow at that CPU cost per timer:",
        "",
        "| instances | path | services | postgres | nats-server | other work, cores "
        "| commits/timer | CPU-bound rate |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in ([0] if runs_of(0, "fire") else []) + counts:
        for path in ("schedule", "fire"):
            chosen = runs_of(n, path)
            own = median([r.own_cpu_ms for r in chosen])
            lines.append(
                f"| {n or 'raw'} | {path} | "
                + " | ".join(f"{median([r.cpu_ms(g) for r in chosen]):.3f}" for g in OWN)
                + f" | {median([r.cores['other'] for r in chosen]):.2f}"
                + f" | {median([r.xacts / r.timers for r in chosen]):.3f}"
                + f" | {cores * 1000 / own:,.0f}/s |"
            )
    return "\n".join(lines)


def profile_table(runs: list[Run]) -> str:
    """Where the first instance's Python time went, per path and instance count."""
    profiled = [r for r in runs if r.profile]
    if not profiled:
        return ""
    kinds = [name for name, _ in PROFILE_KINDS] + ["other"]
    header = "| instances | path | " + " | ".join(kinds) + " |"
    lines = [header, "| ---: | --- | " + " | ".join("---:" for _ in kinds) + " |"]
    for run in profiled:
        assert run.profile is not None
        shares = " | ".join(f"{run.profile.get(kind, 0.0):.0%}" for kind in kinds)
        lines.append(f"| {run.instances} | {run.path} | {shares} |")
    return "\n".join(lines)


def write_readme(body: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the text between one pair of this benchmark's markers, nothing else (a missing
    pair is added at the end of this benchmark's section)."""
    text = README.read_text() if README.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        text = before + block + rest.split(end, 1)[1]
    elif SECTION in text:
        before, rest = text.split(SECTION, 1)
        cut = rest.find("\n## ")
        mine, after = (rest, "") if cut < 0 else (rest[:cut], rest[cut:])
        text = before + SECTION + mine.rstrip() + f"\n\n{block}\n" + after
    else:
        text = text.rstrip() + f"\n\n{SECTION}\n\n{block}\n"
    README.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, README untouched")
    parser.add_argument("--print-only", action="store_true", help="leave the README untouched")
    parser.add_argument("--timers", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instances", default="1,2,4", help="comma-separated instance counts")
    parser.add_argument("--batch-size", type=int, default=100, help="TIMER_BATCH_SIZE")
    parser.add_argument(
        "--command-batch-size", type=int, default=1000, help="TIMER_COMMAND_BATCH_SIZE"
    )
    parser.add_argument(
        "--fast-pg", action="store_true", help="PostgreSQL with fsync off (as in the tests)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the first instance with py-spy; writes only the profile table",
    )
    parser.add_argument(
        "--steady",
        type=float,
        metavar="SECONDS",
        help=f"only the steady scenario: {STEADY_RATE:,} timers/s due 1-2 s ahead for SECONDS, "
        "lateness per instance count; writes only its lines",
    )
    args = parser.parse_args()
    timers, rounds = (3_000, 1) if args.quick else (args.timers, args.rounds)
    global COMMAND_BATCH
    COMMAND_BATCH = args.command_batch_size
    counts = [int(part) for part in args.instances.split(",")]
    where = machine(not args.fast_pg)
    print(f"machine: {where}", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="timer-scale-"))
    pg_root = Path(tempfile.mkdtemp(prefix="timer-scale-pg-"))  # handed to the postgres user
    pg = None
    try:
        pg = start_cluster(pg_root, None if args.fast_pg else DURABLE_PG)
        if args.steady:
            lines = steady(pg, root, counts, args.batch_size, args.steady)
        else:
            runs = measure(pg, root, counts, timers, rounds, args.batch_size, args.profile)
    finally:
        if pg is not None:
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pg_root, ignore_errors=True)
    if args.steady:
        body = (
            f"Run: `uv run --all-packages python bench/scale_out.py --steady {args.steady:g} "
            f"--instances {args.instances}` on {datetime.now(UTC):%Y-%m-%d}, "
            f"`TIMER_BATCH_SIZE={args.batch_size}`, polling every 1 s. Machine: {where}.\n\n"
            f"{lines}"
        )
        print(body)
        if not (args.quick or args.print_only):
            write_readme(body, STEADY_BEGIN, STEADY_END)
        return
    run = (
        f"`uv run --all-packages python bench/scale_out.py{' --profile' if args.profile else ''}` "
        f"on {datetime.now(UTC):%Y-%m-%d}; {timers:,} timers per path, "
        f"`TIMER_BATCH_SIZE={args.batch_size}`, "
        f"`TIMER_COMMAND_BATCH_SIZE={args.command_batch_size}`; yardsticks (raw pipelines, "
        f"batches of {RAW_BATCH:,}) right before the instances in every round"
    )
    if args.profile:
        body = "\n\n".join(
            [
                f"Run: {run}, one round. Share of py-spy samples (250/s, threads holding the "
                "GIL, so Python CPU time) of the first instance, by the leaf-most frame's "
                "library:",
                profile_table(runs),
            ]
        )
    else:
        body = "\n\n".join(
            [
                f"Run: {run}, median of {rounds} rounds (range in brackets). Machine: {where}.",
                tables(runs, counts),
            ]
        )
    print(body)
    if not (args.quick or args.print_only):
        if args.profile:
            write_readme(body, PROFILE_BEGIN, PROFILE_END)
        else:
            write_readme(body)


if __name__ == "__main__":
    main()
