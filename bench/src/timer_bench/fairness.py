"""Tenant fairness on the SQLite store: one tenant schedules a storm of timers due at one
instant, a quiet tenant 20 due at that instant and over the 2 s after it (in plain due order
it would come last). A ``TimerWorker`` on the real clock fires them into an in-memory bus, so
the store and the worker are what is measured; lateness is taken on the wall clock as the
bus receives each event. Then the fire rate of an overdue backlog over 1 and over 50
tenants (the sharing of batches costs a second statement per batch)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from timer_adapters_memory import MemoryEventBus
from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit
from timer_bench.watched import WatchedPublisher
from timer_core import TimerEntry

STORM, QUIET = "a-storm", "z-quiet"  # the storm's tenant sorts first


async def storm(path: Path, size: int, batch: int) -> dict[str, float]:
    def timer(tenant: str, call: str, due: datetime) -> TimerEntry:
        return TimerEntry(tenant_id=tenant, service_call_id=call, due_at=due, registered_at=now)

    async with SqliteTimerStore(path) as store:
        now = datetime.now(UTC)
        due = now + timedelta(seconds=3 + size / 10_000)
        for start in range(0, size, 1000):
            await store.apply(
                [timer(STORM, f"s{i:06d}", due) for i in range(start, min(size, start + 1000))]
            )
        await store.apply(
            [timer(QUIET, f"q{i:02d}", due + timedelta(seconds=2 * i / 19)) for i in range(20)]
        )
        if datetime.now(UTC) >= due:
            raise SystemExit("storing the storm took longer than its head start; run again")
        bus = WatchedPublisher(MemoryEventBus(), size + 20)
        await bus.fire_all(store, batch=batch)
    late: dict[str, list[float]] = {QUIET: [], STORM: []}
    for received, envelope in bus.received:
        late[str(envelope.payload.tenant_id)].append(received - envelope.payload.due_at.timestamp())
    quiet, loud = sorted(late[QUIET]), sorted(late[STORM])
    return {
        "quiet_p50_s": round(kit.median(quiet), 3),
        "quiet_max_s": round(quiet[-1], 3),
        "storm_p50_s": round(kit.median(loud), 3),
        "storm_drained_s": round(loud[-1], 3),
    }


async def fire_rate(path: Path, size: int, tenants: int, batch: int) -> float:
    """Timers/s of a worker draining ``size`` overdue timers over ``tenants`` tenants."""
    due = datetime.now(UTC) - timedelta(hours=1)
    async with SqliteTimerStore(path) as store:
        for start in range(0, size, 1000):
            await store.apply(
                [
                    TimerEntry(
                        tenant_id=f"tenant-{i % tenants:03d}",
                        service_call_id=f"c{i:07d}",
                        due_at=due + timedelta(milliseconds=i),
                        registered_at=due,
                    )
                    for i in range(start, min(size, start + 1000))
                ]
            )
        bus = WatchedPublisher(MemoryEventBus(), size)
        return kit.rate(size, await bus.fire_all(store, batch=batch))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="5,000 timers each")
    parser.add_argument("--storm", type=int, default=50_000, help="timers of the storm")
    parser.add_argument("--fire", type=int, default=20_000, help="backlog of the fire rate")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="fire-rate rounds")


def main(args: argparse.Namespace) -> int:
    size, backlog = (5_000, 5_000) if args.quick else (args.storm, args.fire)
    machine = kit.machine()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        figures: dict[str, Any] = asyncio.run(storm(root / "storm.db", size, args.batch_size))

        async def measure(tenants: str, round_: int) -> float:
            db = root / f"fire-{tenants}-{round_}.db"
            return await fire_rate(db, backlog, int(tenants), args.batch_size)

        taken = asyncio.run(kit.alternated(args.rounds, ["1", "50"], measure))
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {
            "storm": size,
            "quiet": 20,
            "fire": backlog,
            "batch_size": args.batch_size,
            "rounds": args.rounds,
            "store": "SQLite (WAL, the default `synchronous=FULL`)",
        },
        "storm": figures,
        "fire_rounds_per_s": taken,
        "fire_per_s": {
            tenants: kit.median(one[tenants] for one in taken) for tenants in ("1", "50")
        },
    }
    kit.write_result(document, args.output)
    from timer_bench.render import fairness_block

    print(fairness_block(document))
    return 0
