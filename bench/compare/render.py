"""The comparison table of docs/comparison.md, rendered from bench/results/compare.json.

    uv run --all-packages python bench/compare/render.py   # after bench/compare/run.py

writes ``bench/results/comparison.md``, which the page includes; a test
(tests/bench/test_comparison.py) fails when it is not what this script makes of the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
COMPARE = RESULTS / "compare.json"
TABLE = RESULTS / "comparison.md"

_NOTICE = (
    "<!-- Written by bench/compare/render.py from bench/results/compare.json: do not edit. -->\n"
)


def _rate(value: float) -> str:
    return f"{round(value):,}/s"


def _ms(value: float) -> str:
    """Milliseconds; Timer's timestamps are whole milliseconds, so 0 reads "< 1"."""
    if value < 1:
        return "< 1"
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def _ratio(value: float) -> str:
    return "< 0.01x" if value < 0.01 else f"{value:.2f}x"


def systems(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, name with version, what it runs on) of each system, Timer first."""
    peers = document["peers"]
    postgres = document["machine"]["postgres"].split(" (")[0]
    return [
        (
            "timer",
            f"Timer {document.get('timer_version', '')}".rstrip(),
            "SQLite; each firing an acked JetStream publish",
        ),
        ("pgqueuer", f"pgqueuer {peers['pgqueuer']}", f"{postgres}, asyncpg {peers['asyncpg']}"),
        (
            "apscheduler",
            f"APScheduler {peers['apscheduler[sqlalchemy]']}",
            f"SQLite via SQLAlchemy {peers['sqlalchemy[asyncio]']} + aiosqlite "
            f"{peers['aiosqlite']}",
        ),
    ]


def render(document: dict[str, Any]) -> str:
    """The results table, the yardstick table and the conditions of the run."""
    settings, machine = document["settings"], document["machine"]
    lines = [
        _NOTICE,
        "| system | schedule | fire | lateness p50 / p99 | runs on |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for key, name, runs_on in systems(document):
        s = document["systems"][key]
        lines.append(
            f"| **{name}** "
            f"| {_rate(s['schedule_per_s']['median'])} ({_ratio(s['schedule_vs_raw']['median'])}) "
            f"| {_rate(s['fire_per_s']['median'])} ({_ratio(s['fire_vs_raw']['median'])}) "
            f"| {_ms(s['lateness.p50_ms']['median'])} / {_ms(s['lateness.p99_ms']['median'])} ms "
            f"| {runs_on} |"
        )
    lines += [
        "",
        "In brackets: the rate as a fraction of the system's own raw yardstick, the same "
        "database work written by hand in the same round:",
        "",
        "| yardstick | insert | claim and complete |",
        "| --- | ---: | ---: |",
    ]
    yardsticks = {
        "timer": "raw `sqlite3` upserts, 100 a commit; select 100 due, acked nats-py publishes, "
        "mark, one commit",
        "pgqueuer": "raw asyncpg: `INSERT ... unnest(...)` of 100 rows; `UPDATE ... FOR UPDATE "
        "SKIP LOCKED LIMIT 100 RETURNING` then `DELETE`",
        "apscheduler": "raw `sqlite3`: one insert a commit (as `add_schedule`); select 100 due and "
        "delete them, one commit",
    }
    for key, name, _ in systems(document):
        s = document["systems"][key]
        lines.append(
            f"| {name}: {yardsticks[key]} "
            f"| {_rate(s['yardstick.insert_per_s']['median'])} "
            f"| {_rate(s['yardstick.claim_delete_per_s']['median'])} |"
        )
    load = ", ".join(str(x) for x in machine["load_average_start"])
    load_end = ", ".join(str(x) for x in machine["load_average_end"])
    jobs = settings["jobs"]
    lines += [
        "",
        f"Run: `python bench/compare/run.py` on {document['date']}, medians of "
        f"{settings['rounds']} rounds (each system in turn in every round). Schedule and fire: "
        f"{jobs['timer']:,} jobs for Timer and pgqueuer, {jobs['apscheduler']:,} for "
        f"APScheduler (it is slower; its rates do not depend on the count), batches of "
        f"{settings['batch']}; lateness: {settings['steady_rate_per_s']} new jobs/s for "
        f"{settings['steady_seconds']:.0f} s, each due 1-2 s ahead. SQLite: "
        f"{settings['sqlite']}. PostgreSQL: "
        + ", ".join(f"`{k}={v}`" for k, v in settings["postgres"].items())
        + f". Machine: {machine['nproc']} cores ({machine['cpu']}), Python "
        f"{machine['python']}, SQLite {machine['sqlite']}, {machine['postgres']}; **shared "
        f"with other developers' work: load average {load} at the start, {load_end} at the "
        f"end**, so compare the ratios and the systems with each other, not the absolute "
        f"rates with other machines.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    document = json.loads(COMPARE.read_text())
    TABLE.write_text(render(document))
    print(f"wrote {TABLE.name} from {COMPARE.name} ({document['date']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
