"""One timer's or one tenant's trouble stays its own (issue 42's lateness figures), on the
current sources and, with ``--baseline-ref REF``, on that commit's, in alternated rounds.

- ``storm``: ``Timer(SqliteTimerStore(...), handler=...)`` at its defaults; tenant ``storm``
  has 20,000 timers due at one instant, its handler awaiting 10 ms a call; tenant ``quiet``
  one timer due 0.2 s later. Measured: how late the quiet one is handled (wall clock at the
  call minus its due time), and when the storm's last one is.
- ``unacked``: ``Timer(SqliteTimerStore(...), broker.publisher)`` on a real nats-server at the
  defaults (5 s ack timeout); one timer's subject is left out of TIMER_EVENTS and read by a
  plain subscriber that never answers, so its publish is never acknowledged (it fails after
  the ack timeout and is retried); 60 timers of 6 other tenants are due with it and over the
  next 6 s. Measured: each of the 60's lateness as JetStream stored it (the stream's time
  minus the due time).

Each side runs in a process of its own (``python -m timer_bench.isolation --child``), the
baseline's with that commit's packages first on ``PYTHONPATH``; the timers are written into
the SQLite file by the kit beforehand, behind the Timer's back. ``--quick`` runs one round
of smaller cases (2,000 storm timers; 12 others over 1 s): the harness checked, nothing
measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

# Only the standard library and the kit at the top: a child imports this module on an
# earlier commit's packages, which the parent's helpers (sqlite, procs) may not fit.
from timer_bench import kit

CASES = ("storm", "unacked")
SIDES = ("current", "baseline")
STORM_CALL_S, QUIET_AFTER_S, OTHER_TENANTS = 0.01, 0.2, 6
#: The storm's timers, the others' and the seconds they are due over: the issue's, and
#: ``--quick``'s (correctness only: the harness runs).
FULL, QUICK = (20_000, 60, 6.0), (2_000, 12, 1.0)
#: How long before the due instant the timers are written (the child starts meanwhile).
HEAD_START_S = 3.0
POISON_TENANT = "poison"


# -- the children: one case on the sources they import --------------------------------------


async def storm_child(db: Path, due_ms: int, storm: int) -> dict[str, Any]:
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import Timer

    quiet_at: list[float] = []
    storm_done: list[float] = []
    finished = asyncio.Event()

    async def handler(event: Any) -> None:
        if event.payload.tenant_id == "quiet":
            quiet_at.append(time.time())
        else:
            await asyncio.sleep(STORM_CALL_S)
            storm_done.append(time.time())
        if quiet_at and len(storm_done) >= storm:
            finished.set()

    async with Timer(SqliteTimerStore(db), handler=handler):
        started = time.time()
        await asyncio.wait_for(finished.wait(), 300)
    due_s = due_ms / 1000
    return {
        "started_before_due_s": round(due_s - started, 3),
        "storm_handled": len(storm_done),
        "quiet_handled": len(quiet_at),
        "quiet_late_s": round(quiet_at[0] - (due_s + QUIET_AFTER_S), 3),
        "storm_handled_before_quiet": sum(at <= quiet_at[0] for at in storm_done),
        "storm_drained_s": round(max(storm_done) - due_s, 3),
    }


async def unacked_child(db: Path, url: str, due_ms: int, others: int) -> dict[str, Any]:
    import nats

    from timer_adapters_nats import NatsBroker, NatsSettings
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import Timer

    settings = NatsSettings(url=url)
    held: list[Any] = []
    async with NatsBroker(settings) as broker:
        js = broker.jetstream
        config = (await js.stream_info(settings.events_stream)).config
        prefix = settings.subject_prefix
        config.subjects = [f"{prefix}.events.tenant-{t}.*" for t in range(OTHER_TENANTS)]
        await js.update_stream(config)
        silent = await nats.connect(url)

        async def hold(msg: Any) -> None:
            held.append(msg)

        await silent.subscribe(f"{prefix}.events.{POISON_TENANT}.*", cb=hold)
        await silent.flush()
        try:
            async with Timer(SqliteTimerStore(db), broker.publisher):
                started = time.time()
                deadline = time.monotonic() + 120
                while True:
                    # A bench's poll of the stream's count (the test suite's own cases wait
                    # for the events themselves): 50 ms is well below the lateness measured.
                    info = await js.stream_info(settings.events_stream)
                    if info.state.messages >= others or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                late = []
                for seq in range(info.state.first_seq, info.state.last_seq + 1):
                    raw = await js.get_msg(settings.events_stream, seq)
                    body = json.loads(raw.data or b"{}")
                    due = datetime.fromisoformat(body["payload"]["dueAt"].replace("Z", "+00:00"))
                    assert raw.time is not None
                    late.append((raw.time - due).total_seconds())
        finally:
            await silent.close()
    late.sort()
    return {
        "started_before_due_s": round(due_ms / 1000 - started, 3),
        "published": len(late),
        "poison_publishes": len(held),
        "late_p50_s": round(kit.median(late), 3) if late else None,
        "late_max_s": round(late[-1], 3) if late else None,
        "late_s": [round(x, 3) for x in late],
    }


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m timer_bench.isolation --child")
    parser.add_argument("--child", choices=CASES, required=True)
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--due-ms", type=int, required=True)
    parser.add_argument("--url")
    parser.add_argument("--count", type=int, required=True, help="the storm's, or the others'")
    args = parser.parse_args(argv)
    if args.child == "storm":
        result = asyncio.run(storm_child(args.db, args.due_ms, args.count))
    else:
        result = asyncio.run(unacked_child(args.db, args.url, args.due_ms, args.count))
    print(json.dumps(result))
    return 0


# -- the parent: rounds, sides, results -------------------------------------------------------


def seed(db: Path, case: str, sizes: tuple[int, int, float]) -> int:
    """Write the case's timers into a fresh file; returns the due instant (epoch ms)."""
    from timer_bench import sqlite

    storm, others, over_s = sizes
    sqlite.create(db)
    due = kit.now_ms() + int(HEAD_START_S * 1000)
    at = kit.stamp(kit.now_ms())
    if case == "storm":
        rows = [("storm", f"s{i:05d}", None, kit.stamp(due), at) for i in range(storm)]
        rows.append(("quiet", "q", None, kit.stamp(due + int(QUIET_AFTER_S * 1000)), at))
    else:
        rows = [(POISON_TENANT, "held", None, kit.stamp(due), at)]
        step = int(over_s * 1000) // others
        rows += [
            (f"tenant-{n % OTHER_TENANTS}", f"call-{n:02d}", None, kit.stamp(due + n * step), at)
            for n in range(others)
        ]
    sqlite.insert_rows(db, rows)
    return due


