"""The headline figures of the docs, rendered from one results file: bench/results/latest.json.

    uv run --all-packages python bench/summary.py      # after `python bench/run.py`

writes ``bench/results/summary.md`` (the five lines atop the Benchmarks page) and
``bench/results/sizing.md`` (the figures of the Sizing section of docs/operations.md). Both
pages include those files, so they cannot disagree with each other or with the run; a test
(tests/bench/test_summary.py) fails when the files are not what this script makes of
latest.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
LATEST = RESULTS / "latest.json"
SUMMARY = RESULTS / "summary.md"
SIZING = RESULTS / "sizing.md"

_NOTICE = "<!-- Written by bench/summary.py from bench/results/latest.json: do not edit. -->\n"


def _n(value: float) -> str:
    """A rate or count with thousands separators, no decimals: 10,988."""
    return f"{round(value):,}"


def _ms(value: float) -> str:
    """Milliseconds: whole above 10, one decimal below."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}".removesuffix(".0")


def _s(value: float) -> str:
    return f"{value:.1f}"


def _machine(document: dict[str, Any]) -> str:
    machine = document["machine"]
    load = ", ".join(str(x) for x in machine["load_average_start"])
    nats = machine["nats_server"].replace("nats-server: ", "nats-server ")
    return (
        f"{machine['nproc']} cores ({machine['cpu']}), Python {machine['python']}, "
        f"SQLite {machine['sqlite']}, {nats}; "
        f"load average {load} at the start (a shared machine)"
    )


def figures(document: dict[str, Any]) -> dict[str, str]:
    """The headline figures of a full run, formatted once for both pages."""
    results = document["results"]
    fire_default = results["fire"][str(document["service"]["default_batch_size"])]
    fire_big = results["fire"][str(document["service"]["batch_size"])]
    steady, storm, catchup = results["steady"], results["storm"], results["catchup"]
    scale = results["scale"]
    return {
        "date": document["date"].split(" ")[0],
        "machine": _machine(document),
        "batch": str(document["service"]["batch_size"]),
        "default_batch": str(document["service"]["default_batch_size"]),
        "schedule_per_s": _n(results["schedule"]["per_s"]),
        "schedule_commands": _n(results["schedule"]["commands"]),
        "fire_default_per_s": _n(fire_default["per_s"]),
        "fire_default_vs_raw": f"{fire_default['vs_raw']:.2f}",
        "fire_big_per_s": _n(fire_big["per_s"]),
        "fire_big_vs_raw": f"{fire_big['vs_raw']:.2f}",
        # A run at a batch size other than the default names its rate too; one at the default
        # has a single fire figure.
        "fire_big_note": (
            ""
            if fire_big is fire_default
            else f" ({_n(fire_big['per_s'])}/s at {document['service']['batch_size']})"
        ),
        "fire_big_and": (
            ""
            if fire_big is fire_default
            else f" and {_n(fire_big['per_s'])}/s at {document['service']['batch_size']}"
        ),
        "fire_timers": _n(fire_default["timers"]),
        "steady_rate": _n(steady["rate_per_s"]),
        "steady_s": _n(steady["seconds"]),
        "reached_p50": _ms(steady["reached_lateness"]["p50_ms"]),
        "reached_p99": _ms(steady["reached_lateness"]["p99_ms"]),
        "readable_p50": _ms(steady["readable_lateness"]["p50_ms"]),
        "readable_p99": _ms(steady["readable_lateness"]["p99_ms"]),
        "storm_timers": _n(storm["timers"]),
        "storm_s": _s(storm["fire_all_s"]),
        "storm_per_s": _n(storm["per_s"]),
        "catchup_overdue": _n(catchup["overdue"]),
        "catchup_stored": _n(catchup["stored"]),
        "catchup_s": _s(catchup["drain_s"]),
        "catchup_per_s": _n(catchup["per_s"]),
        "catchup_rss": _n(catchup["peak_rss_mb"]),
        "poll_small_ms": f"{scale['small']['empty_poll_us'] / 1000:.2f}",
        "poll_big_ms": f"{scale['big']['empty_poll_us'] / 1000:.2f}",
        "small_stored": _n(scale["small"]["stored"]),
        "big_stored": _n(scale["big"]["stored"]),
        "big_schedule_per_s": _n(scale["big"]["per_s"]),
    }


