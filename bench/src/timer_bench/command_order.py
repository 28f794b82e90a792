"""The SQLite store's writes as plain operations (scheduling in-process) and as
``PositionedOperation`` (commands from NATS, held to command order: the upsert also looks
for the key's tombstone, a cancel writes one): new timers, reschedules and cancels in
batches of 100, the two modes alternated round by round."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit
from timer_core import PositionedOperation, TimerEntry, TimerKey, TimerOperation

T0 = datetime(2030, 1, 1, tzinfo=UTC)
BATCH = 100
STEPS = ("insert", "reschedule", "cancel")


def operations(count: int, step: int) -> list[TimerEntry | TimerKey]:
    if STEPS[step] == "cancel":
        return [TimerKey(f"tenant-{i % kit.TENANTS}", f"c-{i:08d}") for i in range(count)]  # type: ignore[arg-type]
    return [
        TimerEntry(
            tenant_id=f"tenant-{i % kit.TENANTS}",
            service_call_id=f"c-{i:08d}",
            due_at=T0 + timedelta(milliseconds=i * 37 + 5 * step),
            registered_at=T0,
            correlation_id=f"trace-{i:08d}",
        )
        for i in range(count)
    ]


async def rates(mode: str, count: int) -> dict[str, float]:
    """Each step's operations/s on a fresh store."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        async with SqliteTimerStore(Path(scratch) / "t.db") as store:
            for step, name in enumerate(STEPS):
                plain = operations(count, step)
                ops: list[TimerOperation] = list(plain)
                if mode == "positioned":
                    ops = [
                        PositionedOperation(op, step * count + i + 1, T0)
                        for i, op in enumerate(plain)
                    ]
                started = time.perf_counter()
                for start in range(0, count, BATCH):
                    await store.apply(ops[start : start + BATCH])
                out[name] = kit.rate(count, time.perf_counter() - started)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="4,000 of each")
    parser.add_argument("--rounds", type=int, default=3)


def main(args: argparse.Namespace) -> int:
    count = 4_000 if args.quick else 40_000
    machine = kit.machine()

    async def measure(mode: str, _: int) -> dict[str, float]:
        return await rates(mode, count)

    taken = asyncio.run(kit.alternated(args.rounds, ["plain", "positioned"], measure))
    result: dict[str, Any] = {
        mode: {step: kit.median(one[mode][step] for one in taken) for step in STEPS}
        for mode in ("plain", "positioned")
    }
    result["positioned_vs_plain"] = {
        step: kit.median_ratio(
            [one["positioned"][step] for one in taken], [one["plain"][step] for one in taken]
        )
        for step in STEPS
    }
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {"operations": count, "batch": BATCH, "rounds": args.rounds},
        "results": result,
        "rounds": taken,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import command_order_block

    print(command_order_block(document))
    return 0
