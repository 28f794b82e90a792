"""What "acknowledged means on disk, across a power loss" costs at the defaults, beside the
old defaults, in alternated rounds.

SQLite: the store's default (``synchronous="FULL"``: the commits that store commands synced
before ``apply`` returns, by a syncer thread; marks and purges unsynced) against
``synchronous="NORMAL"`` for everything (the old default). PostgreSQL, on a server with
``fsync=on`` and ``synchronous_commit=off`` (a server default the store used to inherit):
the store as it is (its command connections raise ``synchronous_commit`` to ``on``) against
the same store without the raise, which is the old behaviour and exists only here (the
store's private statement is swapped for a no-op). Each side runs on a fresh database in a
directory of the real disk (the kit's scratch directory beside the repository: fsync on a
tmpfs would cost nothing). NATS: the embedded ``nats-server``'s default, every write forced to
disk before its acknowledgement (``sync_interval: always``), against nats-server's own default
(a sync every two minutes, the old embedded server), publishing ``DueTimeReached`` envelopes
as the worker does, on a fresh server per side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import timer_adapters_postgres._connections as postgres_store
from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit, procs
from timer_bench.publish import firings
from timer_bench.store import T0
from timer_bench.store import entries as store_timers
from timer_core import TimerEntry, TimerStore

#: The server default the store used to inherit, on an otherwise durable server.
POSTGRES = {"fsync": "on", "synchronous_commit": "off", "full_page_writes": "on"}
SIDES = ("old", "new")

Measure = Callable[[TimerStore, int], Awaitable[float]]


def entries(count: int, prefix: str) -> list[TimerEntry]:
    """The store scenario's timers, due a millisecond apart, without correlation ids."""
    return store_timers(count, prefix, spacing_ms=1, correlated=False)


async def batches_of_1000(store: TimerStore, count: int) -> float:
    """Timers/s stored by one apply per 1,000 (the service's command batch)."""
    timers = entries(count, "batch")
    watch = kit.Stopwatch()
    for start in range(0, count, 1000):
        await store.apply(timers[start : start + 1000])
    return kit.rate(count, watch.elapsed())


async def concurrent_callers(store: TimerStore, count: int) -> float:
    """Timers/s stored by 100 concurrent callers of one timer each (shared commits)."""
    queue = iter(entries(count, "callers"))

    async def caller() -> None:
        for timer in queue:
            await store.apply([timer])

    watch = kit.Stopwatch()
    await asyncio.gather(*(caller() for _ in range(100)))
    return kit.rate(count, watch.elapsed())


