"""Tenant fairness under a storm, and the fire path's cost, on the SQLite store.

Storm: one tenant schedules 50,000 timers due at one instant; another tenant has 20 timers
due at that instant and in the 2 s after it. A TimerWorker on the real clock fires them
(into an in-memory bus, so the store and the worker are what is measured) and the lateness
of every publish is taken on the wall clock when the bus receives it.

Fire path: a drain of a backlog already due (one tenant, then 50 tenants), in timers/s.

    uv run --all-packages python bench/fairness.py            # full figure
    uv run --all-packages python bench/fairness.py --storm 5000 --fire 5000   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from timer_adapters_memory import FakeClock, MemoryEventBus
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import (
    DueTimeReached,
    MessageEnvelope,
    PublishError,
    SystemClock,
    TimerEntry,
    TimerWorker,
)
from timer_core.workflows import drain_due_timers

STORM = "a-storm"  # sorts before the quiet tenant: in plain due order it goes first
QUIET = "z-quiet"


class ClockedBus(MemoryEventBus):
    """A memory bus that notes the wall-clock time each envelope was received."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[float, MessageEnvelope[DueTimeReached]]] = []

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        results = await super().publish_many(envelopes)
        now = time.time()
        self.received += [(now, e) for e, r in zip(envelopes, results, strict=True) if r is None]
        return results


def _timer(tenant: str, call: str, due: datetime, registered: datetime) -> TimerEntry:
    return TimerEntry(tenant_id=tenant, service_call_id=call, due_at=due, registered_at=registered)


async def storm(path: Path, size: int, batch_size: int) -> dict[str, float]:
    """Lateness of the quiet tenant's and the storm's timers, in seconds."""
    async with SqliteTimerStore(path) as store:
        now = datetime.now(UTC)
        # Far enough ahead to store the storm first (timed below, and refused if too slow).
        due = now + timedelta(seconds=3 + size / 10_000)
        for start in range(0, size, 1000):
            await store.apply(
                [
                    _timer(STORM, f"s{i:06d}", due, now)
                    for i in range(start, min(size, start + 1000))
                ]
            )
        await store.apply(
            [
                _timer(QUIET, f"q{i:02d}", due + timedelta(seconds=2 * i / 19), now)
                for i in range(20)
            ]
        )
        if datetime.now(UTC) >= due:
            raise SystemExit("storing the storm took longer than its head start; run again")
        bus = ClockedBus()
        worker = TimerWorker(store, bus, SystemClock(), batch_size=batch_size)
        running = asyncio.create_task(worker.run())
        try:
            while len(bus.received) < size + 20:
                await asyncio.sleep(0.05)
        finally:
            worker.stop()
            await running
    late = {QUIET: [], STORM: []}  # type: dict[str, list[float]]
    for received, envelope in bus.received:
        payload = envelope.payload
        late[str(payload.tenant_id)].append(received - payload.due_at.timestamp())
    quiet, loud = sorted(late[QUIET]), sorted(late[STORM])
    return {
        "quiet p50": statistics.median(quiet),
        "quiet max": quiet[-1],
        "storm p50": statistics.median(loud),
        "storm max (drain time)": loud[-1],
    }


async def fire_rate(path: Path, size: int, tenants: int, batch_size: int) -> float:
    """Timers fired per second by drains of an already due backlog (fake clock)."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    async with SqliteTimerStore(path) as store:
        for start in range(0, size, 1000):
            await store.apply(
                [
                    _timer(
                        f"tenant-{i % tenants:03d}", f"c{i:07d}", t0 + timedelta(milliseconds=i), t0
                    )
                    for i in range(start, min(size, start + 1000))
                ]
            )
        clock, bus = FakeClock(t0 + timedelta(days=1)), MemoryEventBus()
        started = time.perf_counter()
        fired = 0
        while fired < size:
            fired += (await drain_due_timers(store, bus, clock, batch_size=batch_size)).fired
        return size / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storm", type=int, default=50_000, help="timers of the storm")
    parser.add_argument("--fire", type=int, default=20_000, help="backlog of the fire path")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="fire-path rounds (median)")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        figures = asyncio.run(storm(root / "storm.db", args.storm, args.batch_size))
        print(f"storm of {args.storm:,} timers, quiet tenant's 20 due in the same 2 s:")
        for name, seconds in figures.items():
            print(f"  {name:<24} {seconds:8.3f} s")
        for tenants in (1, 50):
            rates = [
                asyncio.run(
                    fire_rate(root / f"fire-{tenants}-{r}.db", args.fire, tenants, args.batch_size)
                )
                for r in range(args.rounds)
            ]
            print(
                f"fire path, {args.fire:,} due over {tenants} tenant(s): "
                f"{statistics.median(rates):,.0f} timers/s (median of {args.rounds})"
            )


if __name__ == "__main__":
    main()
