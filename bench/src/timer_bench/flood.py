"""One tenant's flood beside a quiet tenant (issue 43): tenant A publishes valid
``ScheduleTimer`` commands at 30,000/s for 10 s from a process of its own (core publishes with
a reply subject, so each JetStream ack or refusal comes back to it), while tenant B schedules
a timer due 2 s later every 100 ms and takes its ``DueTimeReached`` events. The service runs
at its defaults on SQLite with an embedded-style ``nats-server``; what is measured is how late
B's timers reach B (receipt minus ``dueAt``) and what became of A's commands. Three setups in
alternated rounds: the per-tenant intake (the default), the same with A's quota on
(``TIMER_MAX_PENDING_PER_TENANT=1000``), and the shared intake (``TIMER_INTAKE=shared``, as
before)."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import uuid_utils

from timer_adapters_nats import NatsServerProcess, TimerClient, find_nats_server
from timer_bench import kit
from timer_bench.procs import CheckFailed, Service, nats_server_version, package_versions

SETUPS = ("per-tenant", "per-tenant-quota", "per-tenant-limits", "shared")
QUOTA = 1000
QUEUED = 20_000
B_EVERY_S = 0.1
B_DUE_IN_S = 2.0
FAR = "2099-01-01T00:00:00.000Z"


def _flood(url: str, rate: int, seconds: float, results: Any) -> None:
    """Tenant A, in a process of its own: ``rate`` commands a second for ``seconds``."""
    results.put(asyncio.run(_flood_async(url, rate, seconds)))


async def _flood_async(url: str, rate: int, seconds: float) -> dict[str, Any]:
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    outcomes: Counter[str] = Counter()

    async def on_ack(msg: Any) -> None:
        data = msg.data
        if b'"error"' in data:
            outcomes[json.loads(data)["error"].get("description", "refused")] += 1
        else:
            outcomes["stored"] += 1

    inbox = nc.new_inbox()
    await nc.subscribe(inbox + ".*", cb=on_ack)
    template = (
        '{"id":"%s","type":"ScheduleTimer","tenantId":"tenant-a","aggregateId":"a-%d",'
        '"timestampMs":%d,"payload":{"_tag":"ScheduleTimer","tenantId":"tenant-a",'
        '"serviceCallId":"a-%d","dueAt":"' + FAR + '"}}'
    )
    sent = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        due = min(int(rate * elapsed), int(rate * seconds))
        now_ms = int(time.time() * 1000)
        while sent < due:
            body = template % (uuid_utils.uuid7(), sent, now_ms, sent)
            await nc.publish("timer.commands.tenant-a", body.encode(), reply=f"{inbox}.{sent}")
            sent += 1
        await asyncio.sleep(0.002)
    took = time.monotonic() - started
    await nc.flush(timeout=30)
    # Acks still on their way: until they stop coming.
    last = -1
    while sum(outcomes.values()) != last:
        last = sum(outcomes.values())
        await asyncio.sleep(1.0)
    await nc.close()
    return {"sent": sent, "seconds": round(took, 2), "outcomes": dict(outcomes)}


async def one_round(scratch: Path, setup: str, rate: int, seconds: float) -> dict[str, Any]:
    server = NatsServerProcess(scratch / "nats", host="127.0.0.1", port=0)
    await asyncio.to_thread(server.start)
    settings: dict[str, object] = {
        "TIMER_DB_PATH": scratch / "timer.db",
        "TIMER_BROKER_URL": server.url,
        "TIMER_LOG_LEVEL": "WARNING",
        "TIMER_INTAKE": "shared" if setup == "shared" else "per-tenant",
    }
    if setup in ("per-tenant-quota", "per-tenant-limits"):
        settings["TIMER_MAX_PENDING_PER_TENANT"] = QUOTA
    if setup == "per-tenant-limits":
        settings["TIMER_MAX_QUEUED_PER_TENANT"] = QUEUED
    service = Service(scratch, setup, settings).start()
    try:
        await service.wait_healthy()
        return await _measure(server.url, service, rate, seconds)
    finally:
        service.kill()
        await asyncio.to_thread(server.stop)


async def _measure(url: str, service: Service, rate: int, seconds: float) -> dict[str, Any]:
    listener = await nats.connect(url)
    received: dict[str, float] = {}

    async def on_event(msg: Any) -> None:
        payload = json.loads(msg.data)["payload"]
        received[payload["serviceCallId"]] = time.time()

    await listener.subscribe("timer.events.tenant-b.>", cb=on_event)
    due: dict[str, float] = {}
    results: Any = multiprocessing.get_context("spawn").Queue()
    flooder = multiprocessing.get_context("spawn").Process(
        target=_flood, args=(url, rate, seconds, results)
    )
    async with TimerClient.connect(url, ack_timeout_s=30) as b:
        # B's lane is open before the flood, as for any tenant already in use.
        await b.schedule("tenant-b", "b-warm", datetime.now(UTC) + timedelta(hours=1))
        flooder.start()
        started = time.monotonic()
        count = 0
        while time.monotonic() - started < seconds:
            at = datetime.now(UTC) + timedelta(seconds=B_DUE_IN_S)
            call = f"b-{count:04d}"
            await b.schedule("tenant-b", call, at)
            due[call] = at.timestamp()
            count += 1
            await asyncio.sleep(max(0.0, started + count * B_EVERY_S - time.monotonic()))
    deadline = max(due.values()) + 120
    while len(received.keys() & due.keys()) < len(due) and time.time() < deadline:
        service.check_alive()
        await asyncio.sleep(0.05)
    flood = await asyncio.to_thread(results.get, True, 600)
    await asyncio.to_thread(flooder.join, 60)
    metrics = await service.metrics()
    await listener.close()
    late = [received[c] - due[c] for c in due if c in received]
    missing = len(due) - len(late)
    if missing:
        raise CheckFailed(f"{missing} of B's {len(due)} timers did not reach B in time")
    return {
        "b_timers": len(due),
        "b_late_p50_s": round(kit.median(late), 3),
        "b_late_max_s": round(max(late), 3),
        "a": flood,
        "a_rate_per_s": round(flood["sent"] / flood["seconds"]),
        "rejected_metric": metrics.get('timer_commands_received_total{outcome="rejected"}', 0.0),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3,000/s for 3 s, 1 round")
    parser.add_argument("--rate", type=int, default=30_000, help="A's commands a second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long A floods")
    parser.add_argument("--rounds", type=int, default=3)


def main(args: argparse.Namespace) -> int:
    quick = (3_000, 3.0, 1)
    rate, seconds, rounds = quick if args.quick else (args.rate, args.seconds, args.rounds)
    machine = kit.machine(nats_server=nats_server_version(), packages=package_versions("nats-py"))
    find_nats_server()
    with tempfile.TemporaryDirectory() as scratch:

        async def measure(setup: str, round_: int) -> dict[str, Any]:
            root = Path(scratch) / f"{setup}-{round_}"
            root.mkdir()
            kit.progress(f"{setup} round {round_}: A floods {rate:,}/s for {seconds:g} s")
            taken = await one_round(root, setup, rate, seconds)
            kit.progress(
                f"  B late p50 {taken['b_late_p50_s']} s, max {taken['b_late_max_s']} s; "
                f"A sent {taken['a']['sent']:,} at {taken['a_rate_per_s']:,}/s: "
                f"{taken['a']['outcomes']}"
            )
            return taken

        taken = asyncio.run(kit.alternated(rounds, list(SETUPS), measure))
    checks = {
        f"{setup}: B's timers at most 1 s late in every round": all(
            one[setup]["b_late_max_s"] <= 1.0 for one in taken
        )
        for setup in SETUPS[:3]
    }
    for setup in ("per-tenant-quota", "per-tenant-limits"):
        checks[f"{setup}: A's excess refused (dead-lettered or refused at publish)"] = all(
            one[setup]["rejected_metric"] > 0
            or sum(n for why, n in one[setup]["a"]["outcomes"].items() if why != "stored") > 0
            for one in taken
        )
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {
            "rate": rate,
            "seconds": seconds,
            "rounds": rounds,
            "b_every_s": B_EVERY_S,
            "b_due_in_s": B_DUE_IN_S,
            "quota": QUOTA,
            "queued": QUEUED,
            "store": "SQLite, the service's defaults",
        },
        "rounds": taken,
        "checks": checks,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import flood_block

    print(flood_block(document))
    return kit.report_checks(checks)
