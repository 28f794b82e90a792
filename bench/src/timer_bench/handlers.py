"""Timer without a broker (``Timer(store, handler=...)``) against the loop a developer would
write by hand, and against pgqueuer's no-op execution on PostgreSQL.

SQLite: ``--jobs`` timers due over the last ``--jobs`` milliseconds are stored in a fresh file
(not timed); then, in alternated rounds, ``Timer(SqliteTimerStore(...), handler=noop)`` runs
until every timer is marked ``Reached``, at its default settings (``batch_size`` 100, 100
calls at once) and tuned (``batch_size`` 1000, 1000 calls at once); the yardstick does the
same work by hand (select 1000 due rows, call the no-op with each, mark them in one
transaction, until none is due); and the same loop runs on the store's own API
(``find_due``, call, ``mark_reached``), which tells the store's share of the gap from the
handler path's; and the loop by hand once more, handing a batch handler each row's
``DueTimeReached`` envelope as Timer does (``raw_envelopes``: the part of the gap any loop
that hands out envelopes pays). ``Timer(store, batch_handler=noop_batch)`` hands the no-op
each batch the pipeline found (default settings). With ``--baseline-ref REF``, ``Timer(store,
handler=noop)`` also runs on the sources of that commit (``timer_baseline``), in a process of
its own as ``timer_child`` runs the current sources, alternated with the rest: the per-timer
handler path against an earlier version of itself. Every commit that marks is unsynced on
each side: the yardstick's connection runs at ``synchronous=NORMAL``, the store at its
default (``FULL`` syncs the commits that store commands; a mark commits as ``NORMAL``
does). ``--postgres`` adds Timer's handler path on ``PostgresTimerStore`` (default and
tuned) beside pgqueuer draining as many no-op jobs (:mod:`timer_bench.peers` in the peers'
virtualenv), on one throwaway server, alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

# The kit and the packages under test only: the baseline's child imports this module on an
# earlier commit's packages, which the peers' and processes' helpers may not fit.
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit
from timer_core import HandlerSettings, Instrumentation, Timer, TimerEntry, TimerStore
from timer_core.events import due_events
from timer_core.instants import floor_ms
from timer_core.ports import Uuid7EnvelopeIds

BATCH = 1000
#: The tuned row's settings (the default row passes none).
TUNED = {"batch_size": BATCH, "max_concurrency": BATCH}
SQLITE_SIDES = ["timer", "timer_tuned", "timer_batch", "raw", "raw_envelopes", "store_loop"]
#: The sides run in a process of their own, with ``--baseline-ref``.
CHILD_SIDES = ["timer_child", "timer_baseline"]
POSTGRES_SIDES = ["timer", "timer_tuned", "pgqueuer"]


class _Marked(Instrumentation):
    """Sets ``done`` once ``expected`` timers were marked Reached."""

    def __init__(self, expected: int) -> None:
        self.count = 0
        self.expected = expected
        self.done = asyncio.Event()

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        self.count += len(entries)
        if self.count >= self.expected:
            self.done.set()


async def noop(event: object) -> None:
    """The handler under test: does nothing."""


async def noop_batch(events: Sequence[object]) -> None:
    """The batch handler under test: does nothing (every timer handled)."""


async def seed(store: TimerStore, jobs: int) -> None:
    """``jobs`` timers, one due each millisecond up to now, over the kit's tenants."""
    now = datetime.now(UTC)
    async with store:
        for start in range(0, jobs, BATCH):
            batch = range(start, min(jobs, start + BATCH))
            await store.apply(
                [
                    TimerEntry(
                        f"tenant-{i % kit.TENANTS}",
                        f"call-{i}",
                        now - timedelta(milliseconds=jobs - i),
                        now,
                    )
                    for i in batch
                ]
            )


async def timer_round(
    store: TimerStore, jobs: int, *, tuned: bool = False, batch: bool = False
) -> float:
    """Timers handled per second by ``Timer(store, handler=noop)`` (``batch``:
    ``batch_handler=noop_batch``), start to last mark; at the default settings, or with
    :data:`TUNED`'s."""
    marked = _Marked(jobs)
    settings: dict[str, Any] = {"batch_handler": noop_batch} if batch else {"handler": noop}
    if tuned:
        settings |= {
            "batch_size": TUNED["batch_size"],
            "handler_settings": HandlerSettings(max_concurrency=TUNED["max_concurrency"]),
        }
    watch = kit.Stopwatch()
    async with Timer(store, instrumentation=marked, **settings) as timer:
        await asyncio.wait_for(marked.done.wait(), 600)
        rate = kit.rate(jobs, watch.elapsed())
        # Marks counted once each: none left Scheduled (a timer marked twice would have
        # ended the round early).
        left = await timer.store.count_scheduled()
    assert left == 0, f"{left} timers still Scheduled after {marked.count} marks"
    return rate


