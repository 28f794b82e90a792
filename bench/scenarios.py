"""The scenarios of ``bench/run.py``: yardsticks, the schedule and fire paths, a storm, steady
lateness, catch-up and scale. Each measures the real service and checks that nothing was lost,
nothing fired early and the backlog drained in due order."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from harness import (
    CONSUMER,
    DEFAULT_BATCH,
    RAW_BATCH,
    TABLE,
    TENANTS,
    Broker,
    CheckFailed,
    Run,
    connect_db,
    copy_db,
    create_db,
    epoch_ms,
    first_reached_ms,
    first_registered_ms,
    insert_rows,
    now_ms,
    percentiles,
    progress,
    rate,
    reached_lateness,
    running_service,
    stamp,
    state_counts,
    timer_rows,
    wait_until_none_due,
)
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from timer_adapters_nats import (
    TimerClient,
)
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import TimerEntry, from_epoch_ms

SCENARIOS = ("yardsticks", "schedule", "fire", "storm", "steady", "catchup", "scale")


# -- yardsticks ------------------------------------------------------------------------------

_RAW_UPSERT = f"""
INSERT INTO {TABLE} (tenant_id, service_call_id, correlation_id, due_at, registered_at, state)
VALUES (?, ?, ?, ?, ?, 'Scheduled')
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    due_at = excluded.due_at, correlation_id = excluded.correlation_id,
    registered_at = excluded.registered_at
WHERE {TABLE}.state = 'Scheduled'
"""
_RAW_FIND = f"""
SELECT tenant_id, service_call_id, correlation_id, due_at FROM {TABLE}
INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND due_at <= ? ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
_RAW_MARK = f"""
UPDATE {TABLE} SET state = 'Reached', reached_at = ?
WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled' AND due_at = ?
"""


def raw_upserts(db: Path, count: int, batch: int) -> float:
    """Raw sqlite3: ``count`` upserts, ``batch`` per transaction; returns upserts/s."""
    registered = now_ms()
    rows = list(
        timer_rows(
            count,
            prefix="raw",
            due_ms=lambda i: registered + 86_400_000 + random.randrange(86_400_000),
            registered_ms=registered,
        )
    )
    random.shuffle(rows)
    connection = connect_db(db)
    try:
        started = time.perf_counter()
        for start in range(0, count, batch):
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(_RAW_UPSERT, rows[start : start + batch])
            connection.execute("COMMIT")
        return rate(count, time.perf_counter() - started)
    finally:
        connection.close()


