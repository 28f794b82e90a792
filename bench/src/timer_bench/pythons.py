"""The handler path on another CPython beside this machine's (``handlers-pythons``).

``python -m timer_bench handlers`` (one round of its loops over ``--jobs`` due timers,
the handler path at its default settings among them) is run in alternated rounds by this
machine's interpreter and by another CPython, the one in the Debian root that ``.ci/python``
builds (``.ci/python --run 3.14 python ...``: this checkout, the locked packages synced into
the root's virtualenv, the same machine). In the same rounds it runs once more on the other
interpreter with handler calls' eager task starts turned off
(:attr:`timer_core.handlers.HandlerCalls.eager_start`), which tells what eager starts save
apart from all else that differs between the two interpreters: their builds, and the SQLite
each links. The sides rotate every round; the figure is the median of the per-round ratios
of the handler path at its default settings, the other interpreter's to this one's.
``.ci/python`` needs root; ``--python this`` runs every side on this machine's interpreter
(the kit's own check, no root needed).

Each side runs in a process of its own: ``python -m timer_bench.pythons [--lazy] --jobs N``
runs ``handlers`` into a scratch file and prints its document, with the interpreter that
ran it, as one line of JSON on stdout (the root's checkout is a throwaway overlay, so no
file of the run outlives it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from timer_bench import kit

#: The sides of a round: this interpreter, the other, the other with eager starts off.
SIDES = ["this", "other", "other_lazy"]
#: The loops of ``handlers``' SQLite rounds that each side reports.
LOOPS = ["timer", "timer_tuned", "raw", "store_loop"]
#: The script that runs a command in another CPython's Debian root.
CI_PYTHON = kit.RESULTS.parents[1] / ".ci" / "python"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one round of 1,000 timers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument(
        "--python",
        default="3.14",
        help="the other interpreter: a version .ci/python has a root for (default 3.14), or "
        "'this' for this machine's (no root needed)",
    )


def command(side: str, python: str, jobs: int) -> list[str]:
    """The process that measures one side of a round."""
    inner = ["-m", "timer_bench.pythons", "--jobs", str(jobs)]
    inner += ["--lazy"] if side == "other_lazy" else []
    if side == "this" or python == "this":
        return [sys.executable, *inner]
    return [str(CI_PYTHON), "--run", python, "python", *inner]


def origins(python: str) -> dict[str, str]:
    """Where each side's interpreter comes from, in words."""
    other = "this machine's" if python == "this" else f"Debian's (`.ci/python {python}`)"
    return {"this": "this machine's", "other": other, "other_lazy": other}


def measure_side(argv: list[str]) -> dict[str, Any]:
    """Run one side's process; its document (the last line of its output)."""
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stdout[-2000:]}")
    return dict(json.loads(lines[-1]))


def interpreter() -> dict[str, Any]:
    """The interpreter running this process: version, build, the SQLite it links, and
    whether handler calls start eagerly."""
    import sqlite3

    from timer_core.handlers import HandlerCalls

    return {
        "python": sys.version.split()[0],
        "version": sys.version,
        "executable": sys.executable,
        "config_args": sysconfig.get_config_var("CONFIG_ARGS") or "",
        "sqlite": sqlite3.sqlite_version,
        "eager_start": HandlerCalls.eager_start,
    }


def summary(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Each side's handler path per round and median, its ratio to the hand-written loop on
    the same interpreter, and the ratios between the sides (medians of the rounds' own)."""

    def timer(side: str) -> list[float]:
        return [r[side]["timer"] for r in rounds]

    out: dict[str, Any] = {
        side: {
            "timer_per_s": timer(side),
            "median_per_s": kit.median(timer(side)),
            "vs_raw": kit.median_ratio(timer(side), [r[side]["raw"] for r in rounds]),
        }
        for side in SIDES
    }
    out["other_vs_this"] = kit.median_ratio(timer("other"), timer("this"))
    out["other_vs_this_rounds"] = kit.ratios(timer("other"), timer("this"))
    out["other_lazy_vs_this"] = kit.median_ratio(timer("other_lazy"), timer("this"))
    out["eager_vs_lazy"] = kit.median_ratio(timer("other"), timer("other_lazy"))
    out["eager_vs_lazy_rounds"] = kit.ratios(timer("other"), timer("other_lazy"))
    return out


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.jobs = 1, 1_000
    document: dict[str, Any] = {
        "date": kit.today(),
        "machine": kit.machine(),
        "settings": {
            "rounds": args.rounds,
            "jobs": args.jobs,
            "python": args.python,
            "command": f"python -m timer_bench handlers --rounds 1 --jobs {args.jobs}",
            "origins": origins(args.python),
        },
    }
    interpreters: dict[str, dict[str, Any]] = {}
    settings: dict[str, Any] = {}

    async def measure(side: str, number: int) -> dict[str, float]:
        report = await asyncio.to_thread(measure_side, command(side, args.python, args.jobs))
        interpreters.setdefault(side, report["interpreter"])
        settings.setdefault("handlers", report["document"]["settings"])
        sqlite = report["document"]["sqlite"]
        taken = {loop: float(sqlite[loop]["median_per_s"]) for loop in LOOPS}
        taken["load"] = report["document"]["machine"]["load_average_start"][0]
        kit.progress(f"round {number}: {side} handler path {kit.per_s(taken['timer'])}")
        return taken

    rounds = asyncio.run(kit.alternated(args.rounds, SIDES, measure))
    document["interpreters"] = interpreters
    document["settings"]["handlers"] = settings["handlers"]
    document["rounds"] = rounds
    document.update(summary(rounds))
    kit.write_result(document, args.output)
    from timer_bench.render import handlers_pythons_block

    print(handlers_pythons_block(document))
    return 0


def side(argv: list[str] | None = None) -> int:
    """One side of a round, in its own process: ``handlers`` once, its document and this
    interpreter as one line of JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python -m timer_bench.pythons")
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--lazy", action="store_true", help="handler calls' eager starts off")
    args = parser.parse_args(argv)
    from timer_bench.__main__ import main as bench
    from timer_core.handlers import HandlerCalls

    if args.lazy:
        HandlerCalls.eager_start = False
    with tempfile.TemporaryDirectory(prefix="timer-pythons-") as scratch:
        output = Path(scratch) / "handlers.json"
        with contextlib.redirect_stdout(io.StringIO()):  # its table: the outer run prints one
            code = bench(
                ["handlers", "--rounds", "1", "--jobs", str(args.jobs), "--output", str(output)]
            )
        if code:
            return code
        document = json.loads(output.read_text())
    print(json.dumps({"document": document, "interpreter": interpreter()}))
    return 0


if __name__ == "__main__":
    sys.exit(side())
