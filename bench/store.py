"""Benchmark of SqliteTimerStore against raw sqlite3 doing the same work, in one run.

Measures batched schedule throughput, 1/10/100 concurrent ``schedule`` callers, the poller's
due-query + mark-reached throughput and the empty poll on a large table, prints a table and
writes it into the "Store (bench/store.py)" section of bench/README.md.

    uv run --all-packages python bench/store.py            # full run (a few minutes)
    uv run --all-packages python bench/store.py --quick    # smaller table, no README update
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple, TypeVar

import sqlalchemy
from _readme import write_section

from timer_adapters_sqlite import SqliteTimerStore, migrate
from timer_adapters_sqlite._sql import FIND_DUE, MARK_REACHED, NEXT_DUE_AT, UPSERT
from timer_core import TimerEntry, format_timestamp

T0 = datetime(2030, 1, 1, tzinfo=UTC)
README = Path(__file__).with_name("README.md")
SECTION = "## Store (bench/store.py)"


def entries(count: int, *, prefix: str, tenants: int = 50) -> list[TimerEntry]:
    """``count`` distinct timers over ``tenants`` tenants, due over the next days."""
    return [
        TimerEntry(
            tenant_id=f"tenant-{i % tenants}",
            service_call_id=f"{prefix}-{i:08d}",
            due_at=T0 + timedelta(milliseconds=i * 37),
            registered_at=T0,
            correlation_id=f"trace-{i:08d}",
        )
        for i in range(count)
    ]


def rows(batch: list[TimerEntry]) -> list[tuple[str | int | None, ...]]:
    """The upsert parameters of ``batch``: what raw sqlite3 is handed, ready-made."""
    return [
        (
            e.tenant_id,
            e.service_call_id,
            e.correlation_id,
            format_timestamp(e.due_at),
            format_timestamp(e.registered_at),
            None,  # no command position
            None,  # no trace context
            None,
        )
        for e in batch
    ]


T = TypeVar("T")


def chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def raw_connection(path: Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute(f"PRAGMA synchronous = {synchronous}")
    return connection


def fresh_db(directory: Path, name: str) -> Path:
    path = directory / name
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    migrate(path)
    return path


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


class Run(NamedTuple):
    """One measured run: items per wall-clock second, and process CPU time per item."""

    rate: float
    cpu_us: float
    """CPU microseconds per item, all threads: what load from other processes inflates least."""


class Stopwatch:
    """Wall clock and process CPU time since construction."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def run(self, count: int) -> Run:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        return Run(rate(count, wall), cpu / max(count, 1) * 1e6)


# -- schedule throughput -------------------------------------------------------------------


async def store_batched(path: Path, timers: list[TimerEntry], batch: int) -> Run:
    async with SqliteTimerStore(path) as store:
        watch = Stopwatch()
        for part in chunks(timers, batch):
            await store.apply(part)
        return watch.run(len(timers))


def raw_batched(path: Path, timers: list[TimerEntry], batch: int) -> Run:
    prepared = [rows(part) for part in chunks(timers, batch)]
    connection = raw_connection(path)
    try:
        watch = Stopwatch()
        for part in prepared:
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(UPSERT, part)
            connection.execute("COMMIT")
        return watch.run(len(timers))
    finally:
        connection.close()


async def store_callers(
    path: Path, timers: list[TimerEntry], callers: int, synchronous: str = "NORMAL"
) -> tuple[Run, float]:
    """Timers/s with ``callers`` tasks each awaiting schedule in a loop; and timers per commit."""
    async with SqliteTimerStore(path, synchronous=synchronous) as store:  # type: ignore[arg-type]

        async def caller(mine: list[TimerEntry]) -> None:
            for timer in mine:
                await store.schedule(timer)

        shares = [timers[i::callers] for i in range(callers)]
        before = store.transactions_committed
        watch = Stopwatch()
        await asyncio.gather(*(caller(share) for share in shares))
        measured = watch.run(len(timers))
        commits = store.transactions_committed - before
        return measured, len(timers) / max(commits, 1)


