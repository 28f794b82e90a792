"""End to end on SQLite: the real ``timer-service`` process on a SQLite file and a real
``nats-server``, against hand-written yardsticks in the same rounds.

Scenarios: the schedule and fire paths (each round right after its yardstick), a storm of
timers due at one instant, steady lateness, the catch-up after a downtime, and how the
schedule rate and the poll cost hold with a million stored. Each checks what it measured:
nothing lost, nothing early, drained in due order. Writes ``results/e2e.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from timer_adapters_nats import TimerClient
from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit, sqlite, yardsticks
from timer_bench.kit import TENANTS, now_ms, percentiles, progress, rate
from timer_bench.procs import Broker, CheckFailed, Service, nats_server_version
from timer_core import TimerEntry
from timer_core.instants import from_epoch_ms

SCENARIOS = ("schedule", "fire", "storm", "steady", "catchup", "scale")
DEFAULT_BATCH = 100
DEFAULT_COMMAND_BATCH = 1000
#: The yardsticks fetch, select and mark 1,000 at a time.
RAW_BATCH = 1000


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does; ``--quick`` shrinks everything but the steady rate."""

    fire: int = 100_000
    schedule: int = 100_000
    steady_rate: int = 1_000
    steady_s: float = 60.0
    storm: int = 100_000
    catchup_stored: int = 1_000_000
    catchup_overdue: int = 100_000
    scale_small: int = 10_000
    scale_commands: int = 20_000
    poll_samples: int = 500


QUICK = Sizes(3_000, 3_000, 1_000, 4.0, 3_000, 30_000, 3_000, 3_000, 2_000, 100)


