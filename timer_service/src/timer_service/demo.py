"""``timer-service demo``: the service on embedded defaults in a temp dir, a few thousand timers
across tenants falling due over ~10 seconds, watched live as they fire."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from timer_adapters_nats import TimerClient, connect
from timer_core.instants import parse_timestamp
from timer_service.app import TimerService, serve
from timer_service.settings import Settings

__all__ = ["run_demo"]


def run_demo(*, timers: int, tenants: int, spread_s: float, plain: bool) -> int:
    """Run the demo to its summary; returns 0 when every timer fired, none early."""
    with tempfile.TemporaryDirectory(prefix="timer-demo-") as tmp:
        return asyncio.run(_demo(Path(tmp), timers, tenants, spread_s, plain))


class _Tally:
    def __init__(self, total: int) -> None:
        self.total = total
        self.scheduled = 0
        self.ids: set[str] = set()
        self.duplicates = 0
        self.early = 0
        self.lateness_ms: list[float] = []
        self.delivery_ms: list[float] = []

    def on_event(self, data: bytes) -> None:
        envelope = json.loads(data)
        if envelope["id"] in self.ids:
            self.duplicates += 1
            return
        self.ids.add(envelope["id"])
        payload = envelope["payload"]
        due = parse_timestamp(payload["dueAt"])
        reached = parse_timestamp(payload["reachedAt"])
        late = (reached - due).total_seconds() * 1000
        if late < 0:
            self.early += 1
        self.lateness_ms.append(late)
        self.delivery_ms.append((datetime.now(UTC) - due).total_seconds() * 1000)

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def table(self, elapsed: float) -> Table:
        table = Table(title=f"Timer demo: {self.total} timers ({elapsed:4.1f}s)")
        for column in (
            "scheduled",
            "fired",
            "pending",
            "early",
            "lateness p50",
            "lateness p99",
            "delivered p99",
        ):
            table.add_column(column, justify="right")
        fired = len(self.ids)
        table.add_row(
            str(self.scheduled),
            str(fired),
            str(self.scheduled - fired),
            str(self.early),
            f"{self.percentile(self.lateness_ms, 0.5):.1f} ms",
            f"{self.percentile(self.lateness_ms, 0.99):.1f} ms",
            f"{self.percentile(self.delivery_ms, 0.99):.1f} ms",
        )
        return table


async def _demo(tmp: Path, timers: int, tenants: int, spread_s: float, plain: bool) -> int:
    console = Console()
    settings = Settings(db_path=tmp / "timer.db", http_port=0, polling_interval_ms=5000)
    stop = asyncio.Event()
    ready: asyncio.Future[TimerService] = asyncio.get_running_loop().create_future()
    service_task = asyncio.create_task(serve(settings, stop, on_ready=ready.set_result))
    waits: set[asyncio.Future[object]] = {service_task, ready}  # type: ignore[arg-type]
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if service_task in done:
        service_task.result()
        return 1
    service = ready.result()
    console.print(
        f"[bold]Timer demo[/bold]: database {settings.db_path}, embedded broker "
        f"{service.broker_url}; scheduling {timers} timers across {tenants} tenants due over "
        f"the next {spread_s:.0f}s"
    )
    tally = _Tally(timers)
    watcher = await connect(service.broker_url, connect_timeout_s=5.0, name="timer-demo")
    events = await watcher.subscribe(f"{settings.subject_prefix}.events.>")

    async def watch() -> None:
        async for msg in events.messages:  # ends when the watcher is drained
            tally.on_event(msg.data)

    watching = asyncio.create_task(watch())
    started = time.monotonic()
    try:
        async with TimerClient.connect(
            service.broker_url, subject_prefix=settings.subject_prefix
        ) as client:
            rng = random.Random(7)
            now = datetime.now(UTC) + timedelta(seconds=2)
            limit = asyncio.Semaphore(256)

            async def schedule(i: int) -> None:
                due = now + timedelta(seconds=rng.uniform(0, spread_s))
                async with limit:
                    await client.schedule(
                        f"tenant-{i % tenants:02d}",
                        f"call-{i:05d}",
                        due,
                        correlation_id=f"demo-{i:05d}",
                    )
                tally.scheduled += 1

            scheduling = asyncio.gather(*(schedule(i) for i in range(timers)))
            deadline = started + spread_s + 30
            if plain:
                await scheduling
                while len(tally.ids) < timers and time.monotonic() < deadline:
                    await asyncio.sleep(0.25)
            else:
                with Live(tally.table(0), console=console, refresh_per_second=8) as live:
                    while (not scheduling.done() or len(tally.ids) < timers) and (
                        time.monotonic() < deadline
                    ):
                        live.update(tally.table(time.monotonic() - started))
                        await asyncio.sleep(0.125)
                    live.update(tally.table(time.monotonic() - started))
                await scheduling
    finally:
        await watcher.drain()
        await watching
        stop.set()
        await service_task
    fired = len(tally.ids)
    if plain:
        console.print(tally.table(time.monotonic() - started))
    ok = fired == timers and tally.early == 0
    p50 = statistics.median(tally.lateness_ms) if tally.lateness_ms else float("nan")
    console.print(
        f"\n[bold]{'OK' if ok else 'INCOMPLETE'}[/bold]: {fired}/{timers} timers fired, "
        f"{tally.early} early, {tally.duplicates} duplicate deliveries; lateness "
        f"(reachedAt - dueAt) p50 {p50:.1f} ms, "
        f"p99 {tally.percentile(tally.lateness_ms, 0.99):.1f} ms, "
        f"max {max(tally.lateness_ms, default=float('nan')):.1f} ms"
    )
    return 0 if ok else 1
