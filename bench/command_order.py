"""The SQLite store's write path with and without command positions (issue 15).

Batches of 100: 40,000 new timers, then 40,000 reschedules, then 40,000 cancels, each as
plain operations (in-process scheduling) or as PositionedOperations (commands from NATS,
held to command order: the upsert checks the key's tombstone, a cancel writes one). Median
of 3 rounds per mode.

    uv run --all-packages python bench/command_order.py
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import PositionedOperation, TimerEntry, TimerKey, TimerOperation

T0 = datetime(2030, 1, 1, tzinfo=UTC)
N, BATCH = 40_000, 100


def _entries(shift_ms: int) -> list[TimerEntry]:
    return [
        TimerEntry(
            tenant_id=f"tenant-{i % 50}",
            service_call_id=f"c-{i:08d}",
            due_at=T0 + timedelta(milliseconds=i * 37 + shift_ms),
            registered_at=T0,
            correlation_id=f"trace-{i:08d}",
        )
        for i in range(N)
    ]


async def _rates(positioned: bool) -> dict[str, float]:
    keys = [TimerKey(f"tenant-{i % 50}", f"c-{i:08d}") for i in range(N)]  # type: ignore[arg-type]
    steps: list[tuple[str, list[TimerEntry] | list[TimerKey]]] = [
        ("insert", _entries(0)),
        ("reschedule", _entries(5)),
        ("cancel", keys),
    ]
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        async with SqliteTimerStore(Path(scratch) / "t.db") as store:
            for number, (name, operations) in enumerate(steps):
                ops: list[TimerOperation] = list(operations)
                if positioned:
                    ops = [
                        PositionedOperation(op, number * N + i + 1, T0)
                        for i, op in enumerate(operations)
                    ]
                started = time.perf_counter()
                for start in range(0, N, BATCH):
                    await store.apply(ops[start : start + BATCH])
                rates[name] = N / (time.perf_counter() - started)
    return rates


def main() -> None:
    for positioned in (False, True):
        rounds = [asyncio.run(_rates(positioned)) for _ in range(3)]
        label = "positioned" if positioned else "plain"
        shown = ", ".join(
            f"{name} {statistics.median(r[name] for r in rounds):,.0f}/s" for name in rounds[0]
        )
        print(f"{label:>10}: {shown}")


if __name__ == "__main__":
    main()