def raw_row_per_commit(path: Path, timers: list[TimerEntry], synchronous: str = "NORMAL") -> Run:
    prepared = rows(timers)
    connection = raw_connection(path, synchronous)
    try:
        watch = Stopwatch()
        for row in prepared:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(UPSERT, row)
            connection.execute("COMMIT")
        return watch.run(len(timers))
    finally:
        connection.close()


# -- the poller on a large table -----------------------------------------------------------


def populate(path: Path, total: int, due: int) -> datetime:
    """``total`` Scheduled timers of which the first ``due`` are due at the returned instant."""
    connection = raw_connection(path)
    start = T0 - timedelta(days=1)
    now = start + timedelta(milliseconds=due * 10)

    def generate(first: int, last: int) -> Iterator[tuple[str | None, ...]]:
        for i in range(first, last):
            # The first `due` timers are due before `now`, the rest spread over the future.
            due_at = start + timedelta(milliseconds=i * 10)
            if i >= due:
                due_at = now + timedelta(seconds=1 + (i * 7919) % 10_000_000)
            yield (
                f"tenant-{i % 100}",
                f"call-{i:09d}",
                f"trace-{i:09d}",
                format_timestamp(due_at),
                format_timestamp(start),
                None,  # no command position
                None,  # no trace context
                None,
            )

    try:
        for first in range(0, total, 50_000):
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(UPSERT, generate(first, min(first + 50_000, total)))
            connection.execute("COMMIT")
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        connection.close()
    return now


async def store_drain(path: Path, now: datetime, batch: int) -> tuple[Run, int]:
    """Timers/s through find_due + reach + mark_reached until nothing is due."""
    async with SqliteTimerStore(path) as store:
        fired = 0
        watch = Stopwatch()
        while True:
            due = await store.find_due(now, batch)
            if not due:
                break
            fired += await store.mark_reached([timer.reach(now) for timer in due])
        return watch.run(fired), fired


def raw_drain(path: Path, now: datetime, batch: int) -> Run:
    now_text = format_timestamp(now)
    connection = raw_connection(path)
    try:
        fired = 0
        watch = Stopwatch()
        while True:
            due = connection.execute(FIND_DUE, (now_text, batch)).fetchall()
            if not due:
                break
            connection.execute("BEGIN IMMEDIATE")
            cursor = connection.executemany(
                MARK_REACHED, [(now_text, row[0], row[1], row[3]) for row in due]
            )
            fired += cursor.rowcount
            connection.execute("COMMIT")
        return watch.run(fired)
    finally:
        connection.close()


async def store_empty_poll(path: Path, now: datetime, rounds: int) -> Poll:
    """Median and p99 microseconds of find_due (nothing due) + next_due_at via the store."""
    async with SqliteTimerStore(path) as store:
        samples = []
        watch = Stopwatch()
        for _ in range(rounds):
            started = time.perf_counter()
            found = await store.find_due(now, 100)
            await store.next_due_at()
            samples.append(time.perf_counter() - started)
            assert not found
        return percentiles(samples, watch.run(rounds))


def raw_empty_poll(path: Path, now: datetime, rounds: int) -> Poll:
    now_text = format_timestamp(now)
    connection = raw_connection(path)
    try:
        samples = []
        watch = Stopwatch()
        for _ in range(rounds):
            started = time.perf_counter()
            found = connection.execute(FIND_DUE, (now_text, 100)).fetchall()
            connection.execute(NEXT_DUE_AT).fetchone()
            samples.append(time.perf_counter() - started)
            assert not found
        return percentiles(samples, watch.run(rounds))
    finally:
        connection.close()


class Poll(NamedTuple):
    """Latency of a poll in microseconds, and its process CPU time."""

    median_us: float
    p99_us: float
    cpu_us: float


