"""Benchmark of acked JetStream publishing: sequential vs NatsEventPublisher's window, in one run.

Every path publishes ``DueTimeReached`` envelopes encoded as ``NatsEventPublisher`` encodes
them (``encode_event``, equal to the codec's bytes), each with a fresh envelope id and the
``Nats-Msg-Id`` header, to a real ``nats-server`` (file storage) started here. Rows:
sequential ``js.publish`` (one acked round trip at a time, the baseline), sequential
``NatsEventPublisher.publish``, ``publish_many`` in batches of 100 (the worker's default)
and 1,000, and core NATS publish without JetStream as the upper bound. Prints a table and
writes it into the "NATS (bench/publish.py)" section of bench/README.md.

    uv run --all-packages python bench/publish.py            # full run (about a minute)
    uv run --all-packages python bench/publish.py --quick    # small counts, README untouched
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path

from _readme import write_section

from timer_adapters_nats import (
    NatsBroker,
    NatsServerProcess,
    NatsSettings,
    find_nats_server,
)
from timer_core import (
    DueTimeReached,
    MessageEnvelope,
    TimerEntry,
    build_due_event,
)
from timer_core import encode_envelope as encode_event  # the publisher's encoder

README = Path(__file__).with_name("README.md")
SECTION = "## NATS (bench/publish.py)"
T0 = datetime(2030, 1, 1, tzinfo=UTC)
Event = MessageEnvelope[DueTimeReached]
Row = tuple[str, int, list[float]]  # path, messages per round, msg/s of each round

_serial = itertools.count()


def firings(count: int) -> list[Event]:
    """``count`` distinct firings (distinct ids) over 50 tenants; never seen before this run."""
    out = []
    for _ in range(count):
        i = next(_serial)
        entry = TimerEntry(
            tenant_id=f"tenant-{i % 50}",
            service_call_id=f"call-{i:08d}",
            due_at=T0 + timedelta(milliseconds=i),
            registered_at=T0,
            correlation_id=f"trace-{i:08d}",
        )
        out.append(build_due_event(entry, entry.due_at + timedelta(milliseconds=3)))
    return out


async def timed(count: int, run: Callable[[list[Event]], Awaitable[None]]) -> float:
    """Messages per second of ``run`` over ``count`` fresh firings."""
    batch = firings(count)
    started = time.perf_counter()
    await run(batch)
    return count / (time.perf_counter() - started)


async def measure(sequential: int, batched: int, repeat: int) -> list[Row]:
    """Run every path against one fresh server; rows of (path, messages, msg/s per round)."""
    with (
        tempfile.TemporaryDirectory(prefix="timer-bench-nats-") as store,
        NatsServerProcess(Path(store)) as server,
    ):
        async with NatsBroker(NatsSettings(url=server.url)) as broker:
            return await _measure(broker, sequential, batched, repeat)


async def _measure(broker: NatsBroker, sequential: int, batched: int, repeat: int) -> list[Row]:
    subjects = broker.settings.subjects
    js = broker.client.jetstream(timeout=5)
    nc = broker.client
    publisher = broker.publisher

    async def js_sequential(batch: list[Event]) -> None:
        for e in batch:
            await js.publish(
                subjects.events(e.tenant_id, e.payload.service_call_id),
                encode_event(e),
                headers={"Nats-Msg-Id": e.id},
            )

    async def publisher_sequential(batch: list[Event]) -> None:
        for e in batch:
            await publisher.publish(e)

    def publish_many(size: int) -> Callable[[list[Event]], Awaitable[None]]:
        async def run(batch: list[Event]) -> None:
            for start in range(0, len(batch), size):
                results = await publisher.publish_many(batch[start : start + size])
                assert all(r is None for r in results), results

        return run

    async def core(batch: list[Event]) -> None:
        for e in batch:
            # Not in any stream: no storage, no ack; what the client and server can move.
            await nc.publish(
                f"bench.core.{e.tenant_id}.{e.payload.service_call_id}",
                encode_event(e),
                headers={"Nats-Msg-Id": e.id},
            )
        await nc.flush()

    await timed(500, publish_many(100))  # warm up the connection and the stream
    rows = [
        ("sequential acked, `js.publish` (baseline)", sequential, js_sequential),
        ("sequential acked, `NatsEventPublisher.publish`", sequential, publisher_sequential),
        ("batched acked, `publish_many` x 100", batched, publish_many(100)),
        ("batched acked, `publish_many` x 1,000", batched, publish_many(1000)),
        ("core NATS publish, no JetStream (upper bound)", batched, core),
    ]
    # Rounds run every row in turn, so a burst of load elsewhere hits all rows alike.
    rates: list[list[float]] = [[] for _ in rows]
    for round_ in range(repeat):
        for index, (_, count, run) in enumerate(rows):
            rates[index].append(await timed(count, run))
        print(
            f"  round {round_ + 1}: " + ", ".join(f"{r[-1]:,.0f}" for r in rates), file=sys.stderr
        )
    return [(name, count, rates[index]) for index, (name, count, _) in enumerate(rows)]


def machine() -> str:
    """nproc, CPU model, Python, nats-server and nats-py versions, load at start."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    server = subprocess.run(
        [str(find_nats_server()), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"nproc {os.cpu_count()}, {model}; Python {platform.python_version()}, {server}, "
        f"nats-py {version('nats-py')}; load average at start {load}"
    )