def run_child(
    case: str, db: Path, due_ms: int, count: int, url: str | None, tree: Path | None
) -> dict[str, Any]:
    command = [sys.executable, "-m", "timer_bench.isolation", "--child", case]
    command += ["--db", str(db), "--due-ms", str(due_ms), "--count", str(count)]
    command += ["--url", url] if url else []
    return kit.run_child(command, tree, f"the {case} child")


async def rounds_of(
    case: str,
    rounds: int,
    scratch: Path,
    sides: list[str],
    tree: Path | None,
    sizes: tuple[int, int, float],
) -> list[dict[str, dict[str, Any]]]:
    from timer_adapters_nats import NatsServerProcess

    count = sizes[0] if case == "storm" else sizes[1]

    async def measure(side: str, number: int) -> dict[str, Any]:
        where = scratch / f"{case}-{side}-{number}"
        where.mkdir(parents=True)
        db = where / "timer.db"
        load = kit.load_average()[0]
        chosen = tree if side == "baseline" else None
        if case == "unacked":
            with NatsServerProcess(where / "nats") as server:
                due = seed(db, case, sizes)
                result = await asyncio.to_thread(
                    run_child, case, db, due, count, server.url, chosen
                )
        else:
            due = seed(db, case, sizes)
            result = await asyncio.to_thread(run_child, case, db, due, count, None, chosen)
        kit.progress(f"{case} round {number}, {side}: {json.dumps(result)[:200]}")
        return {**result, "load": load}

    return await kit.alternated(rounds, sides, measure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--only", choices=CASES, help="one of the cases")
    parser.add_argument("--baseline-ref", help="also each case on the sources of this commit")


def checks(
    case: str, side: str, one: dict[str, Any], sizes: tuple[int, int, float]
) -> dict[str, bool]:
    """What one round must show for its figures to count: it started before the due
    instant, and every timer was handled (the storm) or stored (the others), the poison one
    held unacknowledged."""
    name = f"{case} ({side})"
    ran = {f"{name}: the Timer started before the due instant": one["started_before_due_s"] > 0}
    if case == "storm":
        ran[f"{name}: every timer handled"] = (
            one["storm_handled"] >= sizes[0] and one["quiet_handled"] >= 1
        )
    else:
        ran[f"{name}: every other timer stored, the poison one held"] = (
            one["published"] == sizes[1] and one["poison_publishes"] >= 1
        )
    return ran


def main(args: argparse.Namespace) -> int:
    from timer_bench.procs import nats_server_version

    rounds = 1 if args.quick else args.rounds
    sizes = QUICK if args.quick else FULL
    storm, others, over_s = sizes
    cases = [args.only] if args.only else list(CASES)
    sides = ["current"] + (["baseline"] if args.baseline_ref else [])
    document: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "date": kit.today(),
        "machine": kit.machine(nats_server=nats_server_version()),
        "settings": {
            "rounds": rounds,
            "storm": {"timers": storm, "call_s": STORM_CALL_S, "quiet_after_s": QUIET_AFTER_S},
            "unacked": {"others": others, "tenants": OTHER_TENANTS, "over_s": over_s},
            "baseline_ref": args.baseline_ref,
        },
        "results": {},
        "checks": {},
    }
    with (
        tempfile.TemporaryDirectory(prefix="timer-isolation-") as scratch,
        tempfile.TemporaryDirectory(prefix="timer-isolation-baseline-") as baseline,
    ):
        tree = kit.export_tree(args.baseline_ref, Path(baseline)) if args.baseline_ref else None
        for case in cases:
            taken = asyncio.run(rounds_of(case, rounds, Path(scratch), sides, tree, sizes))
            document["results"][case] = {side: [one[side] for one in taken] for side in sides}
            for one in taken:
                for side in sides:
                    for name, ok in checks(case, side, one[side], sizes).items():
                        document["checks"][name] = document["checks"].get(name, True) and ok
    kit.write_result(document, args.output)
    from timer_bench.render import isolation_block

    print(isolation_block(document))
    return kit.report_checks(document["checks"])


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