async def raw_pipeline(db: Path, url: str, batch: int) -> tuple[float, int]:
    """Raw sqlite3 + nats-py ``publish_async``: select due -> publish all -> mark, per batch.

    Returns timers/s and how many were fired.
    """
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    connection = connect_db(db)
    fired = 0
    try:
        started = time.perf_counter()
        while True:
            now = stamp(now_ms())
            rows = connection.execute(_RAW_FIND, (now, batch)).fetchall()
            if not rows:
                break
            acks = []
            for tenant, call, correlation, due in rows:
                firing = f"{tenant}.{call}.{due}"
                body = {
                    "id": firing,
                    "type": "DueTimeReached",
                    "tenantId": tenant,
                    "aggregateId": call,
                    "timestampMs": now_ms(),
                    "correlationId": correlation,
                    "payload": {
                        "_tag": "DueTimeReached",
                        "tenantId": tenant,
                        "serviceCallId": call,
                        "dueAt": due,
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
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(
                _RAW_MARK, [(now, tenant, call, due) for tenant, call, _, due in rows]
            )
            connection.execute("COMMIT")
            fired += len(rows)
        return rate(fired, time.perf_counter() - started), fired
    finally:
        connection.close()
        await nc.close()


async def raw_schedule_pipeline(db: Path, url: str, count: int, batch: int) -> tuple[float, int]:
    """Raw nats-py + sqlite3: pull fetch ``batch`` commands -> one-transaction upsert -> ack.

    The commands wait in ``TIMER_COMMANDS`` for the service's durable consumer, as for the
    service; parsed with ``json.loads`` (no validation), stored with the store's own upsert.
    Returns commands/s (from the first fetch to the last ack flushed) and how many were stored.
    """
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    subscription = await js.pull_subscribe_bind(CONSUMER, "TIMER_COMMANDS")
    connection = connect_db(db)
    stored = 0
    deadline = time.monotonic() + 60 + count / 500
    try:
        started = time.perf_counter()
        while stored < count and time.monotonic() < deadline:
            try:
                messages = await subscription.fetch(batch, timeout=1)
            except TimeoutError:
                continue
            registered = stamp(now_ms())
            rows = []
            for message in messages:
                body = json.loads(message.data)
                payload = body["payload"]
                rows.append(
                    (
                        payload["tenantId"],
                        payload["serviceCallId"],
                        body.get("correlationId"),
                        payload["dueAt"],
                        registered,
                    )
                )
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(_RAW_UPSERT, rows)
            connection.execute("COMMIT")
            for message in messages:
                await message.ack()
            stored += len(messages)
        await nc.flush()
        return rate(stored, time.perf_counter() - started), stored
    finally:
        connection.close()
        await subscription.unsubscribe()
        await nc.close()


def overdue_db(run: Run, name: str, count: int) -> Path:
    """A database holding ``count`` timers already due (over the last hour)."""
    db = run.scratch(name) / "timer.db"
    create_db(db)
    insert_overdue(db, name, count)
    return db


def insert_overdue(db: Path, prefix: str, count: int) -> None:
    base = now_ms() - 3_600_000
    insert_rows(
        db,
        timer_rows(
            count,
            prefix=prefix,
            due_ms=lambda i: base + (i * 3_599_000) // count,
            registered_ms=base - 1000,
        ),
        rebuild_indexes=False,
    )


async def scenario_yardsticks(run: Run) -> None:
    sizes = run.sizes
    progress(f"yardstick: raw sqlite3 batched upserts ({sizes.schedule:,})")
    db = run.scratch("raw-upserts") / "timer.db"
    create_db(db)
    run.results.setdefault("yardsticks", {})["raw_upserts_per_s"] = {
        str(batch): raw_upserts(db, sizes.schedule, batch)
        for batch in sorted({DEFAULT_BATCH, run.batch_size})
    }


# -- schedule path ---------------------------------------------------------------------------


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


async def measure_schedule_path(
    run: Run, db: Path, broker: Broker, count: int, *, label: str
) -> dict[str, Any]:
    """Backlog ``count`` commands, start the service, time them until stored and acked.

    From the ``registeredAt`` of the first stored (its batch's clock reading) to the moment
    the consumer has nothing pending nor unacknowledged.
    """
    before = state_counts(db).get("Scheduled", 0)
    await broker.send_schedules(future_commands(count, label))
    async with running_service(
        run, db, broker.url, batch_size=run.batch_size, label=label
    ) as service:
        await service.wait_healthy()
        cpu_before = service.cpu_s()
        deadline = time.monotonic() + 60 + count / 500
        while await broker.command_backlog() > 0:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{label}: commands still unacked")
            await asyncio.sleep(0.02)
        done = time.time()
        cpu = service.cpu_s() - cpu_before
        rss = service.peak_rss_mb()
    scheduled = state_counts(db).get("Scheduled", 0)
    elapsed = done - first_registered_ms(db, label) / 1000
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


async def schedule_raw(run: Run, round_: int) -> dict[str, Any]:
    """The schedule path's yardstick on the same backlog, in this process."""
    count = run.sizes.schedule
    name = round_name("raw-schedule", round_)
    progress(f"yardstick: raw fetch -> upsert -> ack ({count:,}, batch {RAW_BATCH})")
    db = run.scratch(name) / "timer.db"
    create_db(db)
    async with Broker(run.scratch(name)) as broker:
        await broker.send_schedules(future_commands(count, "raw"))
        cpu = time.process_time()
        per_s, stored = await raw_schedule_pipeline(db, broker.url, count, RAW_BATCH)
        cpu = time.process_time() - cpu
        backlog = await broker.command_backlog()
    scheduled = state_counts(db).get("Scheduled", 0)
    run.check(
        "raw schedule pipeline stored and acked all",
        stored == count and scheduled == count and backlog == 0,
        f"{stored:,} fetched, {scheduled:,} stored, {backlog:,} unacked",
    )
    drop_scratch(run, "raw-schedule", round_=round_)
    return {
        "per_s": per_s,
        "batch": RAW_BATCH,
        "cpu_us_per_command": round(1e6 * cpu / max(stored, 1), 1),
    }


async def scenario_schedule(run: Run) -> None:
    """The schedule path ``run.rounds`` times on a fresh database, each round right after its
    yardstick (the raw pipeline on the same number of commands); the median-ratio round is
    reported, with every round's ratio."""
    count = run.sizes.schedule
    rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for round_ in range(1, run.rounds + 1):
        load = round(os.getloadavg()[0], 2)
        yardstick = await schedule_raw(run, round_)
        progress(f"schedule path: {count:,} ScheduleTimer backlogged on TIMER_COMMANDS")
        name = round_name("schedule", round_)
        db = run.scratch(name) / "timer.db"
        create_db(db)
        async with Broker(run.scratch(name)) as broker:
            measured = await measure_schedule_path(run, db, broker, count, label="schedule")
        measured["vs_raw"] = round(measured["per_s"] / yardstick["per_s"], 2)
        measured["load"] = load
        rounds.append((yardstick, measured))
        drop_scratch(run, "schedule", round_=round_)
    yardstick, result = median_against_yardstick(rounds)
    result["fetch_batch"] = run.command_batch_size
    run.results["schedule"] = result
    run.results.setdefault("yardsticks", {})["raw_schedule"] = yardstick


# -- fire path -------------------------------------------------------------------------------


async def fire_raw(run: Run, batch: int, round_: int = 1) -> dict[str, Any]:
    """The yardstick: the hand-written pipeline on the same timers, in this process."""
    count = run.sizes.fire
    label = round_name(f"raw-pipeline-{batch}", round_)
    progress(f"yardstick: raw select -> publish_async -> mark ({count:,}, batch {batch})")
    db = overdue_db(run, label, count)
    async with Broker(run.scratch(label)) as broker:
        cpu = time.process_time()
        per_s, fired = await raw_pipeline(db, broker.url, batch)
        cpu = time.process_time() - cpu
        stored = await broker.stream_messages("TIMER_EVENTS")
    run.check(
        f"raw pipeline (batch {batch}) fired all",
        fired == count and stored == count,
        f"{fired:,} fired, {stored:,} events stored",
    )
    return {"per_s": per_s, "cpu_us_per_timer": round(1e6 * cpu / max(fired, 1), 1)}


async def fire_service(run: Run, batch: int, round_: int = 1) -> dict[str, Any]:
    """The service on the same timers: written while it idles, then one command wakes it.

    Timed from the first ``reachedAt`` to the moment none is left due; the service's CPU is
    counted from then on too, without its start-up.
    """
    count = run.sizes.fire
    label = round_name(f"fire-{batch}", round_)
    progress(f"fire path: {count:,} stored timers already due, batch {batch}")
    db = run.scratch(label) / "timer.db"
    create_db(db)
    async with Broker(run.scratch(label)) as broker:
        async with running_service(run, db, broker.url, batch_size=batch, label=label) as service:
            await service.wait_healthy()
            cpu = service.cpu_s()
            insert_overdue(db, label, count)
            await broker.send_schedules([("tenant-00", f"{label}-wake-up", now_ms())])
            done = await wait_until_none_due(db, within=60 + count / 500, what=label)
            cpu = service.cpu_s() - cpu
            metrics = await service.metrics()
            rss = service.peak_rss_mb()
        events = await broker.stream_messages("TIMER_EVENTS")
    fired = count + 1
    elapsed = done - first_reached_ms(db) / 1000
    counts = state_counts(db)
    passes = metrics.get("timer_polling_duration_seconds_count", 0.0)
    run.check(
        f"{label}: every due timer published once and marked Reached",
        counts.get("Reached", 0) == fired and events == fired,
        f"{counts.get('Reached', 0):,} Reached, {events:,} events in TIMER_EVENTS",
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
    """The service at the harness's batch size (the default, 100, unless ``--batch-size``)
    right after the yardstick at batches of 1,000, round after round, so both see the same
    machine.

    The round with the median ratio is reported (its service and its yardstick figures), and
    every round's ratio is kept beside it.
    """
    batch = run.batch_size
    rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for round_ in range(1, run.rounds + 1):
        load = round(os.getloadavg()[0], 2)
        yardstick = await fire_raw(run, RAW_BATCH, round_)
        measured = await fire_service(run, batch, round_)
        measured["vs_raw"] = round(measured["per_s"] / yardstick["per_s"], 2)
        measured["load"] = load
        rounds.append((yardstick, measured))
        drop_scratch(run, f"raw-pipeline-{RAW_BATCH}", f"fire-{batch}", round_=round_)
    yardstick, measured = median_against_yardstick(rounds)
    run.results["fire"] = {str(batch): measured}
    run.results.setdefault("yardsticks", {})["raw_pipeline"] = {str(RAW_BATCH): yardstick}


def median_round(rounds: list[Any], key: Callable[[Any], float]) -> Any:
    """The round whose ``key`` is the median (the lower middle one of an even count)."""
    ordered = sorted(rounds, key=key)
    return ordered[(len(ordered) - 1) // 2]


def median_against_yardstick(
    rounds: list[tuple[dict[str, Any], dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (yardstick, measured) round with the median ratio to its yardstick; with more than
    one round, each round's ratio, load and rates are kept beside it."""
    yardstick, measured = median_round(rounds, key=lambda pair: pair[1]["vs_raw"])
    if len(rounds) > 1:
        measured["rounds_vs_raw"] = [pair[1]["vs_raw"] for pair in rounds]
        measured["rounds_load"] = [pair[1]["load"] for pair in rounds]
        measured["rounds_per_s"] = [pair[1]["per_s"] for pair in rounds]
        yardstick["rounds_per_s"] = [pair[0]["per_s"] for pair in rounds]
    return yardstick, measured


def round_name(name: str, round_: int) -> str:
    """The scratch directory (and label) of ``name`` in a round: the first keeps the name."""
    return name if round_ == 1 else f"{name}-r{round_}"


def drop_scratch(run: Run, *names: str, round_: int) -> None:
    """Delete a finished round's databases and broker files (a full run makes gigabytes)."""
    for name in names:
        shutil.rmtree(run.workdir / round_name(name, round_), True)


# -- storm -----------------------------------------------------------------------------------


async def scenario_storm(run: Run) -> None:
    """Timers written while the service idles, all due at one instant a few seconds ahead.

    A ``ScheduleTimer`` due at that instant, sent once they are written, makes the idle
    worker read its next due time again (it would otherwise only look at its next poll).
    """
    count = run.sizes.storm
    progress(f"storm: {count:,} timers due at the same instant")
    db = run.scratch("storm") / "timer.db"
    create_db(db)
    async with Broker(run.scratch("storm")) as broker:
        async with running_service(
            run, db, broker.url, batch_size=run.batch_size, label="storm"
        ) as service:
            await service.wait_healthy()
            due = now_ms() + (5000 if count > 10_000 else 2000)
            insert_rows(
                db,
                timer_rows(count, prefix="storm", due_ms=lambda i: due, registered_ms=now_ms()),
                rebuild_indexes=False,
            )
            await broker.send_schedules([("tenant-00", "storm-wake-up", due)])
            ready_before_ms = due - now_ms()
            cpu = service.cpu_s()
            all_readable = math.nan
            deadline = time.monotonic() + 60 + count / 500
            while math.isnan(all_readable):
                if now_ms() >= due and await broker.stream_messages("TIMER_EVENTS") > count:
                    all_readable = time.time()
                elif time.monotonic() > deadline:
                    raise CheckFailed("storm: events missing")
                else:
                    await asyncio.sleep(0.02)
            done = await wait_until_none_due(db, within=60, what="storm")
            cpu = service.cpu_s() - cpu
            rss = service.peak_rss_mb()
        events = await broker.stream_messages("TIMER_EVENTS")
    lateness, early = reached_lateness(db)
    fired = count + 1
    run.check(
        "storm: nothing lost, nothing early",
        len(lateness) == fired and events == fired and early == 0,
        f"{len(lateness):,} Reached, {events:,} events, {early} early",
    )
    run.check(
        "storm: written and announced before the instant",
        ready_before_ms > 0,
        f"{ready_before_ms} ms to spare",
    )
    run.results["storm"] = {
        "timers": fired,
        "fire_all_s": round(done - due / 1000, 3),
        "all_readable_s": round(all_readable - due / 1000, 3),
        "per_s": rate(fired, done - due / 1000),
        "reached_lateness": percentiles(lateness),
        "cpu_us_per_timer": round(1e6 * cpu / fired, 1),
        "peak_rss_mb": rss,
    }


# -- steady lateness -------------------------------------------------------------------------


async def scenario_steady(run: Run) -> None:
    sizes = run.sizes
    per_tick, tick = max(1, sizes.steady_rate // 100), 0.01
    ticks = int(sizes.steady_s / tick)
    progress(
        f"steady lateness: {sizes.steady_rate:,} timers/s due at random moments "
        f"for {sizes.steady_s:.0f}s (scheduled 1-2 s ahead, through TIMER_COMMANDS)"
    )
    db = run.scratch("steady") / "timer.db"
    create_db(db)
    readable: dict[str, float] = {}
    fired: dict[str, float] = {}
    early = 0

    async with Broker(run.scratch("steady")) as broker:

        async def on_event(message: Msg) -> None:
            nonlocal early
            seen = time.time_ns() / 1e6
            payload = json.loads(message.data)["payload"]
            due = epoch_ms(payload["dueAt"])
            reached = epoch_ms(payload["reachedAt"])
            key = payload["serviceCallId"]
            readable[key] = seen - due
            fired[key] = float(reached - due)
            early += reached < due

        js = broker.client.jetstream(timeout=10)
        subscription = await js.subscribe(
            "timer.events.>",
            stream="TIMER_EVENTS",
            cb=on_event,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )
        sender = TimerClient(broker.client, publish_window=512)
        async with running_service(
            run, db, broker.url, batch_size=run.batch_size, label="steady"
        ) as service:
            await service.wait_healthy()
            loop = asyncio.get_running_loop()
            sent = 0
            started = loop.time()
            for n in range(ticks):
                await asyncio.sleep(max(0.0, started + n * tick - loop.time()))
                base = now_ms()
                envelopes = [
                    sender.schedule_envelope(
                        f"tenant-{(sent + i) % TENANTS:02d}",
                        f"steady-{sent + i:08d}",
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
                await asyncio.sleep(0.05)
            metrics = await service.metrics()
            rss = service.peak_rss_mb()
        await subscription.unsubscribe()
    run.check(
        "steady: every timer fired, none early",
        len(readable) == sent and early == 0,
        f"{len(readable):,} of {sent:,} events read, {early} early",
    )
    run.results["steady"] = {
        "timers": sent,
        "rate_per_s": sizes.steady_rate,
        "seconds": sizes.steady_s,
        "reached_lateness": percentiles(list(fired.values())),
        "readable_lateness": percentiles(list(readable.values())),
        "commands_stored": metrics.get('timer_commands_received_total{outcome="stored"}'),
        "peak_rss_mb": rss,
    }


# -- catch-up --------------------------------------------------------------------------------


def big_template(run: Run) -> Path:
    """A database of ``catchup_stored - catchup_overdue`` timers due over the coming days."""
    template = run.workdir / "template-big.db"
    if template.exists():
        return template
    count = run.sizes.catchup_stored - run.sizes.catchup_overdue
    progress(f"building a database of {count:,} future timers")
    create_db(template)
    base = now_ms() + 86_400_000
    insert_rows(
        template,
        timer_rows(
            count,
            prefix="future",
            due_ms=lambda i: base + random.randrange(86_400_000),
            registered_ms=now_ms(),
        ),
        rebuild_indexes=True,
    )
    return template


async def scenario_catchup(run: Run) -> Path:
    sizes = run.sizes
    template = big_template(run)
    progress(
        f"catch-up: {sizes.catchup_stored:,} stored, {sizes.catchup_overdue:,} overdue "
        "after a downtime"
    )
    db = run.scratch("catchup") / "timer.db"
    copy_db(template, db)
    overdue = sizes.catchup_overdue
    base = now_ms() - 3_600_000
    # Random due times over the last hour, inserted in random order.
    insert_rows(
        db,
        timer_rows(
            overdue,
            prefix="overdue",
            due_ms=lambda i: base + random.randrange(3_599_000),
            registered_ms=base - 1000,
        ),
        rebuild_indexes=False,
    )
    async with Broker(run.scratch("catchup")) as broker:
        async with running_service(
            run, db, broker.url, batch_size=run.batch_size, label="catchup"
        ) as service:
            done = await wait_until_none_due(db, within=60 + overdue / 500, what="catch-up")
            rss = service.peak_rss_mb()
        events = await broker.read_events(overdue)
        stored = await broker.stream_messages("TIMER_EVENTS")
    elapsed = done - first_reached_ms(db) / 1000
    counts = state_counts(db)
    dues = [event["payload"]["dueAt"] for event in events]
    # Each tenant's timers in due order: when more is due than a batch, the batches are
    # shared among the tenants (fairness), so the tenants interleave, each in its own order.
    by_tenant: dict[str, list[str]] = {}
    for event in events:
        by_tenant.setdefault(event["payload"]["tenantId"], []).append(event["payload"]["dueAt"])
    out_of_order = sum(1 for own in by_tenant.values() for a, b in itertools.pairwise(own) if b < a)
    across = sum(1 for a, b in itertools.pairwise(dues) if b < a)
    ids = {event["id"] for event in events}
    run.check(
        "catch-up: every overdue timer fired once, the future ones untouched",
        counts.get("Reached", 0) == overdue
        and counts.get("Scheduled", 0) == sizes.catchup_stored - overdue
        and stored == overdue
        and len(ids) == overdue,
        f"{counts.get('Reached', 0):,} Reached, {counts.get('Scheduled', 0):,} Scheduled, "
        f"{stored:,} events ({len(ids):,} distinct ids)",
    )
    run.check(
        "catch-up: drained in due order",
        out_of_order == 0 and len(dues) == overdue,
        f"{out_of_order} of {len(dues):,} events earlier-due than their tenant's one before "
        f"them ({across:,} across tenants, the fair sharing of batches)",
    )
    run.results["catchup"] = {
        "stored": sizes.catchup_stored,
        "overdue": overdue,
        "drain_s": round(elapsed, 2),
        "per_s": rate(overdue, elapsed),
        "peak_rss_mb": rss,
    }
    return db


# -- scale -----------------------------------------------------------------------------------


async def poll_costs(dbs: dict[str, Path], batch: int, samples: int) -> dict[str, dict[str, float]]:
    """The worker's per-pass store calls on each database, through the real ``SqliteTimerStore``.

    ``empty_poll_us``: ``find_due`` with nothing due plus ``next_due_at`` (an idle pass);
    ``find_due_us``: ``find_due`` returning a full batch of due timers. Medians, the stores'
    samples taken in turn so both see the same moments of the machine.
    """
    stores = {label: SqliteTimerStore(db) for label, db in dbs.items()}
    for store in stores.values():
        await store.start()
    try:
        # A batch of timers due a minute ago, to time a full find_due (never marked).
        due = now_ms() - 60_000
        for store in stores.values():
            await store.apply(
                [
                    TimerEntry(
                        tenant_id=f"tenant-{i % TENANTS:02d}",
                        service_call_id=f"poll-{i:06d}",
                        due_at=from_epoch_ms(due + i),
                        registered_at=from_epoch_ms(due - 1000),
                    )
                    for i in range(batch)
                ]
            )
        before_due, busy = from_epoch_ms(due - 1), datetime.now(UTC)
        for store in stores.values():
            for _ in range(20):
                await store.find_due(busy, batch)
        empty: dict[str, list[float]] = {label: [] for label in stores}
        full: dict[str, list[float]] = {label: [] for label in stores}
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
        return {
            label: {
                "empty_poll_us": round(statistics.median(empty[label]), 1),
                "find_due_us": round(statistics.median(full[label]), 1),
            }
            for label in stores
        }
    finally:
        for store in stores.values():
            await store.aclose()


async def scenario_scale(run: Run, big_db: Path | None) -> None:
    """Small and big store in turn: the schedule path ``run.rounds`` times on each (medians),
    then their poll costs sampled alternately."""
    sizes = run.sizes
    small_template = run.scratch("scale-small-template") / "timer.db"
    create_db(small_template)
    base = now_ms() + 86_400_000
    insert_rows(
        small_template,
        timer_rows(
            sizes.scale_small,
            prefix="small",
            due_ms=lambda i: base + random.randrange(86_400_000),
            registered_ms=now_ms(),
        ),
        rebuild_indexes=False,
    )
    if big_db is None:
        big_db = run.scratch("scale-big") / "timer.db"
        copy_db(big_template(run), big_db)
    stored = {"small": sizes.scale_small, "big": sum(state_counts(big_db).values())}
    rounds: dict[str, list[dict[str, Any]]] = {"small": [], "big": []}
    for round_ in range(1, run.rounds + 1):
        # A fresh small store each round (10,000 stays 10,000); the big one takes 20,000
        # more per round, nothing to a million. The last round's small store stays for
        # the poll costs.
        if round_ > 1:
            drop_scratch(run, "scale-small", round_=round_ - 1)
        small = run.scratch(round_name("scale-small", round_)) / "timer.db"
        copy_db(small_template, small)
        for label, db in (("small", small), ("big", big_db)):
            progress(
                f"scale: {sizes.scale_commands:,} commands into {stored[label]:,} stored timers"
            )
            name = round_name(f"scale-{label}", round_)
            async with Broker(run.scratch(name)) as broker:
                rounds[label].append(
                    await measure_schedule_path(run, db, broker, sizes.scale_commands, label=name)
                )
    progress(f"scale: poll cost, {sizes.poll_samples} samples of each store in turn")
    costs = await poll_costs({"small": small, "big": big_db}, run.batch_size, sizes.poll_samples)
    out: dict[str, Any] = {}
    for label in ("small", "big"):
        result = median_round(rounds[label], key=lambda r: r["per_s"])
        if len(rounds[label]) > 1:
            result["rounds_per_s"] = [r["per_s"] for r in rounds[label]]
        result.update(costs[label])
        result["stored"] = stored[label]
        out[label] = result
    run.results["scale"] = out


async def run_scenarios(run: Run, only: set[str]) -> None:
    """Run the scenarios named in ``only``, in their fixed order."""
    big_db: Path | None = None
    if "yardsticks" in only:
        await scenario_yardsticks(run)
    if "schedule" in only:
        await scenario_schedule(run)
    if "fire" in only:
        await scenario_fire(run)
    if "storm" in only:
        await scenario_storm(run)
    if "steady" in only:
        await scenario_steady(run)
    if "catchup" in only:
        big_db = await scenario_catchup(run)
    if "scale" in only:
        await scenario_scale(run, big_db)