async def one_by_one(store: TimerStore, count: int) -> float:
    """Timers/s stored by one caller, one timer per apply (a commit, and a sync, each)."""
    timers = entries(count // 50, "single")
    watch = kit.Stopwatch()
    for timer in timers:
        await store.apply([timer])
    return kit.rate(len(timers), watch.elapsed())


async def fire(store: TimerStore, count: int) -> float:
    """Timers/s found due and marked Reached, 100 per batch (the worker's store calls)."""
    due = entries(count // 2, "due")
    for start in range(0, len(due), 1000):
        await store.apply(due[start : start + 1000])
    now = T0 + timedelta(days=1)
    watch = kit.Stopwatch()
    while found := await store.find_due(now, 100):
        await store.mark_reached([entry.reach(now) for entry in found])
    return kit.rate(len(due), watch.elapsed())


MEASURES: dict[str, dict[str, Measure]] = {
    "sqlite": {
        "schedule, batches of 1,000": batches_of_1000,
        "schedule, 100 concurrent callers": concurrent_callers,
        "schedule, 1 caller, 1 timer per commit": one_by_one,
        "fire: find due + mark, batches of 100": fire,
    },
    "postgres": {
        "schedule, batches of 1,000": batches_of_1000,
        "schedule, 1 caller, 1 timer per commit": one_by_one,
        "fire: claim + mark, batches of 100": fire,
    },
}


async def publish_batches_of_100(broker: NatsBroker, count: int) -> float:
    """Events/s published in batches of 100, each batch's acknowledgements awaited (the
    worker's firing batch)."""
    events = firings(count)
    watch = kit.Stopwatch()
    for start in range(0, count, 100):
        results = await broker.publisher.publish_many(events[start : start + 100])
        assert all(result is None for result in results), results
    return kit.rate(count, watch.elapsed())


async def publish_one_by_one(broker: NatsBroker, count: int) -> float:
    """Events/s published one at a time, each acknowledgement awaited before the next."""
    events = firings(count // 50)
    watch = kit.Stopwatch()
    for event in events:
        await broker.publisher.publish(event)
    return kit.rate(len(events), watch.elapsed())


NATS_MEASURES: dict[str, Callable[[NatsBroker, int], Awaitable[float]]] = {
    "publish DueTimeReached, batches of 100": publish_batches_of_100,
    "publish DueTimeReached, 1 at a time": publish_one_by_one,
}


async def nats_side(
    disk: Path, measure: Callable[[NatsBroker, int], Awaitable[float]], side: str, count: int
) -> float:
    where = Path(tempfile.mkdtemp(dir=disk))
    server = NatsServerProcess(where / "nats", sync_always=side == "new")
    await asyncio.to_thread(server.start)
    try:
        async with NatsBroker(NatsSettings(url=server.url)) as broker:
            return await measure(broker, count)
    finally:
        await asyncio.to_thread(server.stop)
        shutil.rmtree(where, ignore_errors=True)


@contextlib.contextmanager
def old_postgres_commits(old: bool) -> Iterator[None]:
    """Without the store's raise of ``synchronous_commit`` when ``old``."""
    saved = postgres_store._SYNCHRONOUS_COMMIT
    if old:
        postgres_store._SYNCHRONOUS_COMMIT = "SELECT 1"
    try:
        yield
    finally:
        postgres_store._SYNCHRONOUS_COMMIT = saved


async def sqlite_side(disk: Path, measure: Measure, side: str, count: int) -> float:
    where = Path(tempfile.mkdtemp(dir=disk))
    options: dict[str, Any] = {"synchronous": "NORMAL"} if side == "old" else {}
    try:
        async with SqliteTimerStore(where / "timer.db", watch_interval_s=None, **options) as store:
            return await measure(store, count)
    finally:
        shutil.rmtree(where, ignore_errors=True)


async def postgres_side(cluster: Any, measure: Measure, side: str, count: int) -> float:
    name = f"durability_{kit.now_ms()}"
    url = cluster.create_database(name)
    try:
        with old_postgres_commits(side == "old"):
            async with PostgresTimerStore(url, listen=False, pool_size=2) as store:
                return await measure(store, count)
    finally:
        cluster.drop_database(name)


def _sides(taken: list[dict[str, float]]) -> dict[str, Any]:
    old, new = [one["old"] for one in taken], [one["new"] for one in taken]
    return {
        "old": old,
        "new": new,
        "new_vs_old": kit.median_ratio(new, old),
        "rounds": kit.ratios(new, old),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="2,000 timers a measure, 1 round")
    parser.add_argument("--rounds", type=int, default=5)


def main(args: argparse.Namespace) -> int:
    count, rounds = (2_000, 1) if args.quick else (20_000, args.rounds)
    machine = kit.machine(
        postgres=procs.postgres_version(), nats_server=procs.nats_server_version()
    )
    # A directory on the repository's disk, not /tmp (a tmpfs on some machines).
    disk = Path(tempfile.mkdtemp(prefix="durability-", dir=kit.RESULTS.parent))
    results: dict[str, dict[str, Any]] = {}
    try:
        with procs.postgres(POSTGRES) as cluster:
            for store, measures in MEASURES.items():
                for name, measure in measures.items():
                    kit.progress(f"{store}: {name}")

                    async def side(
                        which: str, _: int, measure: Measure = measure, store: str = store
                    ) -> float:
                        if store == "sqlite":
                            return await sqlite_side(disk, measure, which, count)
                        return await postgres_side(cluster, measure, which, count)

                    taken = asyncio.run(kit.alternated(rounds, SIDES, side))
                    results.setdefault(store, {})[name] = _sides(taken)
            for name, nats_measure in NATS_MEASURES.items():
                kit.progress(f"nats: {name}")

                async def nats(which: str, _: int, measure: Any = nats_measure) -> float:
                    return await nats_side(disk, measure, which, count)

                taken = asyncio.run(kit.alternated(rounds, SIDES, nats))
                results.setdefault("nats", {})[name] = _sides(taken)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {"timers": count, "rounds": rounds, "postgres_server": POSTGRES},
        "results": results,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import durability_block

    print(durability_block(document))
    return 0