def percentiles(samples: list[float], run: Run) -> Poll:
    ordered = sorted(samples)
    return Poll(
        statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.99) - 1] * 1e6, run.cpu_us
    )


# -- report --------------------------------------------------------------------------------


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores (`nproc` {len(os.sched_getaffinity(0))}), {model}; "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"SQLAlchemy {sqlalchemy.__version__}"
    )


Row = tuple[str, str, str, str, str, str]


def table(results: list[Row]) -> str:
    header = (
        "measurement",
        "SqliteTimerStore",
        "raw sqlite3",
        "store / raw",
        "CPU per item, store / raw",
        "target",
    )
    lines = [header, *results]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def row(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [row(header), "| " + " | ".join("-" * w for w in widths) + " |"] + [row(r) for r in results]
    )


def write_readme(body: str) -> None:
    """Replace (or append) this benchmark's section of bench/README.md, nothing else."""
    write_section(SECTION, body, README)


def per_s(value: float) -> str:
    return f"{value:,.0f}/s"


def spread(runs: list[Run]) -> str:
    """Best rate of the repetitions, with the range when there was more than one."""
    values = [run.rate for run in runs]
    best = max(values)
    if len(values) == 1:
        return per_s(best)
    return f"{per_s(best)} ({min(values):,.0f}-{best:,.0f})"


