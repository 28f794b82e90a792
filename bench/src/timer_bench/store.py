"""``SqliteTimerStore`` against raw ``sqlite3`` doing the same work, repetitions interleaved:
batched schedules, 1/10/100 concurrent ``schedule`` callers, the poller's due query and mark
on a million stored timers, and the empty poll before and after."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit, sqlite
from timer_bench.sqlite import FIND_DUE, MARK_REACHED, NEXT_DUE, UPSERT, Row
from timer_core import TimerEntry

T0 = datetime(2030, 1, 1, tzinfo=UTC)
Measured = tuple[float, float]
"""Items per wall-clock second, and CPU microseconds per item (all threads)."""


def entries(
    count: int, prefix: str, *, spacing_ms: int = 37, correlated: bool = True
) -> list[TimerEntry]:
    """``count`` timers over :data:`kit.TENANTS` tenants, registered at :data:`T0` and due
    ``spacing_ms`` apart from it, with a correlation id each unless ``correlated=False``."""
    return [
        TimerEntry(
            tenant_id=f"tenant-{i % kit.TENANTS}",
            service_call_id=f"{prefix}-{i:08d}",
            due_at=T0 + timedelta(milliseconds=i * spacing_ms),
            registered_at=T0,
            correlation_id=f"trace-{i:08d}" if correlated else None,
        )
        for i in range(count)
    ]


def rows(timers: list[TimerEntry]) -> list[Row]:
    """The raw side's parameters, prepared up front."""
    return [
        (
            e.tenant_id,
            e.service_call_id,
            e.correlation_id,
            kit.stamp(int(e.due_at.timestamp() * 1000)),
            kit.stamp(int(e.registered_at.timestamp() * 1000)),
        )
        for e in timers
    ]


def measured(count: int, watch: kit.Stopwatch) -> Measured:
    return kit.rate(count, watch.elapsed()), watch.cpu_us_per(count)


async def store_batched(path: Path, timers: list[TimerEntry], batch: int) -> Measured:
    async with SqliteTimerStore(path) as store:
        watch = kit.Stopwatch()
        for start in range(0, len(timers), batch):
            await store.apply(timers[start : start + batch])
        return measured(len(timers), watch)


def raw_batched(path: Path, timers: list[TimerEntry], batch: int) -> Measured:
    prepared = rows(timers)
    watch = kit.Stopwatch()
    from timer_bench.yardsticks import upserts

    upserts(path, prepared, batch)
    return measured(len(timers), watch)


async def store_callers(path: Path, timers: list[TimerEntry], callers: int, sync: str) -> Measured:
    """``callers`` tasks each awaiting ``schedule`` in a loop."""
    async with SqliteTimerStore(path, synchronous=sync) as store:  # type: ignore[arg-type]

        async def caller(mine: list[TimerEntry]) -> None:
            for timer in mine:
                await store.schedule(timer)

        watch = kit.Stopwatch()
        await asyncio.gather(*(caller(timers[i::callers]) for i in range(callers)))
        return measured(len(timers), watch)


def raw_row_per_commit(path: Path, timers: list[TimerEntry], sync: str) -> Measured:
    """One row per transaction: what an unbatched writer does even without a thread hop."""
    prepared = rows(timers)
    connection = sqlite.connect(path, sync)
    try:
        watch = kit.Stopwatch()
        for row in prepared:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(UPSERT, row)
            connection.execute("COMMIT")
        return measured(len(timers), watch)
    finally:
        connection.close()


def populate(path: Path, total: int, due: int) -> datetime:
    """``total`` Scheduled timers, the first ``due`` of them due at the returned instant."""
    start = T0 - timedelta(days=1)
    now = start + timedelta(milliseconds=due * 10)
    base, now_ms = int(start.timestamp() * 1000), int(now.timestamp() * 1000)

    def due_ms(i: int) -> int:
        return base + i * 10 if i < due else now_ms + 1000 * (1 + (i * 7919) % 10_000_000)

    sqlite.insert_rows(
        path,
        sqlite.timer_rows(total, prefix="call", due_ms=due_ms, registered_ms=base),
        rebuild_indexes=True,
    )
    return now


async def store_drain(path: Path, now: datetime, batch: int) -> Measured:
    """find_due, reach, mark_reached until nothing is due (the worker's store calls)."""
    async with SqliteTimerStore(path) as store:
        fired = 0
        watch = kit.Stopwatch()
        while due := await store.find_due(now, batch):
            fired += await store.mark_reached([timer.reach(now) for timer in due])
        return measured(fired, watch)


def raw_drain(path: Path, now: datetime, batch: int) -> Measured:
    now_text = kit.stamp(int(now.timestamp() * 1000))
    connection = sqlite.connect(path)
    try:
        fired = 0
        watch = kit.Stopwatch()
        while due := connection.execute(FIND_DUE, (now_text, batch)).fetchall():
            connection.execute("BEGIN IMMEDIATE")
            marks = [(now_text, t, c, d) for t, c, _, d in due]
            fired += connection.executemany(MARK_REACHED, marks).rowcount
            connection.execute("COMMIT")
        return measured(fired, watch)
    finally:
        connection.close()


async def store_poll(path: Path, now: datetime, samples: int) -> list[float]:
    async with SqliteTimerStore(path) as store:
        taken = []
        for _ in range(samples):
            started = time.perf_counter()
            assert not await store.find_due(now, 100)
            await store.next_due_at()
            taken.append((time.perf_counter() - started) * 1e6)
        return taken


