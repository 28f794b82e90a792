"""Faults and pressure that operators of PostgreSQL-backed queues meet, against ``timer-service``
on PostgreSQL with a real ``nats-server``, at a steady due load.

Nine scenarios, named and shaped after the public cross-queue benchmark
hardbyte/postgresql-job-queue-benchmarking (docs/failures.md shows its published figures beside
these, as theirs). Chaos: **postgres_restart** (the server stopped and started again),
**pg_backend_kill** (``pg_terminate_backend`` of the services' connections, again and again),
**pool_exhaustion** (another client holds every connection the server allows),
**crash_recovery** (one of two services killed with SIGKILL, then started again),
**repeated_kills** (the same, over and over). Pressure: **idle_in_tx** (a session idle in a
transaction, holding back vacuum), **sustained_high_load** (three times the load),
**active_readers** (long REPEATABLE READ snapshots beside the services), **event_burst** (a
wave of timers all due at one instant).

Each run has three phases, baseline, fault and recovery, while ``ScheduleTimer`` commands go
in at a steady rate over 50 tenants, each due a second or so after it is sent, and every
``DueTimeReached`` is read back by a live consumer. Measured: each phase's completion (of
the timers due in it, the share stored in ``TIMER_EVENTS`` by a second after the phase's end:
all of them when the services keep up, none when they stopped), during (the fault phase's
completion as a share of the baseline's: what the public benchmark reports for its pressure
scenarios), recovery (the recovery phase's, what it reports for its chaos scenarios; it
divides completion rates, which for a steady offered load is the same measure, and each
phase's events a second are kept in the results too), the time to recover (from the end
of the fault until every timer due from then on fired within a second or three baseline p99s
of its due time) and lateness p50/p99 (JetStream timestamp minus ``dueAt``) of the timers due
during the fault and after it. Checked on every run: no timer whose command JetStream
acknowledged is lost, none fired before its due time, none stored twice in ``TIMER_EVENTS``
(a re-publish of one firing carries its id and is dropped in the duplicate window), and every
service stops on SIGTERM within a minute (no hang).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from timer_adapters_nats import TimerClient
from timer_bench import kit, procs
from timer_bench.procs import Broker, CheckFailed, Service
from timer_core.instants import from_epoch_ms

CHAOS = (
    "postgres_restart",
    "pg_backend_kill",
    "pool_exhaustion",
    "crash_recovery",
    "repeated_kills",
)
PRESSURE = ("idle_in_tx", "sustained_high_load", "active_readers", "event_burst")
SCENARIOS = CHAOS + PRESSURE
#: Scenarios with two services on the database (one of them is killed).
TWO_SERVICES = frozenset({"crash_recovery", "repeated_kills"})
#: The recovery every chaos scenario must reach, as a share of the baseline's rate.
RECOVERED = 0.98
#: Seconds of load before the baseline: the first timers come due 1-1.5 s after they are sent.
WARMUP_S = 2.0
#: How long after a phase's end its timers may still complete (see :func:`outcome`).
GRACE_MS = 1000.0
#: The duplicate window of the service's streams: a re-publish later than this is stored again.
DUPLICATE_WINDOW_MS = 120_000


@dataclass(frozen=True)
class Shape:
    """How long and how hard: the phases' seconds and the steady load."""

    rate: int
    """Timers scheduled a second, steady through every phase."""
    baseline_s: float
    fault_s: float
    recovery_s: float
    down_s: float
    """How long a stopped server or a killed service stays down."""
    kill_every_s: float
    """repeated_kills: one kill and restart every this many seconds."""
    burst: int
    """event_burst: timers all due at one instant."""

    @classmethod
    def of(cls, quick: bool) -> Shape:
        if quick:
            return cls(50, 3.0, 4.0, 4.0, 1.5, 2.0, 1_500)
        return cls(200, 20.0, 45.0, 25.0, 5.0, 10.0, 20_000)


