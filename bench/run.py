"""End-to-end benchmark of ``timer-service``: its real code paths on a real ``nats-server`` and a
SQLite file, against hand-written yardsticks measured in the same run.

The service runs as a subprocess (``python -m timer_service.cli run``), so the load driver and
the observers here never share its event loop. Each scenario gets a fresh ``nats-server`` and
database; timing comes from what the service itself wrote (``registeredAt``, ``reachedAt``),
from JetStream (consumer and stream state) and from a live JetStream consumer. Every scenario
also checks correctness: nothing lost, nothing early, drained in due order.

    uv run --all-packages python bench/run.py            # full run, a few minutes
    uv run --all-packages python bench/run.py --quick    # small and fast (CI: correctness only)
    uv run --all-packages python bench/run.py --only fire,storm --profile

Writes ``bench/results/latest.json`` (``quick.json`` with ``--quick``) and prints the table.
Exits 1 when a correctness check failed; the performance goals only inform. This file is the
command line: ``harness.py`` runs the service and its broker, ``scenarios.py`` holds what is
measured, ``report.py`` the tables and the README section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    DEFAULT_BATCH,
    DEFAULT_COMMAND_BATCH,
    FULL,
    QUICK,
    RAW_BATCH,
    RESULTS,
    CheckFailed,
    Run,
    progress,
)
from report import (
    README,
    README_BEGIN,
    README_END,
    goals,
    goals_table,
    machine,
    table,
    write_readme,
)
from scenarios import SCENARIOS, run_scenarios


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help=f"TIMER_BATCH_SIZE of the service (default {DEFAULT_BATCH}, the service's own)",
    )
    parser.add_argument(
        "--command-batch-size",
        type=int,
        default=DEFAULT_COMMAND_BATCH,
        help="TIMER_COMMAND_BATCH_SIZE of the service "
        f"(default {DEFAULT_COMMAND_BATCH}, the service's own)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of the schedule and fire paths, the median reported (default 3; 1 quick)",
    )
    parser.add_argument("--only", help=f"comma-separated scenarios of {', '.join(SCENARIOS)}")
    parser.add_argument("--output", type=Path, help="JSON result path")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the service under pyinstrument; text profiles in bench/results/",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--readme", action="store_true", help="write the figures into bench/README.md too"
    )
    parser.add_argument(
        "--readme-from",
        type=Path,
        metavar="JSON",
        help="only write the figures of an earlier result into bench/README.md",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme_from is not None:
        if not write_readme(json.loads(args.readme_from.read_text())):
            print(f"no {README_BEGIN} ... {README_END} markers in {README}", file=sys.stderr)
            return 2
        return 0
    only = set(SCENARIOS) if not args.only else set(args.only.split(","))
    unknown = only - set(SCENARIOS)
    if unknown:
        print(f"unknown scenarios: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    output = args.output or RESULTS / ("quick.json" if args.quick else "latest.json")
    RESULTS.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="timer-bench-"))
    run = Run(
        sizes=QUICK if args.quick else FULL,
        quick=args.quick,
        batch_size=args.batch_size,
        command_batch_size=args.command_batch_size,
        workdir=workdir,
        profile=args.profile,
        rounds=args.rounds or (1 if args.quick else 3),
    )
    info = machine()
    progress(
        f"timer-service end to end, {'quick' if args.quick else 'full'} run on "
        f"{info['nproc']} x {info['cpu']}, load {info['load_average_start']}; "
        f"scratch {workdir}"
    )
    started = time.monotonic()
    failure: str | None = None
    try:
        asyncio.run(run_scenarios(run, only))
    except CheckFailed as exc:
        failure = str(exc)
        run.check("harness completed", False, failure)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    goal_rows = goals(run.results)
    document = {
        "mode": "quick" if args.quick else "full",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": info,
        "service": {
            "process": "subprocess: python -m timer_service.cli run (own event loop)",
            "batch_size": run.batch_size,
            "default_batch_size": DEFAULT_BATCH,
            "polling_interval_ms": 5000,
            "command_batch_size": run.command_batch_size,
            "default_command_batch_size": DEFAULT_COMMAND_BATCH,
            "yardstick_batch": RAW_BATCH,
            "rounds": run.rounds,
        },
        "sizes": run.sizes.__dict__,
        "service_startups_s": run.startups,
        "seconds": round(time.monotonic() - started, 1),
        "results": run.results,
        "goals": goal_rows,
        "checks": run.checks,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    if args.readme and not write_readme(document):
        print(f"no {README_BEGIN} ... {README_END} markers in {README}", file=sys.stderr)
    print()
    print(table(run.results, run.batch_size))
    print()
    print(goals_table(goal_rows, args.quick))
    print()
    failed = [c for c in run.checks if not c["ok"]]
    print(
        f"{len(run.checks) - len(failed)} of {len(run.checks)} checks passed in "
        f"{document['seconds']}s; results in {output}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