def raw_poll(path: Path, now: datetime, samples: int) -> list[float]:
    now_text = kit.stamp(int(now.timestamp() * 1000))
    connection = sqlite.connect(path)
    try:
        taken = []
        for _ in range(samples):
            started = time.perf_counter()
            assert not connection.execute(FIND_DUE, (now_text, 100)).fetchall()
            connection.execute(NEXT_DUE).fetchone()
            taken.append((time.perf_counter() - started) * 1e6)
        return taken
    finally:
        connection.close()


async def interleaved(
    repeat: int, store: Callable[[], Awaitable[Measured]], raw: Callable[[], Measured]
) -> dict[str, Any]:
    async def measure(side: str, _: int) -> Measured:
        return await store() if side == "store" else raw()

    taken = await kit.alternated(repeat, ["raw", "store"], measure)
    return {
        "store_per_s": [one["store"][0] for one in taken],
        "raw_per_s": [one["raw"][0] for one in taken],
        "store_cpu_us": min(one["store"][1] for one in taken),
        "raw_cpu_us": min(one["raw"][1] for one in taken),
        "store_vs_raw": kit.median_ratio(
            [one["store"][0] for one in taken], [one["raw"][0] for one in taken]
        ),
    }


async def measure_all(directory: Path, quick: bool, repeat: int) -> list[dict[str, Any]]:
    n_batched, n_callers = (20_000, 5_000) if quick else (100_000, 30_000)
    total, due = (100_000, 10_000) if quick else (1_000_000, 100_000)
    out: list[dict[str, Any]] = []

    def fresh(name: str) -> Path:
        return sqlite.create(directory / name)

    timers = entries(n_batched, "batched")
    for batch in (100, 1000):
        kit.progress(f"batched schedule, {batch} per apply")
        row = await interleaved(
            repeat,
            lambda b=batch: store_batched(fresh("store.db"), timers, b),  # type: ignore[misc]
            lambda b=batch: raw_batched(fresh("raw.db"), timers, b),  # type: ignore[misc]
        )
        out.append(
            {
                "measurement": f"schedule, batches of {batch} ({n_batched:,} timers)",
                "raw": "executemany",
                **row,
            }
        )
    callers_timers = entries(n_callers, "callers")
    for callers, sync in ((1, "NORMAL"), (10, "NORMAL"), (100, "NORMAL"), (100, "FULL")):
        kit.progress(f"{callers} concurrent schedule callers, synchronous={sync}")
        mine = callers_timers if callers > 1 else callers_timers[:5000]
        row = await interleaved(
            repeat,
            lambda c=callers, s=sync, m=mine: store_callers(fresh("store.db"), m, c, s),  # type: ignore[misc]
            lambda s=sync: raw_row_per_commit(fresh("raw.db"), callers_timers[:5000], s),  # type: ignore[misc]
        )
        what = f"schedule, {callers} concurrent caller{'s' if callers > 1 else ''}"
        out.append(
            {
                "measurement": what + ("" if sync == "NORMAL" else ", synchronous=FULL"),
                "raw": "1 row/commit",
                **row,
            }
        )

    kit.progress(f"populating {total:,} timers, {due:,} due")
    pristine = fresh("pristine.db")
    now = populate(pristine, total, due)

    def clone(name: str) -> Path:
        path = fresh(name)
        shutil.copyfile(pristine, path)
        return path

    before = now - timedelta(days=3)
    store_path, raw_path = clone("store.db"), clone("raw.db")
    out.append(
        poll_row(
            f"empty poll (find_due + next_due_at), {total:,} stored",
            await store_poll(store_path, before, 2000),
            raw_poll(raw_path, before, 2000),
        )
    )
    for batch in (100, 1000):
        kit.progress(f"due query + mark reached, batches of {batch}")
        row = await interleaved(
            repeat if batch == 100 else 1,
            lambda b=batch: store_drain(clone("store.db"), now, b),  # type: ignore[misc]
            lambda b=batch: raw_drain(clone("raw.db"), now, b),  # type: ignore[misc]
        )
        out.append(
            {
                "measurement": f"due query + mark reached, batches of {batch} "
                f"({due:,} of {total:,})",
                "raw": "",
                **row,
            }
        )
    store_path, raw_path = clone("store.db"), clone("raw.db")
    await store_drain(store_path, now, 1000)
    raw_drain(raw_path, now, 1000)
    out.append(
        poll_row(
            f"empty poll after firing {due:,} ({total - due:,} pending)",
            await store_poll(store_path, now, 2000),
            raw_poll(raw_path, now, 2000),
        )
    )
    return out


def poll_row(what: str, store: list[float], raw: list[float]) -> dict[str, Any]:
    def p99(values: list[float]) -> float:
        return round(kit.percentiles(values)["p99_ms"], 1)

    return {
        "measurement": what,
        "store_us": round(statistics.median(store), 1),
        "store_p99_us": p99(store),
        "raw_us": round(statistics.median(raw), 1),
        "raw_p99_us": p99(raw),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repetitions")


def main(args: argparse.Namespace) -> int:
    machine = kit.machine()
    directory = Path(tempfile.mkdtemp(prefix="timer-bench-store-"))
    try:
        measured_rows = asyncio.run(measure_all(directory, args.quick, args.repeat))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {"repeat": args.repeat, "journal": "WAL", "synchronous": "NORMAL"},
        "rows": measured_rows,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import store_block

    print(store_block(document))
    return 0