#: The public benchmark's published figures for the same scenarios, as theirs: the
#: completion rate after the fault (chaos) or under pressure, as a share of the clean
#: baseline's, per system; None where the cell produced no figure (the worker exited, or
#: the cell timed out: rc=137). From the 2026-05-09 full sweep (eight PostgreSQL job
#: systems, PostgreSQL 18.3, 4 CPUs), its SUMMARY.md.
PUBLISHED: dict[str, Any] = {
    "source": (
        "results/2026-05-09-full-sweep/SUMMARY.md of hardbyte/postgresql-job-queue-benchmarking "
        "(71de3c5adec9373eb94e15e7c2f38a3ccbada32e)"
    ),
    "machine": "a workstation with 4 CPUs and an 8 GB cgroup limit, PostgreSQL 18.3",
    "systems": ["awa", "absurd", "oban", "pgboss", "procrastinate", "river", "pgque", "pgmq"],
    "recovery": {
        "postgres_restart": [1.00, 0.0, 0.0, None, 0.0, 1.01, 1.00, 0.0],
        "pg_backend_kill": [1.00, 0.0, 1.00, None, 0.0, 1.01, 1.00, 0.0],
        "pool_exhaustion": [1.00, 0.87, 0.86, 0.96, 0.99, 1.00, 1.00, 1.00],
        "crash_recovery": [0.98, 1.03, 0.98, 1.17, 0.73, 1.21, 0.98, 0.74],
        "repeated_kills": [0.99, 1.12, 0.88, 0.99, 0.18, 1.09, 0.72, 0.26],
        "idle_in_tx": [0.75, None, 0.96, None, None, None, 1.00, None],
        "sustained_high_load": [0.73, 0.71, 1.02, 1.36, 0.94, 1.40, 1.00, 1.50],
        "active_readers": [0.71, 0.74, 0.98, 1.01, 0.63, 1.00, 1.00, 0.39],
        "event_burst": [0.80, None, 1.00, None, None, None, 1.00, None],
    },
}


# -- the load and the events -----------------------------------------------------------------


@dataclass
class Ledger:
    """Every timer whose command JetStream acknowledged (key -> due ms), and every event
    stored in ``TIMER_EVENTS`` (key -> [(envelope id, due ms, reachedAt ms, stored ms)])."""

    acked: dict[tuple[str, str], int] = field(default_factory=dict)
    events: dict[tuple[str, str], list[tuple[str, float, float, float]]] = field(
        default_factory=dict
    )

    def on_event(self, message: Msg) -> None:
        body = json.loads(message.data)
        payload = body["payload"]
        key = (payload["tenantId"], payload["serviceCallId"])
        stored = message.metadata.timestamp.timestamp() * 1000
        self.events.setdefault(key, []).append(
            (body["id"], kit.epoch_ms(payload["dueAt"]), kit.epoch_ms(payload["reachedAt"]), stored)
        )

    def missing(self) -> int:
        return sum(1 for key in self.acked if key not in self.events)


async def steady_load(
    client: TimerClient, ledger: Ledger, rate: Callable[[], int], stop: asyncio.Event
) -> None:
    """``rate()`` schedules a second, in ticks of 100 ms, each due 1-1.5 s after it is sent,
    over the kit's tenants, until ``stop``; each acknowledged one goes into the ledger."""
    loop = asyncio.get_running_loop()
    started, tick, sent = loop.time(), 0.1, 0
    n = 0
    while not stop.is_set():
        n += 1
        base = kit.now_ms()
        count = max(1, round(rate() * tick))
        timers = [
            (
                f"tenant-{(sent + i) % kit.TENANTS:02d}",
                f"steady-{sent + i:08d}",
                base + 1000 + random.randrange(500),
            )
            for i in range(count)
        ]
        sent += count
        results = await client.send_many(
            [client.schedule_envelope(t, c, from_epoch_ms(due)) for t, c, due in timers]
        )
        for (tenant, call, due), error in zip(timers, results, strict=True):
            if error is None:
                ledger.acked[(tenant, call)] = due
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, started + n * tick - loop.time()))


# -- the faults ------------------------------------------------------------------------------


@dataclass
class Run:
    """What a fault acts on."""

    name: str
    shape: Shape
    cluster: Any
    database: str
    services: list[Service]
    client: TimerClient
    ledger: Ledger
    load_factor: list[float]
    done: dict[str, int] = field(default_factory=dict)
    """What the fault did, counted (backends terminated, connections held, kills...)."""


def _connect(run: Run) -> psycopg.Connection[Any]:
    return psycopg.connect(run.cluster.conninfo(run.database), autocommit=True, connect_timeout=5)


