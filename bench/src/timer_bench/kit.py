"""What every scenario shares: clock readings and stamps, percentiles, alternated rounds and
the median of their per-round ratios, the machine a run was on, Markdown tables, and the
results files under ``bench/results``.

Standard library only: the peers' script (:mod:`timer_bench.peers`) imports it inside the
peers' own virtualenv, where Timer is not installed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any, TypeVar

#: ``bench/results``: one JSON file per scenario, read by the README and the docs.
RESULTS = Path(__file__).resolve().parents[2] / "results"
#: How many tenants the scenarios spread their timers over.
TENANTS = 50

T = TypeVar("T")


# -- time ------------------------------------------------------------------------------------


def now_ms() -> int:
    return time.time_ns() // 1_000_000


_prefixes: dict[int, str] = {}


def stamp(ms: int) -> str:
    """Epoch milliseconds as the stores and the wire write them: ``2030-01-01T00:00:00.000Z``."""
    second, milli = divmod(ms, 1000)
    prefix = _prefixes.get(second)
    if prefix is None:
        prefix = _prefixes[second] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{prefix}.{milli:03d}Z"


def epoch_ms(text: str) -> float:
    """Epoch milliseconds of a stored or wire timestamp."""
    return datetime.fromisoformat(text).astimezone(UTC).timestamp() * 1000


def today() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Stopwatch:
    """Wall-clock seconds and this process's CPU seconds (all threads) since it was made."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def elapsed(self) -> float:
        return time.perf_counter() - self.wall

    def cpu_us_per(self, count: int) -> float:
        return round((time.process_time() - self.cpu) / max(count, 1) * 1e6, 1)


