"""The report of ``bench/run.py``: the machine, the figures table, the performance goals, and
the figures' section of bench/README.md."""

from __future__ import annotations

import contextlib
import os
import platform
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

from harness import DEFAULT_BATCH, RAW_BATCH

from timer_adapters_nats import (
    find_nats_server,
)


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        nats_version = subprocess.run(
            [str(find_nats_server()), "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        nats_version = "unknown"
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "nats_server": nats_version,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


def goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets: ratios to the yardsticks measured in the same run come first."""
    rows: list[dict[str, Any]] = []

    def goal(name: str, value: Any, target: str, ok: bool | None) -> None:
        rows.append({"goal": name, "value": value, "target": target, "met": ok})

    if "fire" in r:
        for size, fire in sorted(r["fire"].items(), key=lambda kv: int(kv[0])):
            ratio = fire["vs_raw"]
            goal(
                f"fire path (batch {size}) / raw pipeline (batch {RAW_BATCH})",
                ratio,
                ">= 0.9",
                ratio >= 0.9,
            )
    if "schedule" in r and "vs_raw" in r["schedule"]:
        ratio = r["schedule"]["vs_raw"]
        goal(
            f"schedule path (fetch {r['schedule'].get('fetch_batch')}) / raw pipeline "
            f"(fetch {RAW_BATCH})",
            ratio,
            ">= 0.9",
            ratio >= 0.9,
        )
    if "steady" in r:
        late = r["steady"]["reached_lateness"]
        goal("steady lateness p99 (reachedAt), ms", late["p99_ms"], "<= 20", late["p99_ms"] <= 20)
        late = r["steady"]["readable_lateness"]
        goal("steady lateness p99 (readable), ms", late["p99_ms"], "<= 50", late["p99_ms"] <= 50)
    if "catchup" in r:
        rss = r["catchup"]["peak_rss_mb"]
        goal("catch-up: peak RSS of the service, MiB", rss, "<= 200", rss <= 200)
    if "scale" in r:
        small, big = r["scale"]["small"], r["scale"]["big"]
        for key, what in (("empty_poll_us", "empty poll"), ("find_due_us", "find_due batch")):
            ratio = round(big[key] / small[key], 2)
            goal(f"{what} cost, big / small store", ratio, "<= 1.5 (flat)", ratio <= 1.5)
        ratio = round(big["per_s"] / small["per_s"], 2)
        goal("schedule rate, big / small store", ratio, ">= 0.67 (flat)", ratio >= 0.67)
    return rows


def with_rounds(name: str, result: dict[str, Any]) -> tuple[str, str]:
    """A rate's table row, with its rounds when there were several."""
    rounds = result.get("rounds_per_s")
    if not rounds:
        return name, f"{result['per_s']:,.0f}/s"
    each = " / ".join(f"{x:,.0f}" for x in rounds)
    return f"{name} (median of {len(rounds)} rounds)", f"{result['per_s']:,.0f}/s ({each})"


def loads(result: dict[str, Any]) -> str:
    """The load averages at the start of each round, as a table cell shows them."""
    return " / ".join(str(x) for x in result.get("rounds_load", [result.get("load", "?")]))


def table(r: dict[str, Any], batch_size: int) -> str:
    lines = ["| measure | value |", "| --- | ---: |"]

    def row(name: str, value: str) -> None:
        lines.append(f"| {name} | {value} |")

    yardsticks = r.get("yardsticks", {})
    # The headline: Timer as a ratio to the hand-written pipeline in the same run.
    if "fire" in r:
        for batch, f in sorted(r["fire"].items(), key=lambda kv: int(kv[0])):
            each = " / ".join(str(x) for x in f.get("rounds_vs_raw", [f["vs_raw"]]))
            row(
                f"**fire path (batch {batch}) / raw pipeline (batch {RAW_BATCH})**, "
                "median round (each round; 1-min load average at each round's start)",
                f"**{f['vs_raw']}** ({each}; load {loads(f)})",
            )
    if "schedule" in r and "vs_raw" in r["schedule"]:
        s = r["schedule"]
        each = " / ".join(str(x) for x in s.get("rounds_vs_raw", [s["vs_raw"]]))
        row(
            f"**schedule path (fetch {s.get('fetch_batch')}) / raw pipeline (fetch "
            f"{RAW_BATCH})**, median round (each round; 1-min load average at each round's "
            "start)",
            f"**{s['vs_raw']}** ({each}; load {loads(s)})",
        )
    for batch, value in yardsticks.get("raw_upserts_per_s", {}).items():
        row(f"yardstick: raw sqlite3 upserts, {batch}/transaction", f"{value:,.0f}/s")
    if "raw_schedule" in yardsticks:
        raw = yardsticks["raw_schedule"]
        name, value = with_rounds(
            f"yardstick: raw fetch -> upsert -> ack, batch {raw['batch']}", raw
        )
        row(name, f"{value} ({raw['cpu_us_per_command']} us CPU/command)")
    for batch, raw in yardsticks.get("raw_pipeline", {}).items():
        name, value = with_rounds(
            f"yardstick: raw select -> publish_async -> mark, batch {batch}", raw
        )
        row(name, f"{value} ({raw['cpu_us_per_timer']} us CPU/timer)")
    if "schedule" in r:
        s = r["schedule"]
        name, value = with_rounds(
            f"schedule path: {s['commands']:,} ScheduleTimer -> stored + acked", s
        )
        row(name, f"{value} ({s['cpu_us_per_command']} us CPU/command)")
    if "fire" in r:
        for batch, f in sorted(r["fire"].items(), key=lambda kv: int(kv[0])):
            label = "default" if int(batch) == DEFAULT_BATCH else "set by --batch-size"
            name, value = with_rounds(
                f"fire path: {f['timers']:,} due -> published + Reached, batch {batch} ({label})",
                f,
            )
            row(name, f"{value} ({f['cpu_us_per_timer']} us CPU/timer)")
    if "steady" in r:
        s = r["steady"]
        for key, what in (("reached_lateness", "reachedAt"), ("readable_lateness", "readable")):
            late = s[key]
            row(
                f"steady {s['rate_per_s']:,}/s for {s['seconds']:.0f}s: lateness ({what}) "
                "p50 / p99 / max",
                f"{late['p50_ms']} / {late['p99_ms']} / {late['max_ms']} ms",
            )
    if "storm" in r:
        s = r["storm"]
        row(f"storm: {s['timers']:,} due at one instant, all fired", f"{s['fire_all_s']} s")
        row("storm: all events readable", f"{s['all_readable_s']} s")
        late = s["reached_lateness"]
        row("storm: lateness (reachedAt) p50 / p99", f"{late['p50_ms']} / {late['p99_ms']} ms")
    if "catchup" in r:
        c = r["catchup"]
        row(
            f"catch-up: {c['overdue']:,} overdue of {c['stored']:,} stored, drain",
            f"{c['drain_s']} s ({c['per_s']:,.0f}/s)",
        )
        row("catch-up: peak RSS of the service", f"{c['peak_rss_mb']} MiB")
    if "scale" in r:
        for s in r["scale"].values():
            row(
                f"scale: {s['stored']:,} stored: empty poll / find_due({batch_size})",
                f"{s['empty_poll_us']} / {s['find_due_us']} us",
            )
            row(
                *with_rounds(
                    f"scale: {s['stored']:,} stored: schedule {s['commands']:,} commands", s
                )
            )
    return "\n".join(lines)


def goals_table(rows: list[dict[str, Any]], quick: bool) -> str:
    lines = ["| goal | value | target | met |", "| --- | ---: | ---: | --- |"]
    for g in rows:
        met = "-" if g["met"] is None else ("yes" if g["met"] else "NO")
        lines.append(f"| {g['goal']} | {g['value']} | {g['target']} | {met} |")
    if quick:
        lines.append("")
        lines.append("(--quick: sizes too small for the figures to mean anything)")
    return "\n".join(lines)


README = Path(__file__).with_name("README.md")
README_BEGIN = "<!-- run:begin -->"
README_END = "<!-- run:end -->"


def readme_block(document: dict[str, Any]) -> str:
    """The figures of one run, as the README's section shows them."""
    machine, service = document["machine"], document["service"]
    load = ", ".join(str(x) for x in machine["load_average_start"])
    load_end = ", ".join(str(x) for x in machine.get("load_average_end", []))
    head = (
        f"Run: `python bench/run.py` ({document['mode']}) on {document.get('date', '?')}, "
        f"{document['seconds']} s. Machine: nproc {machine['nproc']}, {machine['cpu']}; "
        f"Python {machine['python']}, SQLite {machine['sqlite']}, {machine['nats_server']}; "
        f"load average {load} at the start, {load_end} at the end. Service: "
        f"{service['process']}, `TIMER_BATCH_SIZE={service['batch_size']}` (default "
        f"{service['default_batch_size']}), `TIMER_COMMAND_BATCH_SIZE="
        f"{service.get('command_batch_size', '?')}` (default "
        f"{service.get('default_command_batch_size', '?')}), polling interval "
        f"{service['polling_interval_ms']} ms (the default); the yardsticks fetch, select and "
        f"mark {service.get('yardstick_batch', RAW_BATCH)} at a time, each right before the "
        "service's round."
        + (
            f" The schedule and fire paths ran {service['rounds']} rounds each; the median "
            "round is shown."
            if service.get("rounds", 1) > 1
            else ""
        )
    )
    failed = [c for c in document["checks"] if not c["ok"]]
    checks = (
        f"{len(document['checks']) - len(failed)} of {len(document['checks'])} correctness "
        "checks passed" + (f"; failed: {', '.join(c['check'] for c in failed)}" if failed else "")
    )
    return "\n\n".join(
        [
            head,
            table(document["results"], service["batch_size"]),
            goals_table(document["goals"], document["mode"] == "quick"),
            checks + ".",
        ]
    )


def write_readme(document: dict[str, Any]) -> bool:
    """Put the run's figures between the section's markers; False when they are missing."""
    text = README.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        return False
    block = f"{README_BEGIN}\n{readme_block(document)}\n{README_END}"
    README.write_text(text[:begin] + block + text[end + len(README_END) :])
    return True
