"""What keeping "acked means on disk" at the defaults costs (issue 28), beside the old default.

SQLite: the store at its default (``synchronous=FULL`` for commits that store commands, marks
at ``NORMAL``) against ``synchronous="NORMAL"`` for everything (the old default). PostgreSQL,
on a server with ``fsync=on`` and ``synchronous_commit=off`` (a server default the store used
to inherit): the store as it is (its command connections raise ``synchronous_commit`` to
``on``) against the same store with that raise turned off. Every round runs both, in
alternating order (old, new; then new, old), each on a fresh database in a directory of the
real disk (fsync on tmpfs would cost nothing); the figure is the median of the per-round
ratios new / old.

    flock /tmp/timer-bench.lock uv run --all-packages python bench/durability.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # the tests' throwaway PostgreSQL cluster

import timer_adapters_postgres._store as postgres_store  # noqa: E402
from tests.pg import PostgresCluster, start_cluster  # noqa: E402
from timer_adapters_postgres import PostgresTimerStore  # noqa: E402
from timer_adapters_sqlite import SqliteTimerStore  # noqa: E402
from timer_core import TimerEntry, TimerStore  # noqa: E402

T0 = datetime(2030, 1, 1, tzinfo=UTC)
RESULTS = _HERE / "results" / "durability.json"
#: The server default the store used to inherit, on an otherwise durable server.
POSTGRES = {"fsync": "on", "synchronous_commit": "off", "full_page_writes": "on"}
BATCHED = 20_000
ONE_BY_ONE = 400
CALLERS = 100
FIRED = 10_000


def entries(count: int, prefix: str) -> list[TimerEntry]:
    return [
        TimerEntry(f"tenant-{i % 50}", f"{prefix}-{i:07d}", T0 + timedelta(milliseconds=i), T0)
        for i in range(count)
    ]


async def batches_of_1000(store: TimerStore) -> float:
    """Timers/s stored by one apply per 1,000 (the service's command batch)."""
    timers = entries(BATCHED, "batch")
    started = time.perf_counter()
    for chunk in range(0, BATCHED, 1000):
        await store.apply(timers[chunk : chunk + 1000])
    return BATCHED / (time.perf_counter() - started)


async def one_by_one(store: TimerStore) -> float:
    """Timers/s stored by one caller, one timer per apply (a commit, and a sync, each)."""
    timers = entries(ONE_BY_ONE, "single")
    started = time.perf_counter()
    for timer in timers:
        await store.apply([timer])
    return ONE_BY_ONE / (time.perf_counter() - started)


async def concurrent_callers(store: TimerStore) -> float:
    """Timers/s stored by 100 concurrent callers of one timer each (group commits)."""
    timers = entries(BATCHED, "callers")
    queue = iter(timers)

    async def caller() -> None:
        for timer in queue:
            await store.apply([timer])

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return BATCHED / (time.perf_counter() - started)


async def fire(store: TimerStore) -> float:
    """Timers/s found due and marked Reached, 100 per batch (the worker's store calls)."""
    for chunk in range(0, FIRED, 1000):
        await store.apply(entries(FIRED, "due")[chunk : chunk + 1000])
    now = T0 + timedelta(days=1)
    started = time.perf_counter()
    while due := await store.find_due(now, 100):
        await store.mark_reached([entry.reach(now) for entry in due])
    return FIRED / (time.perf_counter() - started)


Measure = Callable[[TimerStore], Awaitable[float]]
SQLITE_MEASURES: dict[str, Measure] = {
    "schedule, batches of 1,000": batches_of_1000,
    "schedule, 100 concurrent callers": concurrent_callers,
    "schedule, 1 caller, 1 timer per commit": one_by_one,
    "fire: find due + mark, batches of 100": fire,
}
POSTGRES_MEASURES: dict[str, Measure] = {
    "schedule, batches of 1,000": batches_of_1000,
    "schedule, 1 caller, 1 timer per commit": one_by_one,
    "fire: claim + mark, batches of 100": fire,
}


async def sqlite_run(where: Path, measure: Measure, durable: bool) -> float:
    path = where / f"timer-{time.monotonic_ns()}.db"
    options = {} if durable else {"synchronous": "NORMAL"}
    try:
        async with SqliteTimerStore(path, watch_interval_s=None, **options) as store:  # type: ignore[arg-type]
            return await measure(store)
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}{suffix}")


async def postgres_run(cluster: PostgresCluster, measure: Measure, durable: bool) -> float:
    name = f"durability_{time.monotonic_ns()}"
    url = cluster.create_database(name)
    # The old behaviour: no raise of synchronous_commit on the store's connections.
    saved = postgres_store._SYNCHRONOUS_COMMIT
    if not durable:
        postgres_store._SYNCHRONOUS_COMMIT = "SELECT 1"
    try:
        async with PostgresTimerStore(url, listen=False, pool_size=2) as store:
            return await measure(store)
    finally:
        postgres_store._SYNCHRONOUS_COMMIT = saved
        cluster.drop_database(name)


async def alternate(
    rounds: int, run: Callable[[Measure, bool], Awaitable[float]], measures: dict[str, Measure]
) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {name: {"old": [], "new": []} for name in measures}
    for number in range(rounds):
        for name, measure in measures.items():
            order = (False, True) if number % 2 == 0 else (True, False)
            for durable in order:
                rate = await run(measure, durable)
                results[name]["new" if durable else "old"].append(rate)
            print(
                f"round {number + 1} {name}: old {results[name]['old'][-1]:,.0f}/s, "
                f"new {results[name]['new'][-1]:,.0f}/s",
                flush=True,
            )
    return results


def table(title: str, results: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        f"| {title} | old default (median) | new default (median) "
        "| new / old, median of rounds (each round) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        ratios = [new / old for old, new in zip(runs["old"], runs["new"], strict=True)]
        each = " / ".join(f"{ratio:.2f}" for ratio in ratios)
        lines.append(
            f"| {name} | {statistics.median(runs['old']):,.0f}/s | "
            f"{statistics.median(runs['new']):,.0f}/s | "
            f"**{statistics.median(ratios):.2f}** ({each}) |"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    disk = Path(tempfile.mkdtemp(prefix="timer-durability-", dir=_HERE.parent))
    pg_root = Path(tempfile.mkdtemp(prefix="timer-durability-pg-"))
    cluster = start_cluster(pg_root, POSTGRES)
    try:
        sqlite = await alternate(args.rounds, lambda m, d: sqlite_run(disk, m, d), SQLITE_MEASURES)
        postgres = await alternate(
            args.rounds, lambda m, d: postgres_run(cluster, m, d), POSTGRES_MEASURES
        )
    finally:
        cluster.stop()
        shutil.rmtree(pg_root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    load_after = os.getloadavg()
    machine = (
        f"nproc {os.cpu_count()}, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}; load average {', '.join(f'{x:.2f}' for x in load_before)} "
        f"at the start, {', '.join(f'{x:.2f}' for x in load_after)} at the end"
    )
    print()
    print(table("SQLite (old: `synchronous=NORMAL`; new: the default)", sqlite))
    print()
    print(table("PostgreSQL, server `synchronous_commit=off` (old: inherited)", postgres))
    print()
    print(f"{args.rounds} rounds, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine}")
    RESULTS.write_text(
        json.dumps(
            {"rounds": args.rounds, "machine": machine, "sqlite": sqlite, "postgres": postgres},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    asyncio.run(main())