@dataclass
class Run:
    """One run: its sizes, settings, scratch directory, results and checks."""

    sizes: Sizes
    batch_size: int
    command_batch_size: int
    rounds: int
    workdir: Path
    profile: bool
    baseline: Path | None = None
    """Packages of an earlier commit (``--baseline-ref``): the fire path runs on them too."""
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        progress(f"  [{'ok  ' if ok else 'FAIL'}] {name}: {detail}")

    def db(self, name: str) -> Path:
        return sqlite.create(self.scratch(name) / "timer.db")

    def scratch(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def drop(self, *names: str) -> None:
        """A finished round's databases and broker files (a full run makes gigabytes)."""
        for name in names:
            shutil.rmtree(self.workdir / name, True)

    @contextlib.asynccontextmanager
    async def service(
        self, db: Path, url: str, label: str, batch: int = 0, *, tree: Path | None = None
    ) -> AsyncIterator[Service]:
        """The service on this checkout's sources, or on those of ``tree`` (an exported
        commit, first on its ``PYTHONPATH``)."""
        profile = kit.RESULTS / f"profile-{label}.txt" if self.profile else None
        settings: dict[str, object] = {
            "TIMER_DB_PATH": db,
            "TIMER_BROKER_URL": url,
            "TIMER_BATCH_SIZE": batch or self.batch_size,
            "TIMER_COMMAND_BATCH_SIZE": self.command_batch_size,
        }
        if tree is not None:
            settings["PYTHONPATH"] = kit.on_sources(tree)["PYTHONPATH"]
        service = Service(self.workdir, label, settings, profile).start()
        try:
            await service.wait_healthy()
            yield service
            service.stop()
        finally:
            service.kill()
            if not math.isnan(service.startup_s):
                self.startups.append(round(service.startup_s, 2))


def future_commands(count: int, prefix: str) -> list[tuple[str, str, int]]:
    """New timers with random keys, due at random moments of the next 30 days."""
    base = now_ms() + 86_400_000
    return [
        (
            f"tenant-{random.randrange(TENANTS):02d}",
            f"{prefix}-{uuid.uuid4().hex}",
            base + random.randrange(30 * 86_400_000),
        )
        for _ in range(count)
    ]


def with_rounds(taken: list[dict[str, dict[str, Any]]], base: str, measured: str) -> dict[str, Any]:
    """The measured side of the round with the median ratio to its yardstick, every round's
    ratio and rates beside it; the yardstick of that round under ``yardstick``."""
    for one in taken:
        one[measured]["vs_raw"] = round(one[measured]["per_s"] / one[base]["per_s"], 2)
    chosen = kit.median_round(taken, key=lambda one: float(one[measured]["vs_raw"]))
    result, yardstick = dict(chosen[measured]), dict(chosen[base])
    if len(taken) > 1:
        result["rounds_vs_raw"] = [one[measured]["vs_raw"] for one in taken]
        result["rounds_load"] = [one[measured]["load"] for one in taken]
        result["rounds_per_s"] = [one[measured]["per_s"] for one in taken]
        yardstick["rounds_per_s"] = [one[base]["per_s"] for one in taken]
    return {"measured": result, "yardstick": yardstick}


# -- the schedule path -----------------------------------------------------------------------


async def schedule_path(
    run: Run, db: Path, broker: Broker, count: int, label: str
) -> dict[str, Any]:
    """``count`` commands waiting in ``TIMER_COMMANDS`` before the service starts; from the
    first ``registeredAt`` until the consumer has nothing pending nor unacknowledged."""
    before = sqlite.state_counts(db).get("Scheduled", 0)
    await broker.send_schedules(future_commands(count, label))
    async with run.service(db, broker.url, label) as service:
        cpu_before = service.cpu_s()
        deadline = time.monotonic() + 60 + count / 500
        while await broker.command_backlog() > 0:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{label}: commands still unacked")
            await asyncio.sleep(0.02)
        done = time.time()
        cpu = service.cpu_s() - cpu_before
        rss = service.peak_rss_mb()
    scheduled = sqlite.state_counts(db).get("Scheduled", 0)
    elapsed = done - sqlite.first_of(db, "registered_at", label) / 1000
    run.check(
        f"{label}: every acked command stored",
        scheduled == before + count,
        f"{scheduled:,} Scheduled, {before:,} before + {count:,} commands",
    )
    return {
        "commands": count,
        "per_s": rate(count, elapsed),
        "seconds": round(elapsed, 2),
        # From the first health answer on: a few early batches may precede it.
        "cpu_us_per_command": round(1e6 * cpu / count, 1),
        "peak_rss_mb": rss,
    }


async def scenario_schedule(run: Run) -> None:
    count = run.sizes.schedule

    async def measure(side: str, round_: int) -> dict[str, Any]:
        name = f"{side}-{round_}"
        db = run.db(name)
        load = kit.load_average()[0]
        async with Broker(run.scratch(name)) as broker:
            if side == "raw":
                progress(f"yardstick: raw fetch -> upsert -> ack ({count:,}, batch {RAW_BATCH})")
                await broker.send_schedules(future_commands(count, "raw"))
                watch = kit.Stopwatch()
                per_s, stored = await yardsticks.schedule_pipeline(db, broker.url, count, RAW_BATCH)
                cpu = watch.cpu_us_per(stored)
                backlog = await broker.command_backlog()
                run.check(
                    "raw schedule pipeline stored and acked all",
                    stored == count == sqlite.state_counts(db).get("Scheduled") and backlog == 0,
                    f"{stored:,} fetched, {backlog:,} unacked",
                )
                result = {"per_s": per_s, "batch": RAW_BATCH, "cpu_us_per_command": cpu}
            else:
                progress(f"schedule path: {count:,} ScheduleTimer backlogged on TIMER_COMMANDS")
                result = await schedule_path(run, db, broker, count, "schedule")
        run.drop(name)
        return {**result, "load": load}

    taken = await kit.alternated(run.rounds, ["raw", "service"], measure, rotate=False)
    chosen = with_rounds(taken, "raw", "service")
    run.results["schedule"] = {**chosen["measured"], "fetch_batch": run.command_batch_size}
    run.results.setdefault("yardsticks", {})["raw_schedule"] = chosen["yardstick"]


# -- the fire path ---------------------------------------------------------------------------


async def fire_path(run: Run, name: str, batch: int, *, tree: Path | None = None) -> dict[str, Any]:
    """Timers written while the service idles, then one command wakes it; from the first
    ``reachedAt`` until none is left due (the service's CPU counted from then too). ``tree``:
    the service of an earlier commit."""
    count = run.sizes.fire
    db = run.db(name)
    async with Broker(run.scratch(name)) as broker:
        async with run.service(db, broker.url, name, batch, tree=tree) as service:
            cpu = service.cpu_s()
            sqlite.insert_overdue(db, name, count)
            await broker.send_schedules([("tenant-00", f"{name}-wake-up", now_ms())])
            # The wake-up stored first: a tenant's first command waits for its consumer (a
            # quarter of a second at most) and may come after the poll fired the rest.
            while await broker.command_backlog() > 0:
                await asyncio.sleep(0.01)
            done = await sqlite.wait_until_none_due(db, within=60 + count / 500, what=name)
            cpu = service.cpu_s() - cpu
            metrics = await service.metrics()
            rss = service.peak_rss_mb()
        events = await broker.stream_messages()
    fired = count + 1
    elapsed = done - sqlite.first_of(db, "reached_at") / 1000
    reached = sqlite.state_counts(db).get("Reached", 0)
    passes = metrics.get("timer_polling_duration_seconds_count", 0.0)
    run.check(
        f"{name}: every due timer published once and marked Reached",
        reached == fired and events == fired,
        f"{reached:,} Reached, {events:,} events in TIMER_EVENTS",
    )
    return {
        "timers": fired,
        "per_s": rate(fired, elapsed),
        "seconds": round(elapsed, 2),
        "cpu_us_per_timer": round(1e6 * cpu / fired, 1),
        "passes": int(passes),
        "mean_pass_ms": round(
            1000 * metrics.get("timer_polling_duration_seconds_sum", 0.0) / max(passes, 1), 2
        ),
        "publish_failures": metrics.get("timer_publish_failures_total", 0.0),
        "peak_rss_mb": rss,
    }


async def scenario_fire(run: Run) -> None:
    count, batch = run.sizes.fire, run.batch_size

    async def measure(side: str, round_: int) -> dict[str, Any]:
        name = f"{side}-{round_}"
        load = kit.load_average()[0]
        if side == "raw":
            progress(f"yardstick: raw select -> publish_async -> mark ({count:,}, {RAW_BATCH})")
            db = run.db(name)
            sqlite.insert_overdue(db, name, count)
            async with Broker(run.scratch(name)) as broker:
                watch = kit.Stopwatch()
                per_s, fired = await yardsticks.fire_pipeline(db, broker.url, RAW_BATCH)
                cpu = watch.cpu_us_per(fired)
                stored = await broker.stream_messages()
            run.check(
                f"raw pipeline (batch {RAW_BATCH}) fired all",
                fired == count == stored,
                f"{fired:,} fired, {stored:,} events stored",
            )
            result: dict[str, Any] = {"per_s": per_s, "cpu_us_per_timer": cpu}
        else:
            name = f"fire-{side}-{batch}-{round_}"
            tree = run.baseline if side == "baseline" else None
            progress(f"fire path ({side}): {count:,} stored timers already due, batch {batch}")
            result = await fire_path(run, name, batch, tree=tree)
        run.drop(name)
        return {**result, "load": load}

    sides = ["raw", "service"] + (["baseline"] if run.baseline is not None else [])
    taken = await kit.alternated(run.rounds, sides, measure, lead=1)
    chosen = with_rounds(taken, "raw", "service")
    run.results["fire"] = {str(batch): chosen["measured"]}
    run.results.setdefault("yardsticks", {})["raw_pipeline"] = {str(RAW_BATCH): chosen["yardstick"]}
    if run.baseline is not None:
        run.results["fire_baseline"] = {
            "rounds": [{side: one[side] for side in ("service", "baseline")} for one in taken],
            "rate_vs_baseline": kit.median_ratio(
                [one["service"]["per_s"] for one in taken],
                [one["baseline"]["per_s"] for one in taken],
            ),
            "cpu_vs_baseline": kit.median_ratio(
                [one["service"]["cpu_us_per_timer"] for one in taken],
                [one["baseline"]["cpu_us_per_timer"] for one in taken],
            ),
        }


# -- a storm, steady lateness ----------------------------------------------------------------


async def scenario_storm(run: Run) -> None:
    """Timers written while the service idles, all due at one instant a few seconds ahead;
    one command due then makes the idle worker read its next due time again."""
    count = run.sizes.storm
    progress(f"storm: {count:,} timers due at the same instant")
    db = run.db("storm")
    async with Broker(run.scratch("storm")) as broker:
        async with run.service(db, broker.url, "storm") as service:
            due = now_ms() + (5000 if count > 10_000 else 2000)
            sqlite.insert_rows(db, sqlite.timer_rows(count, prefix="storm", due_ms=lambda i: due))
            await broker.send_schedules([("tenant-00", "storm-wake-up", due)])
            ready_before_ms = due - now_ms()
            cpu = service.cpu_s()
            deadline = time.monotonic() + 60 + count / 500
            while now_ms() < due or await broker.stream_messages() <= count:
                if time.monotonic() > deadline:
                    raise CheckFailed("storm: events missing")
                await asyncio.sleep(0.02)
            all_readable = time.time()
            done = await sqlite.wait_until_none_due(db, within=60, what="storm")
            cpu = service.cpu_s() - cpu
            rss = service.peak_rss_mb()
        events = await broker.stream_messages()
    lateness, early = sqlite.reached_lateness(db)
    fired = count + 1
    run.check(
        "storm: nothing lost, nothing early",
        len(lateness) == fired == events and early == 0,
        f"{len(lateness):,} Reached, {events:,} events, {early} early",
    )
    run.check("storm: written before the instant", ready_before_ms > 0, f"{ready_before_ms} ms")
    run.results["storm"] = {
        "timers": fired,
        "fire_all_s": round(done - due / 1000, 3),
        "all_readable_s": round(all_readable - due / 1000, 3),
        "per_s": rate(fired, done - due / 1000),
        "reached_lateness": percentiles(lateness),
        "cpu_us_per_timer": round(1e6 * cpu / fired, 1),
        "peak_rss_mb": rss,
    }


async def steady_lateness(
    broker: Broker, rate_per_s: int, seconds: float, wait: Any = None, prefix: str = "steady"
) -> tuple[int, dict[str, float], dict[str, float], int]:
    """``rate_per_s`` ``ScheduleTimer`` a second through ``TIMER_COMMANDS`` in ticks of 10 ms,
    each due at a random millisecond 1-2 s ahead, every event read back by a live consumer:
    how many were sent, and per timer ``reachedAt - dueAt`` and (read - due), in ms, and how
    many fired early. ``wait()`` is called while waiting for the last events; ``prefix``
    starts every service call id (a fired key is never armed again: runs on one database
    need prefixes of their own)."""
    per_tick, tick = max(1, rate_per_s // 100), 0.01
    readable: dict[str, float] = {}
    reached: dict[str, float] = {}
    early = 0

    async def on_event(message: Msg) -> None:
        nonlocal early
        seen = time.time() * 1000
        payload = json.loads(message.data)["payload"]
        due, at = kit.epoch_ms(payload["dueAt"]), kit.epoch_ms(payload["reachedAt"])
        readable[payload["serviceCallId"]] = seen - due
        reached[payload["serviceCallId"]] = at - due
        early += at < due

    js = broker.client.jetstream(timeout=10)
    subscription = await js.subscribe(
        "timer.events.>",
        stream="TIMER_EVENTS",
        cb=on_event,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.NEW,
    )
    sender = TimerClient(broker.client, publish_window=512)
    loop = asyncio.get_running_loop()
    sent = 0
    started = loop.time()
    for n in range(int(seconds / tick)):
        await asyncio.sleep(max(0.0, started + n * tick - loop.time()))
        base = now_ms()
        envelopes = [
            sender.schedule_envelope(
                f"tenant-{(sent + i) % TENANTS:02d}",
                f"{prefix}-{sent + i:08d}",
                from_epoch_ms(base + 1000 + random.randrange(1000)),
            )
            for i in range(per_tick)
        ]
        errors = [e for e in await sender.send_many(envelopes) if e is not None]
        if errors:
            raise CheckFailed(f"steady: command not acked: {errors[0]}")
        sent += per_tick
    deadline = time.monotonic() + 30
    while len(readable) < sent and time.monotonic() < deadline:
        if wait is not None:
            wait()
        await asyncio.sleep(0.05)
    await subscription.unsubscribe()
    return sent, reached, readable, early


async def scenario_steady(run: Run) -> None:
    sizes = run.sizes
    progress(f"steady lateness: {sizes.steady_rate:,}/s for {sizes.steady_s:.0f}s")
    db = run.db("steady")
    async with (
        Broker(run.scratch("steady")) as broker,
        run.service(db, broker.url, "steady") as service,
    ):
        sent, reached, readable, early = await steady_lateness(
            broker, sizes.steady_rate, sizes.steady_s, service.check_alive
        )
        metrics = await service.metrics()
        rss = service.peak_rss_mb()
    run.check(
        "steady: every timer fired, none early",
        len(readable) == sent and early == 0,
        f"{len(readable):,} of {sent:,} events read, {early} early",
    )
    run.results["steady"] = {
        "timers": sent,
        "rate_per_s": sizes.steady_rate,
        "seconds": sizes.steady_s,
        "reached_lateness": percentiles(list(reached.values())),
        "readable_lateness": percentiles(list(readable.values())),
        "commands_stored": metrics.get('timer_commands_received_total{outcome="stored"}'),
        "peak_rss_mb": rss,
    }


# -- catch-up and scale ----------------------------------------------------------------------


def big_template(run: Run) -> Path:
    """A database of ``catchup_stored - catchup_overdue`` timers due over the coming day."""
    template = run.workdir / "template-big.db"
    if not template.exists():
        count = run.sizes.catchup_stored - run.sizes.catchup_overdue
        progress(f"building a database of {count:,} future timers")
        base = now_ms() + 86_400_000
        rows = sqlite.timer_rows(
            count, prefix="future", due_ms=lambda i: base + random.randrange(86_400_000)
        )
        sqlite.insert_rows(sqlite.create(template), rows, rebuild_indexes=True)
    return template


async def scenario_catchup(run: Run) -> Path:
    sizes, overdue = run.sizes, run.sizes.catchup_overdue
    progress(f"catch-up: {sizes.catchup_stored:,} stored, {overdue:,} overdue after a downtime")
    db = run.scratch("catchup") / "timer.db"
    shutil.copyfile(big_template(run), db)
    base = now_ms() - 3_600_000
    rows = sqlite.timer_rows(
        overdue, prefix="overdue", due_ms=lambda i: base + random.randrange(3_599_000)
    )
    sqlite.insert_rows(db, rows)
    size_bytes = db.stat().st_size
    async with Broker(run.scratch("catchup")) as broker:
        async with run.service(db, broker.url, "catchup") as service:
            done = await sqlite.wait_until_none_due(db, within=60 + overdue / 500, what="catch-up")
            rss = service.peak_rss_mb()
        events = await broker.read_events(overdue)
        stored = await broker.stream_messages()
    elapsed = done - sqlite.first_of(db, "reached_at") / 1000
    counts = sqlite.state_counts(db)
    # Each tenant's timers in due order: batches are shared among the tenants when more is
    # due than a batch holds, so the tenants interleave, each in its own order.
    by_tenant: dict[str, list[str]] = {}
    for event in events:
        by_tenant.setdefault(event["tenantId"], []).append(event["dueAt"])
    out_of_order = sum(1 for own in by_tenant.values() for a, b in itertools.pairwise(own) if b < a)
    run.check(
        "catch-up: every overdue timer fired once, the future ones untouched",
        counts.get("Reached", 0) == overdue == stored == len({e["_id"] for e in events})
        and counts.get("Scheduled", 0) == sizes.catchup_stored - overdue,
        f"{counts.get('Reached', 0):,} Reached, {counts.get('Scheduled', 0):,} Scheduled, "
        f"{stored:,} events",
    )
    run.check(
        "catch-up: drained in due order",
        out_of_order == 0 and len(events) == overdue,
        f"{out_of_order} of {len(events):,} events earlier-due than their tenant's one before",
    )
    run.results["catchup"] = {
        "stored": sizes.catchup_stored,
        "overdue": overdue,
        "drain_s": round(elapsed, 2),
        "per_s": rate(overdue, elapsed),
        "peak_rss_mb": rss,
        "db_bytes_per_timer": round(size_bytes / sizes.catchup_stored),
    }
    return db


async def poll_costs(dbs: dict[str, Path], batch: int, samples: int) -> dict[str, dict[str, float]]:
    """The worker's store calls on each database through ``SqliteTimerStore``, sampled in
    turn: an idle pass (``find_due`` finding nothing, ``next_due_at``) and a ``find_due``
    returning a full batch; medians, in microseconds."""
    stores = {label: SqliteTimerStore(db) for label, db in dbs.items()}
    due = now_ms() - 60_000
    batch_due = [
        TimerEntry(
            tenant_id=f"tenant-{i % TENANTS:02d}",
            service_call_id=f"poll-{i:06d}",
            due_at=from_epoch_ms(due + i),
            registered_at=from_epoch_ms(due - 1000),
        )
        for i in range(batch)
    ]
    empty: dict[str, list[float]] = {label: [] for label in stores}
    full: dict[str, list[float]] = {label: [] for label in stores}
    try:
        for store in stores.values():
            await store.start()
            await store.apply(batch_due)
        before_due, busy = from_epoch_ms(due - 1), datetime.now(UTC)
        for _ in range(samples):
            for label, store in stores.items():
                started = time.perf_counter()
                await store.find_due(before_due, batch)
                await store.next_due_at()
                empty[label].append((time.perf_counter() - started) * 1e6)
                started = time.perf_counter()
                found = await store.find_due(busy, batch)
                full[label].append((time.perf_counter() - started) * 1e6)
                if len(found) != batch:
                    raise CheckFailed(f"find_due found {len(found)} of {batch} due timers")
    finally:
        for store in stores.values():
            await store.aclose()
    return {
        label: {
            "empty_poll_us": round(statistics.median(empty[label][5:]), 1),
            "find_due_us": round(statistics.median(full[label][5:]), 1),
        }
        for label in stores
    }


async def scenario_scale(run: Run, big_db: Path | None) -> None:
    """The schedule path into a small and a big store, in turn each round; then the poll
    costs of both, sampled alternately."""
    sizes = run.sizes
    small_template = run.db("scale-small-template")
    base = now_ms() + 86_400_000
    rows = sqlite.timer_rows(
        sizes.scale_small, prefix="small", due_ms=lambda i: base + random.randrange(86_400_000)
    )
    sqlite.insert_rows(small_template, rows)
    if big_db is None:
        big_db = run.scratch("scale-big") / "timer.db"
        shutil.copyfile(big_template(run), big_db)
    stored = {"small": sizes.scale_small, "big": sum(sqlite.state_counts(big_db).values())}
    small = run.scratch("scale-small") / "timer.db"

    async def measure(side: str, round_: int) -> dict[str, Any]:
        # A fresh small store each round; the big one takes 20,000 more, nothing to a million.
        db = big_db if side == "big" else small
        if side == "small":
            shutil.copyfile(small_template, small)
        progress(f"scale: {sizes.scale_commands:,} commands into {stored[side]:,} stored timers")
        name = f"scale-{side}-{round_}"
        async with Broker(run.scratch(name)) as broker:
            result = await schedule_path(run, db, broker, sizes.scale_commands, name)
        run.drop(name)
        return result

    taken = await kit.alternated(run.rounds, ["small", "big"], measure)
    progress(f"scale: poll cost, {sizes.poll_samples} samples of each store in turn")
    costs = await poll_costs({"small": small, "big": big_db}, run.batch_size, sizes.poll_samples)
    out: dict[str, Any] = {}
    for label in ("small", "big"):
        mine = [one[label] for one in taken]
        result = dict(kit.median_round(mine, key=lambda r: float(r["per_s"])))
        if len(mine) > 1:
            result["rounds_per_s"] = [r["per_s"] for r in mine]
        out[label] = {**result, **costs[label], "stored": stored[label]}
    run.results["scale"] = out


async def run_scenarios(run: Run, only: set[str]) -> None:
    """The scenarios named in ``only``, in their fixed order."""
    big_db: Path | None = None
    for name in SCENARIOS:
        if name not in only:
            continue
        if name == "catchup":
            big_db = await scenario_catchup(run)
        elif name == "scale":
            await scenario_scale(run, big_db)
        else:
            await globals()[f"scenario_{name}"](run)


# -- the command line ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="TIMER_BATCH_SIZE")
    parser.add_argument(
        "--command-batch-size",
        type=int,
        default=DEFAULT_COMMAND_BATCH,
        help="TIMER_COMMAND_BATCH_SIZE",
    )
    parser.add_argument("--rounds", type=int, help="rounds of alternation (default 3, quick 1)")
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--profile", action="store_true", help="the service under pyinstrument")
    parser.add_argument(
        "--baseline-ref",
        help="fire: also the service of this commit, alternated with the current one",
    )


def main(args: argparse.Namespace) -> int:
    if args.scenario == "fire-tenants":  # the fire path alone, in more rounds
        args.only, args.rounds = "fire", args.rounds or (1 if args.quick else 5)
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    if only - set(SCENARIOS):
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(only - set(SCENARIOS)))}")
    workdir = Path(tempfile.mkdtemp(prefix="timer-bench-"))
    run = Run(
        sizes=QUICK if args.quick else Sizes(),
        batch_size=args.batch_size,
        command_batch_size=args.command_batch_size,
        rounds=args.rounds or (1 if args.quick else 3),
        workdir=workdir,
        profile=args.profile,
    )
    machine = kit.machine(nats_server=nats_server_version())
    progress(f"end to end on {machine['nproc']} x {machine['cpu']}; scratch {workdir}")
    started = time.monotonic()
    try:
        if args.baseline_ref:
            run.baseline = kit.export_tree(args.baseline_ref, workdir / "baseline")
        asyncio.run(run_scenarios(run, only))
    except CheckFailed as exc:
        run.check("harness completed", False, str(exc))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    document = {
        "mode": "quick" if args.quick else "full",
        "date": kit.today(),
        "machine": machine,
        "service": {
            "process": "subprocess: python -m timer_service.cli run (own event loop)",
            "batch_size": run.batch_size,
            "default_batch_size": DEFAULT_BATCH,
            "polling_interval_ms": 5000,
            "command_batch_size": run.command_batch_size,
            "default_command_batch_size": DEFAULT_COMMAND_BATCH,
            "yardstick_batch": RAW_BATCH,
            "rounds": run.rounds,
            "baseline_ref": args.baseline_ref,
        },
        "sizes": run.sizes.__dict__,
        "service_startups_s": run.startups,
        "seconds": round(time.monotonic() - started, 1),
        "results": run.results,
        "checks": run.checks,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import e2e_block, fire_tenants_block

    if args.scenario == "fire-tenants":
        print(fire_tenants_block(document))
    elif only == set(SCENARIOS):
        print(e2e_block(document))
    else:  # some of the scenarios: no block to fill, the figures as they are
        print(json.dumps(run.results, indent=2))
    return 1 if any(not c["ok"] for c in run.checks) else 0