def rate(count: float, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else math.inf


def mib(kib: float) -> float:
    """KiB (a process's ``/proc`` figures, a file's size / 1024) in MiB, one decimal."""
    return round(kib / 1024, 1)


# -- statistics ------------------------------------------------------------------------------


def percentiles(values_ms: Sequence[float]) -> dict[str, float]:
    """Count, p50, p99 and max (nearest rank) of millisecond values, rounded to 0.1 ms."""
    if not values_ms:
        return {"count": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    ordered = sorted(values_ms)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {
        "count": len(ordered),
        "p50_ms": round(rank(0.50), 1),
        "p99_ms": round(rank(0.99), 1),
        "max_ms": round(ordered[-1], 1),
    }


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Each round's ratio (the two sides measured in the same round)."""
    return [round(n / d, 3) for n, d in zip(numerators, denominators, strict=True)]


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the per-round ratios: the figure of alternated rounds. A round's two
    sides saw the same machine, so its ratio moves less with other work than either rate."""
    return round(median(ratios(numerators, denominators)), 3)


def median_round(rounds: Sequence[T], key: Callable[[T], float]) -> T:
    """The round whose ``key`` is the median (the lower middle one of an even count)."""
    return sorted(rounds, key=key)[(len(rounds) - 1) // 2]


async def alternated(
    rounds: int,
    sides: Sequence[str],
    measure: Callable[[str, int], Awaitable[T]],
    *,
    rotate: bool = True,
    lead: int = 0,
) -> list[dict[str, T]]:
    """``measure(side, round)`` for every side in every round, the sides one after the other
    (A, B, A, B, ...; their order rotated each round when ``rotate``), so that a change in the
    machine's load hits every side alike. A yardstick that must run right before what it
    measures comes first in ``sides`` with ``rotate=False``; with ``lead=n`` the first ``n``
    sides run first in every round and only the others rotate (a yardstick, then two
    versions of the same code taking turns to follow it)."""
    taken: list[dict[str, T]] = []
    for number in range(rounds):
        fixed, turning = list(sides[:lead]), list(sides[lead:])
        shift = number % len(turning) if rotate and turning else 0
        order = [*fixed, *turning[shift:], *turning[:shift]]
        results: dict[str, T] = {}
        for side in order:
            results[side] = await measure(side, number + 1)
        taken.append({side: results[side] for side in sides})
    return taken


# -- the machine -----------------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(**versions: str) -> dict[str, Any]:
    """Where a run is: cores, CPU, memory, Python, SQLite, the given versions, and the load
    average at its start (``load_average_end`` is added when it ends)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "memory_gib": round(memory),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        **versions,
        "load_average_start": load_average(),
    }


def describe_machine(machine: dict[str, Any], *, versions: Sequence[str] = ()) -> str:
    """One sentence: cores, CPU, the versions named, and the load (a shared machine shows)."""
    parts = [f"{machine['nproc']} cores ({machine.get('cpu', 'unknown CPU')})"]
    parts += [f"Python {machine['python']}"] if "python" in machine else []
    parts += [
        f"SQLite {machine[name]}" if name == "sqlite" else str(machine[name])
        for name in versions
        if name in machine
    ]
    load = machine.get("load_average_start")
    where = ", ".join(parts)
    if load:
        where += f"; load average {load[0]} at the start"
        if machine.get("load_average_end"):
            where += f", {machine['load_average_end'][0]} at the end"
    return where


# -- tables and numbers ----------------------------------------------------------------------


def markdown_table(header: str, rows: Iterable[str | Sequence[object]], align: str) -> str:
    """A Markdown table under ``header`` (``"a | b"``), a row a line (``"x | 1"`` or a
    sequence of cells); ``align`` has one letter a column: ``l`` left, ``r`` right."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [f"| {header} |", "| " + " | ".join(rule) + " |"]
    lines += [
        f"| {row} |" if isinstance(row, str) else f"| {' | '.join(map(str, row))} |" for row in rows
    ]
    return "\n".join(lines)


def count(value: float) -> str:
    """A count or a rate, whole, with thousands separators: 20,338."""
    return f"{round(value):,}"


def per_s(value: float) -> str:
    return f"{count(value)}/s"


def ms(value: float) -> str:
    """Milliseconds: whole from 10 on, one decimal below, "< 1" for whole-millisecond zeros."""
    if value >= 10:
        return f"{value:,.0f}"
    return f"{value:.1f}".removesuffix(".0")


def times(value: float) -> str:
    """A ratio: 1.03x."""
    return "< 0.01x" if value < 0.01 else f"{value:.2f}x"


def spread(values: Sequence[float], fmt: Callable[[float], str] = count) -> str:
    """The median, with the range of the rounds when there were several: 20,338 (19,131-20,338)."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(median(values))} ({fmt(min(values))}-{fmt(max(values))})"


# -- an earlier commit's sources -------------------------------------------------------------

#: The distributions whose sources a baseline (``--baseline-ref``) takes from another commit.
PACKAGES = (
    "timer_core",
    "timer_adapters_memory",
    "timer_adapters_sqlite",
    "timer_adapters_nats",
    "timer_adapters_postgres",
    "timer_service",
)


def export_tree(ref: str, target: Path) -> Path:
    """The packages' sources at ``ref``, unpacked under ``target`` (no git state changes)."""
    archive = subprocess.run(
        ["git", "-C", str(RESULTS.parents[1]), "archive", "--format=tar", ref, *PACKAGES],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def run_child(command: Sequence[str], tree: Path | None, what: str) -> dict[str, Any]:
    """Run ``command`` (a measuring child: its last line of output is its JSON result) on
    ``tree``'s sources (:func:`on_sources`); its result, or RuntimeError with its errors."""
    done = subprocess.run(
        command, env=on_sources(tree), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def on_sources(tree: Path | None) -> dict[str, str]:
    """This process's environment for a child that runs on ``tree``'s sources (an exported
    commit, first on its ``PYTHONPATH``), or on the checkout's own (None)."""
    env = dict(os.environ)
    if tree is not None:
        paths = [str(tree / p / "src") for p in PACKAGES]
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env


# -- results files ---------------------------------------------------------------------------


def report_checks(checks: dict[str, bool]) -> int:
    """Print each check of a scenario; its exit code (1 when one failed)."""
    for name, ok in checks.items():
        print(f"  [{'ok  ' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


def results_path(name: str) -> Path:
    return RESULTS / f"{name}.json"


def read_result(name: str, directory: Path = RESULTS) -> dict[str, Any]:
    return dict(json.loads((directory / f"{name}.json").read_text()))


def write_result(document: dict[str, Any], output: Path) -> Path:
    """Write a run's document (its ``machine`` gets the load average at the end)."""
    if "machine" in document:
        document["machine"].setdefault("load_average_end", load_average())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    progress(f"wrote {output}")
    return output