def summary_markdown(document: dict[str, Any]) -> str:
    """The five-line summary atop the Benchmarks page."""
    f = figures(document)
    return _NOTICE + (
        f"- **Scheduling:** {f['schedule_per_s']} `ScheduleTimer` commands/s taken from "
        f"JetStream, stored in SQLite and acknowledged, by one service process.\n"
        f"- **Firing:** {f['fire_default_per_s']} timers/s at the default batch of "
        f"{f['default_batch']}{f['fire_big_note']}, each an "
        f"acknowledged JetStream publish and a mark: {f['fire_default_vs_raw']}x a "
        f"hand-written raw `sqlite3` + nats-py loop doing the same work.\n"
        f"- **Lateness:** at a steady {f['steady_rate']} timers/s, fired {f['reached_p50']} ms "
        f"(p50) / {f['reached_p99']} ms (p99) after their due time, readable by a consumer "
        f"{f['readable_p50']} / {f['readable_p99']} ms after it.\n"
        f"- **Bursts:** {f['storm_timers']} timers due at one instant all fired within "
        f"{f['storm_s']} s; after downtime, {f['catchup_overdue']} overdue timers among "
        f"{f['catchup_stored']} stored drained in {f['catchup_s']} s, in "
        f"{f['catchup_rss']} MiB.\n"
        f"- **Flat with size:** an idle poll costs {f['poll_small_ms']} ms with "
        f"{f['small_stored']} timers stored and {f['poll_big_ms']} ms with {f['big_stored']}.\n"
        f"\n"
        f"Measured end to end with `python bench/run.py` on {f['date']}: the real "
        f"`timer-service` process, a real `nats-server` with file storage, medians of 3 "
        f"rounds; {f['machine']}.\n"
    )


def sizing_markdown(document: dict[str, Any]) -> str:
    """The figures of the Sizing section of docs/operations.md."""
    f = figures(document)
    return _NOTICE + (
        f"- **Commands.** One instance on SQLite takes in about {f['schedule_per_s']} "
        f"`ScheduleTimer` commands/s (fetched from JetStream, stored, acknowledged) with "
        f"`TIMER_BATCH_SIZE={f['batch']}`, and about {f['big_schedule_per_s']}/s with a "
        f"million timers already stored.\n"
        f"- **Firing.** It fires about {f['fire_default_per_s']} timers/s at the default "
        f"`TIMER_BATCH_SIZE` of {f['default_batch']}{f['fire_big_and']}, each event "
        f"acknowledged by JetStream before its timer is marked. A "
        f"burst is worked off at that rate: {f['storm_timers']} timers due at the same "
        f"instant were all out within {f['storm_s']} s, so the last of them were that "
        f"late.\n"
        f"- **Lateness under load.** At a steady {f['steady_rate']} timers/s, p50 "
        f"{f['reached_p50']} ms and p99 {f['reached_p99']} ms from `dueAt` to `reachedAt` (the "
        f"moment the worker fires the timer); a consumer reads the event p50 "
        f"{f['readable_p50']} ms and p99 {f['readable_p99']} ms after `dueAt`.\n"
        f"- **Catching up.** After downtime, {f['catchup_overdue']} overdue timers among "
        f"{f['catchup_stored']} stored drained in {f['catchup_s']} s "
        f"({f['catchup_per_s']}/s); the service's peak memory was {f['catchup_rss']} MiB.\n"
        f"- **Idle cost.** A poll that finds nothing costs {f['poll_big_ms']} ms with "
        f"{f['big_stored']} timers stored, the same as with {f['small_stored']}: the "
        f"due-time index makes it independent of the table size.\n"
        f"\n"
        f"Measured on {f['date']} with `python bench/run.py` on {f['machine']}.\n"
    )


def main() -> int:
    document = json.loads(LATEST.read_text())
    if document.get("mode") != "full":
        print(f"{LATEST} is not a full run: refusing to publish its figures", file=sys.stderr)
        return 2
    SUMMARY.write_text(summary_markdown(document))
    SIZING.write_text(sizing_markdown(document))
    print(f"wrote {SUMMARY.name} and {SIZING.name} from {LATEST.name} ({document['date']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