async def postgres_restart(run: Run) -> None:
    """The server stopped (fast shutdown), down for ``down_s``, started again on its port."""
    await asyncio.to_thread(run.cluster.stop)
    run.done["seconds down"] = round(run.shape.down_s)
    await asyncio.sleep(run.shape.down_s)
    await asyncio.to_thread(run.cluster.start_again)
    await asyncio.sleep(max(0.0, run.shape.fault_s - run.shape.down_s))


async def pg_backend_kill(run: Run) -> None:
    """Every second, ``pg_terminate_backend`` of every connection the services hold."""
    deadline = time.monotonic() + run.shape.fault_s
    with _connect(run) as sql:
        while time.monotonic() < deadline:
            killed = sql.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'timer' AND pid <> pg_backend_pid()"
            ).fetchone()
            run.done["backends terminated"] = run.done.get("backends terminated", 0) + int(
                killed[0] if killed else 0
            )
            await asyncio.sleep(1.0)


async def pool_exhaustion(run: Run) -> None:
    """Another client opens connections until the server refuses more, and holds them idle."""
    held: list[psycopg.Connection[Any]] = []

    def take_all() -> None:
        while True:
            try:
                held.append(_connect(run))
            except psycopg.OperationalError:
                return

    try:
        await asyncio.to_thread(take_all)
        run.done["connections held"] = len(held)
        await asyncio.sleep(run.shape.fault_s)
    finally:
        for connection in held:
            connection.close()


async def _kill_and_restart(run: Run, service: Service, down_s: float) -> None:
    run.done["services killed"] = run.done.get("services killed", 0) + 1
    service.kill()
    await asyncio.sleep(down_s)
    service.start()
    await service.wait_healthy()


async def crash_recovery(run: Run) -> None:
    """One of the two services killed with SIGKILL, down for ``down_s``, started again."""
    started = time.monotonic()
    await _kill_and_restart(run, run.services[0], run.shape.down_s)
    await asyncio.sleep(max(0.0, run.shape.fault_s - (time.monotonic() - started)))


async def repeated_kills(run: Run) -> None:
    """One of the two services killed and started again every ``kill_every_s``."""
    deadline = time.monotonic() + run.shape.fault_s
    while time.monotonic() < deadline:
        began = time.monotonic()
        await _kill_and_restart(
            run, run.services[0], min(run.shape.down_s, run.shape.kill_every_s / 3)
        )
        await asyncio.sleep(
            max(0.0, min(deadline, began + run.shape.kill_every_s) - time.monotonic())
        )


async def idle_in_tx(run: Run) -> None:
    """A session that read the timers table in a transaction, then left it idle: vacuum cannot
    remove any row version the services make meanwhile."""
    with _connect(run) as sql:
        sql.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        sql.execute("SELECT txid_current(), count(*) FROM timer_schedules")
        run.done["seconds idle in a transaction"] = round(run.shape.fault_s)
        await asyncio.sleep(run.shape.fault_s)
        sql.execute("ROLLBACK")


async def sustained_high_load(run: Run) -> None:
    """Three times the steady load for the whole phase."""
    run.load_factor[0] = 3.0
    run.done["load factor"] = 3
    try:
        await asyncio.sleep(run.shape.fault_s)
    finally:
        run.load_factor[0] = 1.0


async def active_readers(run: Run) -> None:
    """Four sessions, one after the other a second apart, each reading the whole timers table
    in a REPEATABLE READ snapshot it keeps open for four seconds, over and over."""
    stop = threading.Event()

    def reader(offset: float) -> None:
        stop.wait(offset)
        with _connect(run) as sql:
            while not stop.is_set():
                sql.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                sql.execute("SELECT count(*), max(due_at) FROM timer_schedules")
                stop.wait(4.0)
                sql.execute("COMMIT")

    readers = [asyncio.to_thread(reader, float(i)) for i in range(4)]
    run.done["readers"] = len(readers)
    running = asyncio.gather(*readers)
    try:
        await asyncio.sleep(run.shape.fault_s)
    finally:
        stop.set()
        await running