def table(rows: list[Row], window: int) -> str:
    """The table of medians, and the headline: the median of per-round speedups.

    Each round measures every row back to back, so its batched/baseline ratio compares runs
    under about the same load from elsewhere; the median of those ratios is the headline.
    """
    baseline = rows[0][2]
    lines = [
        "| path | messages | msg/s (median) | vs baseline (median of rounds) |",
        "| --- | ---: | ---: | ---: |",
    ]
    speedups: dict[str, float] = {}
    for name, count, rates in rows:
        ratio = statistics.median(r / b for r, b in zip(rates, baseline, strict=True))
        speedups[name] = ratio
        lines.append(f"| {name} | {count:,} | {statistics.median(rates):,.0f} | {ratio:.1f}x |")
    batched = {name: ratio for name, ratio in speedups.items() if "publish_many" in name}
    best = max(batched, key=batched.__getitem__)
    per_round = "; ".join(
        f"{name.split(', ')[1]}: "
        + ", ".join(f"{r / b:.1f}x" for r, b in zip(rates, baseline, strict=True))
        for name, _, rates in rows
        if name in batched
    )
    lines += [
        "",
        f"Batched acked publish ({best.split(', ')[1]}) is **{batched[best]:.1f}x** the "
        f"sequential baseline (publish window {window}). "
        f"Speedup in each round: {per_round}.",
    ]
    return "\n".join(lines)


def write_readme(body: str) -> None:
    """Replace (or append) this benchmark's section of bench/README.md, nothing else."""
    write_section(SECTION, body, README)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, README untouched")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the median counts")
    args = parser.parse_args()
    sequential, batched = (300, 2_000) if args.quick else (3_000, 20_000)
    where = machine()
    print(f"machine: {where}", file=sys.stderr)
    results = asyncio.run(measure(sequential, batched, args.repeat))
    window = NatsSettings(url="nats://unused").publish_window
    body = "\n\n".join(
        [
            "Acked publishes of `DueTimeReached` envelopes (encoded as the publisher does, "
            "fresh id, `Nats-Msg-Id` header) to `TIMER_EVENTS` (file storage) on a local "
            f"`nats-server` started by the script; median of {args.repeat} rounds, each "
            "running every row in turn. Reproduce: "
            "`uv run --all-packages python bench/publish.py`.",
            table(results, window),
            f"Machine: {where}. The machine is shared with other work, so absolute numbers "
            "move between runs; the rows of one run are comparable.",
        ]
    )
    print(body)
    if not args.quick:
        write_readme(body)


if __name__ == "__main__":
    main()
