"""Timer without a broker, against the loop a developer would write by hand (issue 27).

    flock /tmp/timer-bench.lock uv run --all-packages python bench/handlers.py --rounds 5
    flock /tmp/timer-bench.lock uv run --all-packages python bench/handlers.py --postgres

SQLite: ``--jobs`` timers due now are stored in a fresh file (not timed), then either a
``Timer(SqliteTimerStore(...), handler=noop)`` (``batch_size`` 1000, 1000 calls at once) runs
until every timer is marked ``Reached``, or the yardstick does the same work by hand on the
same schema: select 1000 due rows, call the no-op with each, mark them in one transaction,
again until none is due. Rounds alternate the two; the figure is the median of the rounds'
ratios (Timer's rate / the yardstick's).

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


async def sqlite_rounds(rounds: int, jobs: int) -> dict[str, Any]:
    timer_rates, raw_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(rounds):
            for which in ("timer", "raw") if n % 2 == 0 else ("raw", "timer"):
                path = Path(tmp) / f"{which}-{n}.db"
                await seed(SqliteTimerStore(path), jobs)
                if which == "timer":
                    timer_rates.append(await timer_round(SqliteTimerStore(path), jobs))
                else:
                    raw_rates.append(await sqlite_yardstick(path, jobs))
                path.unlink()
            print(
                f"sqlite round {n + 1}: timer {timer_rates[-1]:,.0f}/s, "
                f"raw {raw_rates[-1]:,.0f}/s, ratio {timer_rates[-1] / raw_rates[-1]:.2f}",
                flush=True,
            )
    ratios = [t / r for t, r in zip(timer_rates, raw_rates, strict=True)]
    return {
        "timer_per_s": [round(r) for r in timer_rates],
        "raw_per_s": [round(r) for r in raw_rates],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
    }


async def postgres_rounds(rounds: int, jobs: int) -> dict[str, Any]:
    from run import _peer, make_peer_env  # bench/compare's: the peers' own virtualenv

    from tests.pg import start_cluster

    timer_rates, pgqueuer_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        python = make_peer_env(Path(tmp) / "peers")
        cluster = start_cluster(Path(tmp) / "pg")
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
    if args.postgres:
        results["postgres"] = asyncio.run(postgres_rounds(args.rounds, args.jobs))
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