async def event_burst(run: Run) -> None:
    """``burst`` timers over the tenants, all due at one instant two seconds ahead."""
    due = kit.now_ms() + 2000
    timers = [
        (f"tenant-{i % kit.TENANTS:02d}", f"burst-{i:07d}", due) for i in range(run.shape.burst)
    ]
    for start in range(0, len(timers), 1000):
        chunk = timers[start : start + 1000]
        results = await run.client.send_many(
            [run.client.schedule_envelope(t, c, from_epoch_ms(d)) for t, c, d in chunk]
        )
        for (tenant, call, d), error in zip(chunk, results, strict=True):
            if error is None:
                run.ledger.acked[(tenant, call)] = d
    run.done["timers due at one instant"] = len(timers)
    await asyncio.sleep(run.shape.fault_s)


FAULTS: dict[str, Callable[[Run], Awaitable[None]]] = {
    "postgres_restart": postgres_restart,
    "pg_backend_kill": pg_backend_kill,
    "pool_exhaustion": pool_exhaustion,
    "crash_recovery": crash_recovery,
    "repeated_kills": repeated_kills,
    "idle_in_tx": idle_in_tx,
    "sustained_high_load": sustained_high_load,
    "active_readers": active_readers,
    "event_burst": event_burst,
}


# -- one run ---------------------------------------------------------------------------------


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def outcome(
    ledger: Ledger, phases: dict[str, tuple[float, float]], stopped: list[bool]
) -> dict[str, Any]:
    """The figures and the checks of one run from its ledger and its phases (epoch ms)."""
    steady = {key: due for key, due in ledger.acked.items() if key[1].startswith("steady-")}
    rates: dict[str, float] = {}
    for phase, (begin, end) in phases.items():
        fired = sum(
            1
            for key in steady
            for _, _, _, stored in ledger.events.get(key, [])[:1]
            if begin <= stored < end
        )
        rates[phase] = round(fired / ((end - begin) / 1000), 1)
    # Completion: of the timers due in a phase, the share stored in TIMER_EVENTS by a grace
    # after the phase's end. A service that keeps up completes all of them (a stall shorter
    # than the grace at a phase's edge costs nothing); one that stopped, none; one that runs
    # at half the offered rate falls behind and completes about half.
    completion: dict[str, float] = {}
    for phase, (begin, end) in phases.items():
        due_in = [key for key, due in steady.items() if begin <= due < end]
        done = sum(
            1
            for key in due_in
            if key in ledger.events and ledger.events[key][0][3] < end + GRACE_MS
        )
        completion[phase] = done / len(due_in) if due_in else 0.0
    late: dict[str, list[float]] = {"fault": [], "recovery": [], "baseline": []}
    lateness: dict[tuple[str, str], float] = {}
    for key, due in steady.items():
        seen = ledger.events.get(key)
        if seen:
            lateness[key] = seen[0][3] - due
        for phase, (begin, end) in phases.items():
            if begin <= due < end and seen:
                late[phase].append(seen[0][3] - due)
    baseline_p99 = _p(late["baseline"], 0.99) or 0.0
    threshold = max(1000.0, 3 * baseline_p99)
    fault_end = phases["fault"][1]
    after = sorted((due, key) for key, due in steady.items() if due >= fault_end)
    recovered_at = fault_end
    for due, key in after:
        if key not in lateness or lateness[key] > threshold:
            recovered_at = due
    early = sum(
        1
        for events in ledger.events.values()
        for _, due, reached, stored in events
        if reached < due or stored < due
    )
    twice = 0
    for events in ledger.events.values():
        for (id_a, _, _, at_a), (id_b, _, _, at_b) in itertools.pairwise(events):
            if id_a != id_b or at_b - at_a < DUPLICATE_WINDOW_MS:
                twice += 1
    baseline = completion["baseline"]
    return {
        "rates": rates,
        "completion": {phase: round(share, 4) for phase, share in completion.items()},
        "recovery": round(completion["recovery"] / baseline, 3) if baseline else 0.0,
        "during": round(completion["fault"] / baseline, 3) if baseline else 0.0,
        "recovery_s": round(max(0.0, recovered_at - fault_end) / 1000, 2),
        "late_ms": {
            phase: {"p50": _p(values, 0.5), "p99": _p(values, 0.99)}
            for phase, values in late.items()
        },
        "timers": len(ledger.acked),
        "checks": {
            "nothing acked lost": ledger.missing() == 0,
            "nothing fired early": early == 0,
            "nothing stored twice": twice == 0,
            "every service stopped on SIGTERM": all(stopped),
        },
        "lost": ledger.missing(),
        "early": early,
        "twice": twice,
    }