def cpu(store: float, raw: float) -> str:
    return f"{store:.0f} us / {raw:.0f} us"


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, README untouched")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the best counts")
    parser.add_argument("--dir", type=Path, default=None, help="where the databases go")
    args = parser.parse_args()
    quick, repeat = args.quick, args.repeat
    n_batched = 20_000 if quick else 100_000
    n_callers = 5_000 if quick else 30_000
    total, due_count = (100_000, 10_000) if quick else (1_000_000, 100_000)
    rounds = 2_000

    directory = args.dir or Path(tempfile.mkdtemp(prefix="timer-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    results: list[Row] = []

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def add(label: str, store: list[Run], raw: list[Run], raw_kind: str, target: str) -> None:
        ratio = f"{max(r.rate for r in store) / max(r.rate for r in raw):.2f}x"
        # The least CPU of the repetitions: the run least disturbed by neighbours.
        used = cpu(min(r.cpu_us for r in store), min(r.cpu_us for r in raw))
        results.append((label, spread(store), f"{spread(raw)}{raw_kind}", ratio, used, target))

    load_at_start = os.getloadavg()
    try:
        say(f"machine: {machine()}")
        timers = entries(n_batched, prefix="batched")
        for batch in (100, 1000):
            say(f"batched schedule, {batch} per apply ...")
            raws, stores = [], []
            # Interleaved, so a neighbour's load spike hits both sides alike.
            for _ in range(repeat):
                raws.append(raw_batched(fresh_db(directory, "raw.db"), timers, batch))
                stores.append(await store_batched(fresh_db(directory, "store.db"), timers, batch))
            add(
                f"schedule, batches of {batch} ({n_batched:,} timers)",
                stores,
                raws,
                " (executemany)",
                ">= 0.7x" if batch == 1000 else "",
            )

        timers = entries(n_callers, prefix="callers")
        say("raw one transaction per row ...")
        raw_single = [
            raw_row_per_commit(fresh_db(directory, "raw.db"), timers[:5000]) for _ in range(repeat)
        ]
        for callers in (1, 10, 100):
            say(f"{callers} concurrent schedule callers ...")
            count = timers if callers > 1 else timers[:5000]
            runs = [
                await store_callers(fresh_db(directory, "store.db"), count, callers)
                for _ in range(repeat)
            ]
            per_commit = statistics.mean(per for _, per in runs)
            add(
                f"schedule, {callers} concurrent caller{'s' if callers > 1 else ''}"
                f" ({per_commit:.1f} timers/commit)",
                [measured for measured, _ in runs],
                raw_single,
                " (1 row/commit)",
                ">= 10,000/s" if callers == 100 else "",
            )
        say("100 concurrent callers, synchronous=FULL ...")
        raw_full = [raw_row_per_commit(fresh_db(directory, "raw.db"), timers[:1000], "FULL")]
        measured, per_commit = await store_callers(
            fresh_db(directory, "store.db"), timers, 100, "FULL"
        )
        add(
            f"schedule, 100 callers, synchronous=FULL ({per_commit:.1f} timers/commit)",
            [measured],
            raw_full,
            " (1 row/commit)",
            "",
        )

        say(f"populating {total:,} timers, {due_count:,} due ...")
        started = time.perf_counter()
        pristine = fresh_db(directory, "pristine.db")
        now = populate(pristine, total, due_count)
        say(f"  populated in {time.perf_counter() - started:.0f} s")

        def clone(name: str) -> Path:
            path = directory / name
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            shutil.copyfile(pristine, path)
            return path

        def poll_row(label: str, store: Poll, raw: Poll) -> None:
            results.append(
                (
                    label,
                    f"{store.median_us:.0f} us (p99 {store.p99_us:.0f} us)",
                    f"{raw.median_us:.0f} us (p99 {raw.p99_us:.0f} us)",
                    f"+{store.median_us - raw.median_us:.0f} us",
                    cpu(store.cpu_us, raw.cpu_us),
                    "< 1 ms",
                )
            )

        say("empty poll before the due timers ...")
        before = now - timedelta(days=3)
        poll_row(
            f"empty poll (find_due + next_due_at), {total:,} stored",
            await store_empty_poll(clone("store.db"), before, rounds),
            raw_empty_poll(clone("raw.db"), before, rounds),
        )
        for batch in (100, 1000):
            say(f"due query + mark reached, batches of {batch} ...")
            raws, stores = [], []
            for _ in range(repeat if batch == 100 else 1):
                store_path, raw_path = clone("store.db"), clone("raw.db")
                measured, fired = await store_drain(store_path, now, batch)
                assert fired == due_count, fired
                stores.append(measured)
                raws.append(raw_drain(raw_path, now, batch))
            add(
                f"due query + mark reached, batches of {batch} ({due_count:,} of {total:,})",
                stores,
                raws,
                "",
                ">= 10,000/s" if batch == 100 else "",
            )
        say("empty poll after the drain ...")
        poll_row(
            f"empty poll after firing {due_count:,} ({total - due_count:,} pending)",
            await store_empty_poll(store_path, now, rounds),
            raw_empty_poll(raw_path, now, rounds),
        )
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    rendered = table(results)
    print(rendered)
    if not quick:
        load = ", ".join(f"{x:.2f}" for x in load_at_start)
        write_readme(
            f"Machine: {machine()}; load average at start {load}. Run: "
            f"`uv run --all-packages python bench/store.py` on "
            f"{datetime.now(UTC):%Y-%m-%d}; WAL, `synchronous=NORMAL` unless stated. "
            f"Throughputs are the best of {repeat} interleaved runs (range in brackets): other "
            "work shares the cores.\n\n"
            f"{rendered}\n\n"
            "Yardsticks: *raw sqlite3* runs the store's own SQL on a plain `sqlite3` connection "
            "(same schema, WAL) with parameters prepared up front. The concurrent rows compare "
            "with raw sqlite3 committing one row per transaction, what an unbatched writer "
            "does even without a thread hop. The store's due-query rows include what the "
            "worker does per timer: building `TimerEntry` objects from rows and "
            "`TimerEntry.reach` (the core's cost, most of the gap to raw); the empty polls "
            "include two thread hops (find_due, next_due_at) from the event loop to the "
            "reader thread. *CPU per item* is the process CPU time (all threads) per timer or "
            "poll, least of the repetitions: other processes inflate it far less than the "
            "wall-clock rates, so 1,000,000 us divided by it is about the rate on a core of "
            "its own.\n"
        )


if __name__ == "__main__":
    asyncio.run(main())
