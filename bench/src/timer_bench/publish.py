"""Acked JetStream publishing of ``DueTimeReached`` envelopes, encoded as the publisher encodes
them (fresh ids, ``Nats-Msg-Id``): sequential ``js.publish`` (the baseline), sequential
``NatsEventPublisher.publish``, ``publish_many`` by 100 and 1,000, and core NATS without
JetStream as the upper bound; every path once a round, rounds in turn."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings
from timer_bench import kit
from timer_bench.procs import nats_server_version, package_versions
from timer_core import DueTimeReached, MessageEnvelope, TimerEntry
from timer_core.codec import encode_envelope
from timer_core.events import build_due_event

Event = MessageEnvelope[DueTimeReached]
T0 = datetime(2030, 1, 1, tzinfo=UTC)
BASELINE = "sequential acked, `js.publish` (baseline)"
_serial = itertools.count()


def firings(count: int) -> list[Event]:
    """``count`` firings never published before in this run (distinct ids)."""
    out = []
    for i in itertools.islice(_serial, count):
        entry = TimerEntry(
            tenant_id=f"tenant-{i % kit.TENANTS}",
            service_call_id=f"call-{i:08d}",
            due_at=T0 + timedelta(milliseconds=i),
            registered_at=T0,
            correlation_id=f"trace-{i:08d}",
        )
        out.append(build_due_event(entry, entry.due_at + timedelta(milliseconds=3)))
    return out


async def measure(sequential: int, batched: int, rounds: int) -> list[dict[str, Any]]:
    with (
        tempfile.TemporaryDirectory(prefix="timer-bench-nats-") as root,
        NatsServerProcess(Path(root)) as server,
    ):
        async with NatsBroker(NatsSettings(url=server.url)) as broker:
            return await paths(broker, sequential, batched, rounds)


async def paths(
    broker: NatsBroker, sequential: int, batched: int, rounds: int
) -> list[dict[str, Any]]:
    subjects, publisher = broker.settings.subjects, broker.publisher
    js = broker.client.jetstream(timeout=5)

    async def js_sequential(batch: list[Event]) -> None:
        for e in batch:
            subject = subjects.events(e.tenant_id, e.payload.service_call_id)
            await js.publish(subject, encode_envelope(e), headers={"Nats-Msg-Id": e.id})

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
        # Not in any stream: no storage, no ack; what the client and the server can move.
        for e in batch:
            subject = f"bench.core.{e.tenant_id}.{e.payload.service_call_id}"
            await broker.client.publish(subject, encode_envelope(e), headers={"Nats-Msg-Id": e.id})
        await broker.client.flush()

    rows: dict[str, tuple[int, Callable[[list[Event]], Awaitable[None]]]] = {
        BASELINE: (sequential, js_sequential),
        "sequential acked, `NatsEventPublisher.publish`": (sequential, publisher_sequential),
        "batched acked, `publish_many` x 100": (batched, publish_many(100)),
        "batched acked, `publish_many` x 1,000": (batched, publish_many(1000)),
        "core NATS publish, no JetStream (upper bound)": (batched, core),
    }

    async def timed(name: str, _: int) -> float:
        count, run = rows[name]
        batch = firings(count)
        started = time.perf_counter()
        await run(batch)
        return count / (time.perf_counter() - started)

    await timed("batched acked, `publish_many` x 100", 0)  # warm the connection and the stream
    taken = await kit.alternated(rounds, list(rows), timed, rotate=False)
    baseline = [one[BASELINE] for one in taken]
    return [
        {
            "path": name,
            "messages": count,
            "rounds_per_s": [round(one[name], 1) for one in taken],
            "vs_baseline": kit.median_ratio([one[name] for one in taken], baseline),
        }
        for name, (count, _) in rows.items()
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small counts")
    parser.add_argument("--rounds", type=int, default=5)


def main(args: argparse.Namespace) -> int:
    sequential, batched = (300, 2_000) if args.quick else (3_000, 20_000)
    machine = kit.machine(nats_server=nats_server_version(), packages=package_versions("nats-py"))
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {
            "rounds": args.rounds,
            "publish_window": NatsSettings(url="nats://unused").publish_window,
            "storage": "file",
        },
        "rows": asyncio.run(measure(sequential, batched, args.rounds)),
    }
    kit.write_result(document, args.output)
    from timer_bench.render import publish_block

    print(publish_block(document))
    return 0