async def run_scenario(name: str, shape: Shape, cluster: Any, root: Path) -> dict[str, Any]:
    """One scenario on a fresh database and a fresh ``nats-server``: its figures and checks."""
    workdir = root / name
    workdir.mkdir(parents=True, exist_ok=True)
    database = f"faults_{name}"
    cluster.drop_database(database)
    url = cluster.create_database(database)
    instances = 2 if name in TWO_SERVICES else 1
    async with Broker(workdir) as broker:
        services = [
            Service(
                workdir,
                f"{name}-{index}",
                {
                    "TIMER_DATABASE_URL": url,
                    "TIMER_BROKER_URL": broker.url,
                    "TIMER_INSTANCE_ID": f"{name}-{index}",
                    "TIMER_LOG_LEVEL": "WARNING",
                },
            ).start()
            for index in range(instances)
        ]
        stopped: list[bool] = []
        try:
            for service in services:
                await service.wait_healthy()
            ledger = Ledger()
            js = broker.client.jetstream(timeout=10)
            subscription = await js.subscribe(
                "timer.events.>",
                stream="TIMER_EVENTS",
                cb=_sync(ledger.on_event),
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
            )
            client = TimerClient(broker.client, publish_window=512)
            factor = [1.0]
            run = Run(name, shape, cluster, database, services, client, ledger, factor)
            stop = asyncio.Event()
            loading = asyncio.create_task(
                steady_load(client, ledger, lambda: int(shape.rate * factor[0]), stop)
            )
            phases: dict[str, tuple[float, float]] = {}
            # The first timers come due LEAD_S after the load starts: the baseline begins
            # once they fire at the steady rate.
            await asyncio.sleep(WARMUP_S)
            begin = kit.now_ms()
            await asyncio.sleep(shape.baseline_s)
            phases["baseline"] = (begin, kit.now_ms())
            begin = kit.now_ms()
            await FAULTS[name](run)
            phases["fault"] = (begin, kit.now_ms())
            begin = kit.now_ms()
            await asyncio.sleep(shape.recovery_s)
            phases["recovery"] = (begin, kit.now_ms())
            stop.set()
            await loading
            deadline = time.monotonic() + 60
            while ledger.missing() and time.monotonic() < deadline:
                for service in services:
                    service.check_alive()
                await asyncio.sleep(0.1)
            await subscription.unsubscribe()
        finally:
            for service in services:
                try:
                    service.stop()
                    stopped.append(True)
                except CheckFailed as exc:
                    kit.progress(f"{name}: {exc}")
                    stopped.append(False)
    result = outcome(ledger, phases, stopped)
    result["instances"] = instances
    result["kind"] = "chaos" if name in CHAOS else "pressure"
    result["fault"] = run.done
    if name in CHAOS:
        result["checks"][f"recovered to {RECOVERED:.0%} of the baseline"] = (
            result["recovery"] >= RECOVERED
        )
    cluster.drop_database(database)
    return result


def _sync(callback: Callable[[Msg], None]) -> Callable[[Msg], Awaitable[None]]:
    async def handler(message: Msg) -> None:
        callback(message)

    return handler


# -- the command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="short phases, a light load")
    parser.add_argument("--only", help="comma-separated scenarios (default: all nine)")


def main(args: argparse.Namespace) -> int:
    shape = Shape.of(args.quick)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    # The machine (and its load average) as the run starts; the end's is added when written.
    machine = kit.machine(
        postgres=procs.postgres_version(), nats_server=procs.nats_server_version()
    )
    results: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="timer-faults-"))
    with procs.postgres() as cluster:
        for name in names:
            kit.progress(f"faults: {name}")
            results[name] = asyncio.run(run_scenario(name, shape, cluster, root))
            kit.progress(f"faults: {name}: {results[name]['recovery']:.0%} of the baseline")
    document = {
        "scenario": "faults",
        "date": kit.today(),
        "machine": machine,
        "shape": shape.__dict__,
        "results": results,
        "published": PUBLISHED,
    }
    kit.write_result(document, args.output)
    checks = {
        f"{name}: {check}": ok
        for name, result in results.items()
        for check, ok in result["checks"].items()
    }
    return kit.report_checks(checks)