async def raw_round(path: Path, jobs: int) -> float:
    """By hand on the same schema: select due, call, mark in one transaction, 1000 a time."""

    async def call_each(rows: list[Any], now_ms: int) -> None:
        for row in rows:
            await noop(row)

    return await _by_hand(path, jobs, "due_at, correlation_id", call_each)


async def raw_envelopes_round(path: Path, jobs: int) -> float:
    """The loop by hand, handing a batch handler what Timer hands one: each row read made a
    ``TimerEntry`` and its ``DueTimeReached`` envelope (``timer_core.events.due_events``,
    the builder Timer uses), the page in one call, then marked as :func:`raw_round` marks.
    The work any loop pays that hands out Timer's envelopes, whatever else it leaves out."""
    ids = Uuid7EnvelopeIds()
    parse = datetime.fromisoformat

    async def call_with_envelopes(rows: list[Any], now_ms: int) -> None:
        entries = [
            TimerEntry(tenant, call, parse(due), parse(registered), correlation_id=correlation)
            for tenant, call, due, registered, correlation in rows
        ]
        await noop_batch(due_events(entries, datetime.fromtimestamp(now_ms / 1000, UTC), ids))

    return await _by_hand(path, jobs, "due_at, registered_at, correlation_id", call_with_envelopes)


async def _by_hand(
    path: Path, jobs: int, columns: str, call: Callable[[list[Any], int], Awaitable[None]]
) -> float:
    """The loop by hand: select up to 1000 due rows (key first, then ``columns``), ``call``
    with them and the instant in epoch ms, mark them in one transaction; until none is due."""
    watch = kit.Stopwatch()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")
    done = 0
    while True:
        now_ms = kit.now_ms()
        now = kit.stamp(now_ms)
        rows = db.execute(
            f"SELECT tenant_id, service_call_id, {columns} FROM timer_schedules "
            "WHERE state = 'Scheduled' AND due_at <= ? "
            "ORDER BY due_at, tenant_id, service_call_id LIMIT ?",
            (now, BATCH),
        ).fetchall()
        if not rows:
            break
        await call(rows, now_ms)
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
    return kit.rate(jobs, watch.elapsed())


async def store_loop_round(store: TimerStore, jobs: int) -> float:
    """The yardstick's loop on the store's API: find_due, call, mark_reached."""
    watch = kit.Stopwatch()
    done = 0
    async with store:
        while page := await store.find_due(datetime.now(UTC), BATCH):
            reached_at = floor_ms(datetime.now(UTC))
            for entry in page:
                await noop(entry)
            await store.mark_reached([entry.reach(reached_at) for entry in page])
            done += len(page)
    assert done == jobs, (done, jobs)
    return kit.rate(jobs, watch.elapsed())


def _remove(directory: Path, name: str) -> None:
    """A database file with its WAL and shared-memory files."""
    for leftover in directory.glob(f"{name}*"):
        leftover.unlink()


def child_round(path: Path, jobs: int, tree: Path | None) -> float:
    """``timer_round`` at the defaults in a fresh process, on the sources of ``tree`` (an
    exported commit) or, without, the current ones."""
    command = [sys.executable, "-m", "timer_bench.handlers", "--child", str(path)]
    command += ["--jobs", str(jobs)]
    return float(kit.run_child(command, tree, "the handlers child")["rate"])


async def sqlite_rounds(
    scratch: Path, rounds: int, jobs: int, baseline: Path | None = None
) -> list[dict[str, float]]:
    sides = SQLITE_SIDES + (CHILD_SIDES if baseline is not None else [])

    async def measure(side: str, number: int) -> float:
        path = scratch / f"{side}-{number}.db"
        await seed(SqliteTimerStore(path), jobs)
        if side in ("timer", "timer_tuned", "timer_batch"):
            result = await timer_round(
                SqliteTimerStore(path),
                jobs,
                tuned=side == "timer_tuned",
                batch=side == "timer_batch",
            )
        elif side in CHILD_SIDES:
            tree = baseline if side == "timer_baseline" else None
            result = await asyncio.to_thread(child_round, path, jobs, tree)
        elif side == "raw":
            result = await raw_round(path, jobs)
        elif side == "raw_envelopes":
            result = await raw_envelopes_round(path, jobs)
        else:
            result = await store_loop_round(SqliteTimerStore(path), jobs)
        kit.progress(f"sqlite round {number}: {side} {kit.per_s(result)}")
        _remove(scratch, f"{side}-{number}.db")
        return result

    return await kit.alternated(rounds, sides, measure)


