"""Timer without a broker, against the loop a developer would write by hand (issue 27).

    flock /tmp/timer-bench.lock uv run --all-packages python bench/handlers.py --rounds 5
    flock /tmp/timer-bench.lock uv run --all-packages python bench/handlers.py --postgres

SQLite: ``--jobs`` timers due now are stored in a fresh file (not timed), then either a
``Timer(SqliteTimerStore(...), handler=noop)`` (``batch_size`` 1000, 1000 calls at once) runs
until every timer is marked ``Reached``, or the yardstick does the same work by hand on the
same schema: select 1000 due rows, call the no-op with each, mark them in one transaction,
again until none is due; and, to tell the store's share of the gap from the handler
path's, the same loop through the store's API (``find_due``, call, ``mark_reached``).
Rounds alternate their order; the figure is the median of the rounds' ratios (Timer's rate /
the yardstick's).

``--postgres`` also runs, alternated on one throwaway server, Timer's handler path on
``PostgresTimerStore`` and pgqueuer's no-op execution (``bench/compare/peers.py`` in the
peers' own virtualenv, as bench/compare does): both rates go to the results.
Writes bench/results/handlers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "compare"))

from timer_adapters_postgres import PostgresTimerStore  # noqa: E402
from timer_adapters_sqlite import SqliteTimerStore  # noqa: E402
from timer_core import (  # noqa: E402
    DueTimeReached,
    HandlerSettings,
    Instrumentation,
    MessageEnvelope,
    Timer,
    TimerEntry,
    TimerStore,
    floor_ms,
)

BATCH = 1000
RESULTS = ROOT / "bench" / "results" / "handlers.json"


class _Fired(Instrumentation):
    """Sets ``done`` once ``expected`` timers were marked Reached."""

    def __init__(self, expected: int) -> None:
        self.count = 0
        self.expected = expected
        self.done = asyncio.Event()

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        self.count += len(entries)
        if self.count >= self.expected:
            self.done.set()


async def noop(event: MessageEnvelope[DueTimeReached]) -> None:
    """The handler under test: does nothing."""


async def seed(store: TimerStore, jobs: int) -> None:
    """``jobs`` timers due over the last ``jobs`` milliseconds, over 10 tenants, in batches."""
    now = datetime.now(UTC)
    async with store:
        for start in range(0, jobs, BATCH):
            await store.apply(
                [
                    TimerEntry(
                        f"tenant-{i % 10}", f"call-{i}", now - timedelta(milliseconds=ms), now
                    )
                    for i, ms in ((i, jobs - i) for i in range(start, min(jobs, start + BATCH)))
                ]
            )


async def timer_round(store: TimerStore, jobs: int) -> float:
    """Timers handled per second by ``Timer(store, handler=noop)``, start to last mark."""
    fired = _Fired(jobs)
    settings = HandlerSettings(max_concurrency=BATCH)
    started = time.perf_counter()
    async with Timer(
        store, handler=noop, handler_settings=settings, batch_size=BATCH, instrumentation=fired
    ):
        await asyncio.wait_for(fired.done.wait(), 600)
        elapsed = time.perf_counter() - started
    return jobs / elapsed


async def sqlite_yardstick(path: Path, jobs: int) -> float:
    """The same work by hand: select due, call, mark in one transaction, 1000 at a time."""
    started = time.perf_counter()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")
    done = 0
    while True:
        now = datetime.now(UTC).isoformat(timespec="milliseconds")[:-6] + "Z"
        rows = db.execute(
            "SELECT tenant_id, service_call_id, due_at, correlation_id FROM timer_schedules "
            "WHERE state = 'Scheduled' AND due_at <= ? "
            "ORDER BY due_at, tenant_id, service_call_id LIMIT ?",
            (now, BATCH),
        ).fetchall()
        if not rows:
            break
        for row in rows:
            await noop(row)  # type: ignore[arg-type]
        db.execute("BEGIN IMMEDIATE")
        db.executemany(
            "UPDATE timer_schedules SET state = 'Reached', reached_at = ? "
            "WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled'",
            [(now, row[0], row[1]) for row in rows],
        )
        db.execute("COMMIT")
        done += len(rows)
    db.close()
    assert done == jobs, (done, jobs)
    return jobs / (time.perf_counter() - started)


async def store_loop(store: TimerStore, jobs: int) -> float:
    """The yardstick's loop through the store's own API (find_due, call, mark_reached): what
    of the gap is the store's, not the handler path's."""
    started = time.perf_counter()
    done = 0
    async with store:
        while page := await store.find_due(datetime.now(UTC), BATCH):
            reached_at = floor_ms(datetime.now(UTC))
            for entry in page:
                await noop(entry)  # type: ignore[arg-type]
            await store.mark_reached([entry.reach(reached_at) for entry in page])
            done += len(page)
    assert done == jobs, (done, jobs)
    return jobs / (time.perf_counter() - started)


def _remove(directory: Path, name: str) -> None:
    """The database file and its WAL and shared-memory files."""
    for leftover in directory.glob(f"{name}*"):
        leftover.unlink()


async def sqlite_rounds(rounds: int, jobs: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"timer": [], "raw": [], "store": []}
    order = ["timer", "raw", "store"]
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(rounds):
            for which in order if n % 2 == 0 else order[::-1]:
                path = Path(tmp) / f"{which}-{n}.db"
                await seed(SqliteTimerStore(path), jobs)
                if which == "timer":
                    rate = await timer_round(SqliteTimerStore(path), jobs)
                elif which == "raw":
                    rate = await sqlite_yardstick(path, jobs)
                else:
                    rate = await store_loop(SqliteTimerStore(path), jobs)
                rates[which].append(rate)
                _remove(Path(tmp), f"{which}-{n}.db")
            print(
                f"sqlite round {n + 1}: timer {rates['timer'][-1]:,.0f}/s, "
                f"raw {rates['raw'][-1]:,.0f}/s, store loop {rates['store'][-1]:,.0f}/s, "
                f"ratio {rates['timer'][-1] / rates['raw'][-1]:.2f}",
                flush=True,
            )
    ratios = [t / r for t, r in zip(rates["timer"], rates["raw"], strict=True)]
    store_ratios = [t / r for t, r in zip(rates["store"], rates["raw"], strict=True)]
    return {
        "timer_per_s": [round(r) for r in rates["timer"]],
        "raw_per_s": [round(r) for r in rates["raw"]],
        "store_loop_per_s": [round(r) for r in rates["store"]],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "store_loop_median_ratio": round(statistics.median(store_ratios), 3),
    }


async def postgres_rounds(rounds: int, jobs: int) -> dict[str, Any]:
    from run import POSTGRES, _peer, make_peer_env  # bench/compare's: the peers' own venv

    from tests.pg import start_cluster

    timer_rates, pgqueuer_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        python = make_peer_env(Path(tmp) / "peers")
        (Path(tmp) / "pg").mkdir()
        cluster = start_cluster(Path(tmp) / "pg", POSTGRES)
        try:
            for n in range(rounds):
                for which in ("timer", "pgqueuer") if n % 2 == 0 else ("pgqueuer", "timer"):
                    database = f"{which}_{n}"
                    url = cluster.create_database(database)
                    if which == "timer":
                        await seed(PostgresTimerStore(url), jobs)
                        store = PostgresTimerStore(url)
                        timer_rates.append(await timer_round(store, jobs))
                    else:
                        dsn = f"postgresql://{cluster.user}@127.0.0.1:{cluster.port}/{database}"
                        result = _peer(
                            python,
                            [
                                "pgqueuer",
                                "--dsn",
                                dsn,
                                "--jobs",
                                str(jobs),
                                "--rate",
                                "10",
                                "--seconds",
                                "1",
                                "--yardstick-jobs",
                                "100",
                            ],
                        )
                        pgqueuer_rates.append(float(result["fire_per_s"]))
                    cluster.drop_database(database)
                print(
                    f"postgres round {n + 1}: timer {timer_rates[-1]:,.0f}/s, "
                    f"pgqueuer {pgqueuer_rates[-1]:,.0f}/s",
                    flush=True,
                )
        finally:
            cluster.stop()
    ratios = [t / p for t, p in zip(timer_rates, pgqueuer_rates, strict=True)]
    return {
        "timer_per_s": [round(r) for r in timer_rates],
        "pgqueuer_per_s": [round(r) for r in pgqueuer_rates],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--postgres", action="store_true", help="also PostgreSQL vs pgqueuer")
    parser.add_argument("--note", default="", help="how the machine was shared, for the record")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "jobs": args.jobs,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "note": args.note,
        "sqlite": asyncio.run(sqlite_rounds(args.rounds, args.jobs)),
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")  # kept if PostgreSQL fails
    if args.postgres:
        results["postgres"] = asyncio.run(postgres_rounds(args.rounds, args.jobs))
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
