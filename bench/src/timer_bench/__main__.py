"""``python -m timer_bench <scenario>``: one command per figure; ``render`` writes the tables
of bench/README.md and the figures of docs/*.md, README.md and CHANGELOG.md from
bench/results (``render --check`` fails when any is stale)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from timer_bench import kit

#: Scenario -> (module, what it measures). Each writes results/<scenario>.json.
SCENARIOS = {
    "e2e": ("e2e", "the service end to end on SQLite against raw yardsticks"),
    "fire-tenants": ("e2e", "the fire path at the defaults over 50 tenants, 5 alternated rounds"),
    "scale-out": ("scale_out", "1, 2 and 4 services on PostgreSQL against raw pipelines"),
    "scale-out-steady": ("scale_out", "steady lateness of 1, 2 and 4 services on PostgreSQL"),
    "backlog-sqlite": ("backlog", "a big overdue backlog drained on SQLite"),
    "backlog-postgres": ("backlog", "a big overdue backlog drained by services on PostgreSQL"),
    "compare": ("compare", "Timer beside pgqueuer, DBOS, awa and APScheduler on one machine"),
    "compare-pending": ("compare", "the PostgreSQL race with 1,000,000 future jobs stored"),
    "large-sqlite": ("large", "the service on SQLite with millions of pending and fired timers"),
    "large-postgres": ("large", "services on PostgreSQL with millions of pending and fired timers"),
    "store": ("store", "SqliteTimerStore against raw sqlite3"),
    "publish": ("publish", "acked JetStream publishing, sequential and windowed"),
    "otel": ("otel", "what OpenTelemetry costs the fire path"),
    "fairness": ("fairness", "a quiet tenant's lateness during another tenant's storm"),
    "flood": ("flood", "a quiet tenant's timers while another floods its commands"),
    "command-order": ("command_order", "the SQLite store's writes with command positions"),
    "handlers": ("handlers", "Timer calling a no-op handler, against a hand-written loop"),
    "isolation": ("isolation", "lateness beside a storm (handlers) or an unacknowledged publish"),
    "console-sqlite": ("console", "the console's pages and the census at 10M timers on SQLite"),
    "console-postgres": (
        "console",
        "the console's pages and the census at 10M timers on PostgreSQL",
    ),
    "durability": ("durability", "synced command commits at the defaults beside the old ones"),
    "handlers-pythons": (
        "pythons",
        "the handler path on another CPython (3.14) beside this machine's, alternated",
    ),
    "faults": ("faults", "the nine fault and pressure scenarios on PostgreSQL, with recovery"),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m timer_bench", description=__doc__)
    commands = top.add_subparsers(dest="scenario", required=True)
    for name, (module, what) in SCENARIOS.items():
        sub = commands.add_parser(name, help=what, description=what)
        importlib.import_module(f"timer_bench.{module}").add_arguments(sub)
        sub.add_argument("--output", help="results file (default bench/results/<scenario>.json)")
    render = commands.add_parser(
        "render", help="the tables and figures of bench/README.md and the docs, from bench/results"
    )
    render.add_argument("--check", action="store_true", help="fail if any is stale")
    return top


def result_name(args: argparse.Namespace) -> str:
    """The results file a run writes by default: ``<scenario>``, ``quick-<scenario>``, and
    for ``e2e --only`` a name of its own, so that a probe of some scenarios leaves the full
    run's figures alone."""
    name = f"quick-{args.scenario}" if getattr(args, "quick", False) else args.scenario
    only = getattr(args, "only", None)
    if only and args.scenario == "e2e":
        name += "-only-" + "-".join(sorted(only.split(",")))
    return name


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.scenario == "render":
        from timer_bench import pages, render

        readme = render.main(check=args.check)
        return pages.main(check=args.check) or readme
    args.output = Path(args.output) if args.output else kit.results_path(result_name(args))
    module = importlib.import_module(f"timer_bench.{SCENARIOS[args.scenario][0]}")
    code: int = module.main(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