def postgres_rounds(scratch: Path, rounds: int, jobs: int) -> list[dict[str, float]]:
    from timer_bench.compare import POSTGRES, peer_python, peer_round
    from timer_bench.procs import postgres

    python = peer_python(scratch)
    with postgres(POSTGRES) as pg:

        async def measure(side: str, number: int) -> float:
            database = f"{side}_{number}"
            url = pg.create_database(database)
            try:
                if side in ("timer", "timer_tuned"):
                    await seed(PostgresTimerStore(url), jobs)
                    tuned = side == "timer_tuned"
                    result = await timer_round(PostgresTimerStore(url), jobs, tuned=tuned)
                else:
                    dsn = f"postgresql://{pg.user}@127.0.0.1:{pg.port}/{database}"
                    arguments = ["pgqueuer", "--dsn", dsn, "--jobs", str(jobs), "--rate", "10"]
                    arguments += ["--seconds", "1", "--yardstick-jobs", "100"]
                    peer = await asyncio.to_thread(peer_round, python, arguments)
                    result = float(peer["fire_per_s"])
            finally:
                pg.drop_database(database)
            kit.progress(f"postgres round {number}: {side} {kit.per_s(result)}")
            return result

        return asyncio.run(kit.alternated(rounds, POSTGRES_SIDES, measure))


def summary(rounds: list[dict[str, float]], sides: list[str], yardstick: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        side: {
            "per_s": [r[side] for r in rounds],
            "median_per_s": kit.median(r[side] for r in rounds),
        }
        for side in sides
    }
    for side in sides:
        if side != yardstick:
            out[side]["vs_" + yardstick] = kit.median_ratio(
                [r[side] for r in rounds], [r[yardstick] for r in rounds]
            )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one round of 1,000 timers, SQLite")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--postgres", action="store_true", help="also PostgreSQL vs pgqueuer")
    parser.add_argument(
        "--baseline-ref", help="also Timer's handler path on the sources of this commit"
    )


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.jobs, args.postgres = 1, 1_000, False
    machine = kit.machine()
    scratch = Path(tempfile.mkdtemp(prefix="timer-handlers-"))
    os.chmod(scratch, 0o755)
    document: dict[str, Any] = {
        "date": kit.today(),
        "machine": machine,
        "settings": {
            "rounds": args.rounds,
            "jobs": args.jobs,
            "batch": BATCH,
            "timer": "Timer's defaults: batch_size 100, max_concurrency 100",
            "timer_tuned": TUNED,
            "timer_batch": "batch_handler=noop_batch, Timer's defaults",
            "sqlite": (
                "WAL; every mark commits unsynced: the yardstick at synchronous=NORMAL, the "
                "store at its default FULL, which syncs only the commits of commands"
            ),
        },
    }
    with tempfile.TemporaryDirectory(prefix="timer-handlers-baseline-") as tree:
        baseline = kit.export_tree(args.baseline_ref, Path(tree)) if args.baseline_ref else None
        sqlite = asyncio.run(sqlite_rounds(scratch, args.rounds, args.jobs, baseline))
    document["sqlite"] = summary(sqlite, SQLITE_SIDES, "raw")
    document["sqlite"]["timer_batch"]["vs_raw_envelopes"] = kit.median_ratio(
        [r["timer_batch"] for r in sqlite], [r["raw_envelopes"] for r in sqlite]
    )
    document["sqlite_rounds"] = sqlite
    if baseline is not None:
        document["settings"]["baseline_ref"] = args.baseline_ref
        document["baseline"] = summary(sqlite, CHILD_SIDES, "timer_baseline")
    if args.postgres:
        pg_rounds = postgres_rounds(scratch, args.rounds, args.jobs)
        document["postgres"] = summary(pg_rounds, POSTGRES_SIDES, "pgqueuer")
        document["postgres_rounds"] = pg_rounds
        from timer_bench.compare import POSTGRES

        document["settings"]["postgres"] = POSTGRES
    kit.write_result(document, args.output)
    from timer_bench.render import handlers_block

    print(handlers_block(document))
    return 0


def child_main(argv: list[str]) -> int:
    """``python -m timer_bench.handlers --child DB --jobs N``: one ``timer_round`` at the
    defaults on whatever sources this process imports; prints its rate."""
    parser = argparse.ArgumentParser(prog="python -m timer_bench.handlers --child")
    parser.add_argument("--child", type=Path, required=True)
    parser.add_argument("--jobs", type=int, required=True)
    args = parser.parse_args(argv)
    rate = asyncio.run(timer_round(SqliteTimerStore(args.child), args.jobs))
    print(json.dumps({"rate": rate}))
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
