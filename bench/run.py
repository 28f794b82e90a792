"""End-to-end benchmark of ``timer-service``: its real code paths on a real ``nats-server`` and a
SQLite file, against hand-written yardsticks measured in the same run.

The service runs as a subprocess (``python -m timer_service.cli run``), so the load driver and
the observers here never share its event loop. Each scenario gets a fresh ``nats-server`` and
database; timing comes from what the service itself wrote (``registeredAt``, ``reachedAt``),
from JetStream (consumer and stream state) and from a live JetStream consumer. Every scenario
also checks correctness: nothing lost, nothing early, drained in due order.

    uv run --all-packages python bench/run.py            # full run, a few minutes
    uv run --all-packages python bench/run.py --quick    # small and fast (CI: correctness only)
    uv run --all-packages python bench/run.py --only fire,storm --profile

Writes ``bench/results/latest.json`` (``quick.json`` with ``--quick``) and prints the table.
Exits 1 when a correctness check failed; the performance goals only inform.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# bench/nats.py is named like the nats package: keep this directory off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

import nats  # noqa: E402
import psutil  # noqa: E402
from nats.aio.client import Client  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy  # noqa: E402

from timer_adapters_nats import (  # noqa: E402
    NatsBroker,
    NatsServerProcess,
    NatsSettings,
    TimerClient,
    find_nats_server,
)
from timer_adapters_sqlite import SqliteTimerStore, migrate  # noqa: E402
from timer_core import TimerEntry, from_epoch_ms  # noqa: E402

RESULTS = _HERE / "results"
TABLE = "timer_schedules"
DEFAULT_BATCH = 100
TENANTS = 50
CONSUMER = "timer-service"


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does; ``--quick`` shrinks everything but the steady rate."""

    fire: int
    schedule: int
    steady_rate: int
    steady_s: float
    storm: int
    catchup_stored: int
    catchup_overdue: int
    scale_small: int
    scale_commands: int
    poll_samples: int


FULL = Sizes(
    fire=100_000,
    schedule=100_000,
    steady_rate=1_000,
    steady_s=60.0,
    storm=100_000,
    catchup_stored=1_000_000,
    catchup_overdue=100_000,
    scale_small=10_000,
    scale_commands=20_000,
    poll_samples=500,
)
QUICK = Sizes(
    fire=3_000,
    schedule=3_000,
    steady_rate=1_000,
    steady_s=4.0,
    storm=3_000,
    catchup_stored=30_000,
    catchup_overdue=3_000,
    scale_small=3_000,
    scale_commands=2_000,
    poll_samples=100,
)
SCENARIOS = ("yardsticks", "schedule", "fire", "storm", "steady", "catchup", "scale")


class CheckFailed(Exception):
    """A correctness check of the harness failed (lost, early or out-of-order timers)."""


# -- time ------------------------------------------------------------------------------------


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Stamps:
    """Formats epoch milliseconds as the store's text, caching the per-second prefix."""

    def __init__(self) -> None:
        self._prefixes: dict[int, str] = {}

    def __call__(self, ms: int) -> str:
        second, milli = divmod(ms, 1000)
        prefix = self._prefixes.get(second)
        if prefix is None:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._prefixes[second] = prefix
        return f"{prefix}.{milli:03d}Z"


stamp = Stamps()


def epoch_ms(text: str) -> int:
    """Epoch milliseconds of a stored or wire timestamp (``...Z``)."""
    moment = datetime.fromisoformat(text)
    return (
        int((moment - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() * 1000 + 0.5)
        if moment.tzinfo
        else 0
    )


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p99 and max (nearest rank), rounded to 0.1 ms; values in milliseconds."""
    if not values:
        return {"count": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {
        "count": len(ordered),
        "p50_ms": round(rank(0.50), 1),
        "p99_ms": round(rank(0.99), 1),
        "max_ms": round(ordered[-1], 1),
    }


# -- database --------------------------------------------------------------------------------

_INSERT = (
    f"INSERT INTO {TABLE} (tenant_id, service_call_id, correlation_id, due_at, registered_at) "
    "VALUES (?, ?, ?, ?, ?)"
)
_ANY_DUE = (
    f"SELECT 1 FROM {TABLE} INDEXED BY idx_timer_schedules_scheduled_due "
    "WHERE state = 'Scheduled' AND due_at <= ? LIMIT 1"
)
_FIRST_REACHED = (
    f"SELECT min(reached_at) FROM {TABLE} INDEXED BY idx_timer_schedules_reached_at "
    "WHERE state = 'Reached'"
)


def connect_db(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    connection.execute("PRAGMA busy_timeout = 10000")
    return connection


def create_db(path: Path) -> None:
    """An empty database at the current schema, made by the store's own migrations."""
    migrate(path)


def timer_rows(
    count: int, *, prefix: str, due_ms: Callable[[int], int], registered_ms: int
) -> Iterator[tuple[str, str, str, str, str]]:
    """``count`` distinct timers over ``TENANTS`` tenants, as raw insert parameters."""
    registered = stamp(registered_ms)
    for i in range(count):
        yield (
            f"tenant-{i % TENANTS:02d}",
            f"{prefix}-{i:08d}",
            f"trace-{prefix}-{i:08d}",
            stamp(due_ms(i)),
            registered,
        )


def insert_rows(path: Path, rows: Iterable[tuple[str, ...]], *, rebuild_indexes: bool) -> None:
    """Preload timers behind the service's back (it is not running) in one transaction.

    ``rebuild_indexes`` drops the indexes first and builds them again after: an index built
    by sorting is the same index, made several times faster than by a million inserts.
    """
    connection = connect_db(path)
    try:
        connection.execute("PRAGMA cache_size = -262144")
        indexes = connection.execute(
            "SELECT name, sql FROM sqlite_master "
            f"WHERE type = 'index' AND tbl_name = '{TABLE}' AND sql IS NOT NULL"
        ).fetchall()
        connection.execute("BEGIN IMMEDIATE")
        if rebuild_indexes:
            for name, _ in indexes:
                connection.execute(f"DROP INDEX {name}")
        connection.executemany(_INSERT, rows)
        if rebuild_indexes:
            for _, sql in indexes:
                connection.execute(sql)
        connection.execute("COMMIT")
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        connection.close()


def copy_db(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)


def state_counts(path: Path) -> dict[str, int]:
    connection = connect_db(path)
    try:
        rows = connection.execute(f"SELECT state, count(*) FROM {TABLE} GROUP BY state")
        return dict(rows)
    finally:
        connection.close()


def reached_lateness(path: Path, *, prefix: str | None = None) -> tuple[list[float], int]:
    """``reachedAt - dueAt`` in ms of every Reached timer (of ``prefix``), and how many early."""
    connection = connect_db(path)
    try:
        sql = f"SELECT due_at, reached_at FROM {TABLE} WHERE state = 'Reached'"
        args: tuple[str, ...] = ()
        if prefix is not None:
            sql += " AND service_call_id GLOB ?"
            args = (f"{prefix}-*",)
        lateness = [
            float(epoch_ms(reached) - epoch_ms(due))
            for due, reached in connection.execute(sql, args)
        ]
    finally:
        connection.close()
    return lateness, sum(1 for value in lateness if value < 0)


async def wait_until_none_due(path: Path, *, within: float, what: str) -> float:
    """Poll (10 ms) until no Scheduled timer is due; returns that moment (epoch seconds)."""
    connection = connect_db(path)
    deadline = time.monotonic() + within
    try:
        while connection.execute(_ANY_DUE, (stamp(now_ms()),)).fetchone() is not None:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{what}: timers still due after {within:.0f}s")
            await asyncio.sleep(0.01)
        return time.time()
    finally:
        connection.close()


def first_reached_ms(path: Path) -> int:
    connection = connect_db(path)
    try:
        (first,) = connection.execute(_FIRST_REACHED).fetchone()
    finally:
        connection.close()
    if first is None:
        raise CheckFailed("no timer was marked Reached")
    return epoch_ms(first)


def first_registered_ms(path: Path, prefix: str) -> int:
    """When the service stored the first of the timers whose ids start with ``prefix``."""
    connection = connect_db(path)
    try:
        (first,) = connection.execute(
            f"SELECT min(registered_at) FROM {TABLE} WHERE service_call_id GLOB ?",
            (f"{prefix}-*",),
        ).fetchone()
    finally:
        connection.close()
    if first is None:
        raise CheckFailed(f"no timer {prefix}-* was stored")
    return epoch_ms(first)


# -- broker ----------------------------------------------------------------------------------


class Broker:
    """A fresh ``nats-server`` for one scenario, plus the harness's own connection to it."""

    def __init__(self, root: Path) -> None:
        self.server = NatsServerProcess(root / "nats", host="127.0.0.1", port=0)
        self.nc: Client | None = None

    @property
    def url(self) -> str:
        return self.server.url

    async def __aenter__(self) -> Broker:
        await asyncio.to_thread(self.server.start)
        try:
            self.nc = await nats.connect(self.url, max_reconnect_attempts=0)
            # The streams and the consumer exactly as the service provisions them.
            adapter = NatsBroker(NatsSettings(url=self.url))
            await adapter.start()
            await adapter.aclose()
        except BaseException:
            await asyncio.to_thread(self.server.stop)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self.nc is not None:
                await self.nc.close()
        finally:
            await asyncio.to_thread(self.server.stop)

    @property
    def client(self) -> Client:
        assert self.nc is not None
        return self.nc

    async def stream_messages(self, stream: str) -> int:
        info = await self.client.jetstream(timeout=10).stream_info(stream)
        return int(info.state.messages)

    async def command_backlog(self) -> int:
        """Commands the service's consumer has not acknowledged yet (pending + in flight)."""
        info = await self.client.jetstream(timeout=10).consumer_info("TIMER_COMMANDS", CONSUMER)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def send_schedules(self, timers: list[tuple[str, str, int]]) -> None:
        """Publish ``ScheduleTimer`` for ``(tenant, serviceCallId, dueMs)``; every one acked."""
        sender = TimerClient(self.client, publish_window=1000, ack_timeout_s=30)
        for start in range(0, len(timers), 5000):
            chunk = timers[start : start + 5000]
            envelopes = [
                sender.schedule_envelope(tenant, call, from_epoch_ms(due))
                for tenant, call, due in chunk
            ]
            failed = [error for error in await sender.send_many(envelopes) if error is not None]
            if failed:
                raise CheckFailed(f"{len(failed)} commands not acked by JetStream: {failed[0]}")

    async def read_events(self, expected: int, *, within: float = 60.0) -> list[dict[str, Any]]:
        """Every ``DueTimeReached`` in ``TIMER_EVENTS``, in stream order."""
        js = self.client.jetstream(timeout=10)
        subscription = await js.pull_subscribe(
            "timer.events.>",
            stream="TIMER_EVENTS",
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
                inactive_threshold=30.0,
            ),
        )
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + within
        try:
            while len(events) < expected and time.monotonic() < deadline:
                try:
                    batch = await subscription.fetch(min(5000, expected - len(events)), timeout=2)
                except TimeoutError:
                    continue
                events.extend(json.loads(message.data) for message in batch)
        finally:
            await subscription.unsubscribe()
        return events


# -- the service -----------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """``timer-service run`` as a subprocess in its own process group, on one database."""

    def __init__(
        self, workdir: Path, db: Path, url: str, *, batch_size: int, profile: Path | None
    ) -> None:
        self.db = db
        self.batch_size = batch_size
        self.http_port = free_port()
        self.log_path = workdir / f"service-{db.stem}.log"
        self.profile = profile
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        self.env.update(
            TIMER_DB_PATH=str(db),
            TIMER_BROKER_URL=url,
            TIMER_HTTP_PORT=str(self.http_port),
            TIMER_BATCH_SIZE=str(batch_size),
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.startup_s = math.nan

    def start(self) -> Service:
        command = [sys.executable]
        if self.profile is not None:
            command += ["-m", "pyinstrument", "-r", "text", "-o", str(self.profile)]
        command += ["-m", "timer_service.cli", "run"]
        with self.log_path.open("ab") as log:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                command,
                env=self.env,
                cwd=self.db.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def _get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    async def wait_healthy(self, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise CheckFailed(f"service exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(OSError):
                status, _ = await asyncio.to_thread(self._get, "/healthz")
                if status == 200:
                    self.startup_s = time.monotonic() - self.started_at
                    return
            await asyncio.sleep(0.02)
        raise CheckFailed(f"service not healthy after {within:.0f}s: {self.tail()}")

    async def metrics(self) -> dict[str, float]:
        """The service's Prometheus series as ``name{labels}`` -> value."""
        _, body = await asyncio.to_thread(self._get, "/metrics")
        series: dict[str, float] = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    series[name] = float(value)
        return series

    def peak_rss_mb(self) -> float:
        """Peak resident memory of the service process so far (VmHWM), in MiB."""
        assert self.proc is not None
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
        return round(psutil.Process(self.proc.pid).memory_info().rss / 2**20, 1)

    def cpu_s(self) -> float:
        assert self.proc is not None
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """SIGTERM, then wait for the clean exit the contract promises (exit 0)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise CheckFailed(
                f"service did not stop within 60s of SIGTERM: {self.tail()}"
            ) from None
        if code != 0:
            raise CheckFailed(f"service exited {code} on SIGTERM: {self.tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.asynccontextmanager
async def running_service(run: Run, db: Path, url: str, *, batch_size: int, label: str) -> Any:
    profile = None
    if run.profile:
        profile = RESULTS / f"profile-{label}.txt"
    service = Service(run.workdir, db, url, batch_size=batch_size, profile=profile).start()
    try:
        yield service
        service.stop()
    finally:
        service.kill()
        if not math.isnan(service.startup_s):
            run.startups.append(round(service.startup_s, 2))


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One harness run: its sizes, settings, scratch directory, results and checks."""

    sizes: Sizes
    quick: bool
    batch_size: int
    workdir: Path
    profile: bool
    rounds: int = 1
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        mark = "ok  " if ok else "FAIL"
        print(f"  [{mark}] {name}: {detail}", flush=True)

    def scratch(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def rate(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else math.inf


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- yardsticks ------------------------------------------------------------------------------

_RAW_UPSERT = f"""
INSERT INTO {TABLE} (tenant_id, service_call_id, correlation_id, due_at, registered_at, state)
VALUES (?, ?, ?, ?, ?, 'Scheduled')
ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET
    due_at = excluded.due_at, correlation_id = excluded.correlation_id,
    registered_at = excluded.registered_at
WHERE {TABLE}.state = 'Scheduled'
"""
_RAW_FIND = f"""
SELECT tenant_id, service_call_id, correlation_id, due_at FROM {TABLE}
INDEXED BY idx_timer_schedules_scheduled_due
WHERE state = 'Scheduled' AND due_at <= ? ORDER BY due_at, tenant_id, service_call_id LIMIT ?
"""
_RAW_MARK = f"""
UPDATE {TABLE} SET state = 'Reached', reached_at = ?
WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled' AND due_at = ?
"""


def raw_upserts(db: Path, count: int, batch: int) -> float:
    """Raw sqlite3: ``count`` upserts, ``batch`` per transaction; returns upserts/s."""
    registered = now_ms()
    rows = list(
        timer_rows(
            count,
            prefix="raw",
            due_ms=lambda i: registered + 86_400_000 + random.randrange(86_400_000),
            registered_ms=registered,
        )
    )
    random.shuffle(rows)
    connection = connect_db(db)
    try:
        started = time.perf_counter()
        for start in range(0, count, batch):
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(_RAW_UPSERT, rows[start : start + batch])
            connection.execute("COMMIT")
        return rate(count, time.perf_counter() - started)
    finally:
        connection.close()


async def raw_pipeline(db: Path, url: str, batch: int) -> tuple[float, int]:
    """Raw sqlite3 + nats-py ``publish_async``: select due -> publish all -> mark, per batch.

    Returns timers/s and how many were fired.
    """
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    connection = connect_db(db)
    fired = 0
    try:
        started = time.perf_counter()
        while True:
            now = stamp(now_ms())
            rows = connection.execute(_RAW_FIND, (now, batch)).fetchall()
            if not rows:
                break
            acks = []
            for tenant, call, correlation, due in rows:
                firing = f"{tenant}.{call}.{due}"
                body = {
                    "id": firing,
                    "type": "DueTimeReached",
                    "tenantId": tenant,
                    "aggregateId": call,
                    "timestampMs": now_ms(),
                    "correlationId": correlation,
                    "payload": {
                        "_tag": "DueTimeReached",
                        "tenantId": tenant,
                        "serviceCallId": call,
                        "dueAt": due,
                        "reachedAt": now,
                    },
                }
                acks.append(
                    await js.publish_async(
                        f"timer.events.{tenant}.{call}",
                        json.dumps(body, separators=(",", ":")).encode(),
                        headers={"Nats-Msg-Id": firing},
                    )
                )
            await asyncio.gather(*acks)
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(
                _RAW_MARK, [(now, tenant, call, due) for tenant, call, _, due in rows]
            )
            connection.execute("COMMIT")
            fired += len(rows)
        return rate(fired, time.perf_counter() - started), fired
    finally:
        connection.close()
        await nc.close()


def overdue_db(run: Run, name: str, count: int) -> Path:
    """A database holding ``count`` timers already due (over the last hour)."""
    db = run.scratch(name) / "timer.db"
    create_db(db)
    insert_overdue(db, name, count)
    return db


def insert_overdue(db: Path, prefix: str, count: int) -> None:
    base = now_ms() - 3_600_000
    insert_rows(
        db,
        timer_rows(
            count,
            prefix=prefix,
            due_ms=lambda i: base + (i * 3_599_000) // count,
            registered_ms=base - 1000,
        ),
        rebuild_indexes=False,
    )


async def scenario_yardsticks(run: Run) -> None:
    sizes = run.sizes
    progress(f"yardstick: raw sqlite3 batched upserts ({sizes.schedule:,})")
    db = run.scratch("raw-upserts") / "timer.db"
    create_db(db)
    run.results.setdefault("yardsticks", {})["raw_upserts_per_s"] = {
        str(batch): raw_upserts(db, sizes.schedule, batch)
        for batch in sorted({DEFAULT_BATCH, run.batch_size})
    }


# -- schedule path ---------------------------------------------------------------------------


def future_commands(count: int, prefix: str) -> list[tuple[str, str, int]]:
    """New timers with random keys, due at random moments of the next 30 days."""
    base = now_ms() + 86_400_000
    return [
        (
            f"tenant-{random.randrange(TENANTS):02d}",
            f"{prefix}-{uuid.uuid4().hex}",
            base + random.randrange(30 * 86_400_000),
        )
        for _ in range(count)
    ]


async def measure_schedule_path(
    run: Run, db: Path, broker: Broker, count: int, *, label: str
) -> dict[str, Any]:
    """Backlog ``count`` commands, start the service, time them until stored and acked.

    From the ``registeredAt`` of the first stored (its batch's clock reading) to the moment
    the consumer has nothing pending nor unacknowledged.
    """
    before = state_counts(db).get("Scheduled", 0)
    await broker.send_schedules(future_commands(count, label))
    async with running_service(
        run, db, broker.url, batch_size=run.batch_size, label=label
    ) as service:
        await service.wait_healthy()
        cpu_before = service.cpu_s()
        deadline = time.monotonic() + 60 + count / 500
        while await broker.command_backlog() > 0:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{label}: commands still unacked")
            await asyncio.sleep(0.02)
        done = time.time()
        cpu = service.cpu_s() - cpu_before
        rss = service.peak_rss_mb()
    scheduled = state_counts(db).get("Scheduled", 0)
    elapsed = done - first_registered_ms(db, label) / 1000
    run.check(
        f"{label}: every acked command stored",
        scheduled == before + count,
        f"{scheduled:,} Scheduled, {before:,} before + {count:,} commands",
    )
    return {
        "commands": count,
        "per_s": rate(count, elapsed),
        "seconds": round(elapsed, 2),
        # From the first health answer on: a few early batches may precede it.
        "cpu_us_per_command": round(1e6 * cpu / count, 1),
        "peak_rss_mb": rss,
    }


async def scenario_schedule(run: Run) -> None:
    """The schedule path, ``run.rounds`` times on a fresh database; the median is reported."""
    count = run.sizes.schedule
    rounds = []
    for round_ in range(1, run.rounds + 1):
        progress(f"schedule path: {count:,} ScheduleTimer backlogged on TIMER_COMMANDS")
        name = round_name("schedule", round_)
        db = run.scratch(name) / "timer.db"
        create_db(db)
        async with Broker(run.scratch(name)) as broker:
            rounds.append(await measure_schedule_path(run, db, broker, count, label="schedule"))
        drop_scratch(run, "schedule", round_=round_)
    result = median_round(rounds, key=lambda r: r["per_s"])
    if len(rounds) > 1:
        result["rounds_per_s"] = [r["per_s"] for r in rounds]
    result["fetch_batch"] = run.batch_size  # the service fetches TIMER_BATCH_SIZE at a time
    run.results["schedule"] = result


# -- fire path -------------------------------------------------------------------------------


async def fire_raw(run: Run, batch: int, round_: int = 1) -> dict[str, Any]:
    """The yardstick: the hand-written pipeline on the same timers, in this process."""
    count = run.sizes.fire
    label = round_name(f"raw-pipeline-{batch}", round_)
    progress(f"yardstick: raw select -> publish_async -> mark ({count:,}, batch {batch})")
    db = overdue_db(run, label, count)
    async with Broker(run.scratch(label)) as broker:
        cpu = time.process_time()
        per_s, fired = await raw_pipeline(db, broker.url, batch)
        cpu = time.process_time() - cpu
        stored = await broker.stream_messages("TIMER_EVENTS")
    run.check(
        f"raw pipeline (batch {batch}) fired all",
        fired == count and stored == count,
        f"{fired:,} fired, {stored:,} events stored",
    )
    return {"per_s": per_s, "cpu_us_per_timer": round(1e6 * cpu / max(fired, 1), 1)}


async def fire_service(run: Run, batch: int, round_: int = 1) -> dict[str, Any]:
    """The service on the same timers: written while it idles, then one command wakes it.

    Timed from the first ``reachedAt`` to the moment none is left due; the service's CPU is
    counted from then on too, without its start-up.
    """
    count = run.sizes.fire
    label = round_name(f"fire-{batch}", round_)
    progress(f"fire path: {count:,} stored timers already due, batch {batch}")
    db = run.scratch(label) / "timer.db"
    create_db(db)
    async with Broker(run.scratch(label)) as broker:
        async with running_service(run, db, broker.url, batch_size=batch, label=label) as service:
            await service.wait_healthy()
            cpu = service.cpu_s()
            insert_overdue(db, label, count)
            await broker.send_schedules([("tenant-00", f"{label}-wake-up", now_ms())])
            done = await wait_until_none_due(db, within=60 + count / 500, what=label)
            cpu = service.cpu_s() - cpu
            metrics = await service.metrics()
            rss = service.peak_rss_mb()
        events = await broker.stream_messages("TIMER_EVENTS")
    fired = count + 1
    elapsed = done - first_reached_ms(db) / 1000
    counts = state_counts(db)
    passes = metrics.get("timer_polling_duration_seconds_count", 0.0)
    run.check(
        f"{label}: every due timer published once and marked Reached",
        counts.get("Reached", 0) == fired and events == fired,
        f"{counts.get('Reached', 0):,} Reached, {events:,} events in TIMER_EVENTS",
    )
    return {
        "timers": fired,
        "per_s": rate(fired, elapsed),
        "seconds": round(elapsed, 2),
        "cpu_us_per_timer": round(1e6 * cpu / fired, 1),
        "passes": int(passes),
        "mean_pass_ms": round(
            1000 * metrics.get("timer_polling_duration_seconds_sum", 0.0) / max(passes, 1), 2
        ),
        "publish_failures": metrics.get("timer_publish_failures_total", 0.0),
        "peak_rss_mb": rss,
    }


async def scenario_fire(run: Run) -> None:
    """Service and yardstick back to back per batch size, so both see the same machine.

    With several rounds, the round with the median ratio is reported (its service and its
    yardstick figures), and every round's ratio is kept beside it.
    """
    service: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    batches = [run.batch_size] if run.quick else sorted({DEFAULT_BATCH, run.batch_size})[::-1]
    for batch in batches:
        rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for round_ in range(1, run.rounds + 1):
            yardstick = await fire_raw(run, batch, round_)
            measured = await fire_service(run, batch, round_)
            measured["vs_raw"] = round(measured["per_s"] / yardstick["per_s"], 2)
            rounds.append((yardstick, measured))
            drop_scratch(run, f"raw-pipeline-{batch}", f"fire-{batch}", round_=round_)
        yardstick, measured = median_round(rounds, key=lambda pair: pair[1]["vs_raw"])
        if len(rounds) > 1:
            measured["rounds_vs_raw"] = [pair[1]["vs_raw"] for pair in rounds]
            measured["rounds_per_s"] = [pair[1]["per_s"] for pair in rounds]
            yardstick["rounds_per_s"] = [pair[0]["per_s"] for pair in rounds]
        raw[str(batch)], service[str(batch)] = yardstick, measured
    run.results["fire"] = service
    run.results.setdefault("yardsticks", {})["raw_pipeline"] = raw


def median_round(rounds: list[Any], key: Callable[[Any], float]) -> Any:
    """The round whose ``key`` is the median (the lower middle one of an even count)."""
    ordered = sorted(rounds, key=key)
    return ordered[(len(ordered) - 1) // 2]


def round_name(name: str, round_: int) -> str:
    """The scratch directory (and label) of ``name`` in a round: the first keeps the name."""
    return name if round_ == 1 else f"{name}-r{round_}"


def drop_scratch(run: Run, *names: str, round_: int) -> None:
    """Delete a finished round's databases and broker files (a full run makes gigabytes)."""
    for name in names:
        shutil.rmtree(run.workdir / round_name(name, round_), True)


# -- storm -----------------------------------------------------------------------------------


async def scenario_storm(run: Run) -> None:
    """Timers written while the service idles, all due at one instant a few seconds ahead.

    A ``ScheduleTimer`` due at that instant, sent once they are written, makes the idle
    worker read its next due time again (it would otherwise only look at its next poll).
    """
    count = run.sizes.storm
    progress(f"storm: {count:,} timers due at the same instant")
    db = run.scratch("storm") / "timer.db"
    create_db(db)
    async with Broker(run.scratch("storm")) as broker:
        async with running_service(
            run, db, broker.url, batch_size=run.batch_size, label="storm"
        ) as service:
            await service.wait_healthy()
            due = now_ms() + (5000 if count > 10_000 else 2000)
            insert_rows(
                db,
                timer_rows(count, prefix="storm", due_ms=lambda i: due, registered_ms=now_ms()),
                rebuild_indexes=False,
            )
            await broker.send_schedules([("tenant-00", "storm-wake-up", due)])
            ready_before_ms = due - now_ms()
            cpu = service.cpu_s()
            all_readable = math.nan
            deadline = time.monotonic() + 60 + count / 500
            while math.isnan(all_readable):
                if now_ms() >= due and await broker.stream_messages("TIMER_EVENTS") > count:
                    all_readable = time.time()
                elif time.monotonic() > deadline:
                    raise CheckFailed("storm: events missing")
                else:
                    await asyncio.sleep(0.02)
            done = await wait_until_none_due(db, within=60, what="storm")
            cpu = service.cpu_s() - cpu
            rss = service.peak_rss_mb()
        events = await broker.stream_messages("TIMER_EVENTS")
    lateness, early = reached_lateness(db)
    fired = count + 1
    run.check(
        "storm: nothing lost, nothing early",
        len(lateness) == fired and events == fired and early == 0,
        f"{len(lateness):,} Reached, {events:,} events, {early} early",
    )
    run.check(
        "storm: written and announced before the instant",
        ready_before_ms > 0,
        f"{ready_before_ms} ms to spare",
    )
    run.results["storm"] = {
        "timers": fired,
        "fire_all_s": round(done - due / 1000, 3),
        "all_readable_s": round(all_readable - due / 1000, 3),
        "per_s": rate(fired, done - due / 1000),
        "reached_lateness": percentiles(lateness),
        "cpu_us_per_timer": round(1e6 * cpu / fired, 1),
        "peak_rss_mb": rss,
    }


# -- steady lateness -------------------------------------------------------------------------


async def scenario_steady(run: Run) -> None:
    sizes = run.sizes
    per_tick, tick = max(1, sizes.steady_rate // 100), 0.01
    ticks = int(sizes.steady_s / tick)
    progress(
        f"steady lateness: {sizes.steady_rate:,} timers/s due at random moments "
        f"for {sizes.steady_s:.0f}s (scheduled 1-2 s ahead, through TIMER_COMMANDS)"
    )
    db = run.scratch("steady") / "timer.db"
    create_db(db)
    readable: dict[str, float] = {}
    fired: dict[str, float] = {}
    early = 0

    async with Broker(run.scratch("steady")) as broker:

        async def on_event(message: Msg) -> None:
            nonlocal early
            seen = time.time_ns() / 1e6
            payload = json.loads(message.data)["payload"]
            due = epoch_ms(payload["dueAt"])
            reached = epoch_ms(payload["reachedAt"])
            key = payload["serviceCallId"]
            readable[key] = seen - due
            fired[key] = float(reached - due)
            early += reached < due

        js = broker.client.jetstream(timeout=10)
        subscription = await js.subscribe(
            "timer.events.>",
            stream="TIMER_EVENTS",
            cb=on_event,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )
        sender = TimerClient(broker.client, publish_window=512)
        async with running_service(
            run, db, broker.url, batch_size=run.batch_size, label="steady"
        ) as service:
            await service.wait_healthy()
            loop = asyncio.get_running_loop()
            sent = 0
            started = loop.time()
            for n in range(ticks):
                await asyncio.sleep(max(0.0, started + n * tick - loop.time()))
                base = now_ms()
                envelopes = [
                    sender.schedule_envelope(
                        f"tenant-{(sent + i) % TENANTS:02d}",
                        f"steady-{sent + i:08d}",
                        from_epoch_ms(base + 1000 + random.randrange(1000)),
                    )
                    for i in range(per_tick)
                ]
                errors = [e for e in await sender.send_many(envelopes) if e is not None]
                if errors:
                    raise CheckFailed(f"steady: command not acked: {errors[0]}")
                sent += per_tick
            deadline = time.monotonic() + 30
            while len(readable) < sent and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            metrics = await service.metrics()
            rss = service.peak_rss_mb()
        await subscription.unsubscribe()
    run.check(
        "steady: every timer fired, none early",
        len(readable) == sent and early == 0,
        f"{len(readable):,} of {sent:,} events read, {early} early",
    )
    run.results["steady"] = {
        "timers": sent,
        "rate_per_s": sizes.steady_rate,
        "seconds": sizes.steady_s,
        "reached_lateness": percentiles(list(fired.values())),
        "readable_lateness": percentiles(list(readable.values())),
        "commands_stored": metrics.get('timer_commands_received_total{outcome="stored"}'),
        "peak_rss_mb": rss,
    }


# -- catch-up --------------------------------------------------------------------------------


def big_template(run: Run) -> Path:
    """A database of ``catchup_stored - catchup_overdue`` timers due over the coming days."""
    template = run.workdir / "template-big.db"
    if template.exists():
        return template
    count = run.sizes.catchup_stored - run.sizes.catchup_overdue
    progress(f"building a database of {count:,} future timers")
    create_db(template)
    base = now_ms() + 86_400_000
    insert_rows(
        template,
        timer_rows(
            count,
            prefix="future",
            due_ms=lambda i: base + random.randrange(86_400_000),
            registered_ms=now_ms(),
        ),
        rebuild_indexes=True,
    )
    return template


async def scenario_catchup(run: Run) -> Path:
    sizes = run.sizes
    template = big_template(run)
    progress(
        f"catch-up: {sizes.catchup_stored:,} stored, {sizes.catchup_overdue:,} overdue "
        "after a downtime"
    )
    db = run.scratch("catchup") / "timer.db"
    copy_db(template, db)
    overdue = sizes.catchup_overdue
    base = now_ms() - 3_600_000
    # Random due times over the last hour, inserted in random order.
    insert_rows(
        db,
        timer_rows(
            overdue,
            prefix="overdue",
            due_ms=lambda i: base + random.randrange(3_599_000),
            registered_ms=base - 1000,
        ),
        rebuild_indexes=False,
    )
    async with Broker(run.scratch("catchup")) as broker:
        async with running_service(
            run, db, broker.url, batch_size=run.batch_size, label="catchup"
        ) as service:
            done = await wait_until_none_due(db, within=60 + overdue / 500, what="catch-up")
            rss = service.peak_rss_mb()
        events = await broker.read_events(overdue)
        stored = await broker.stream_messages("TIMER_EVENTS")
    elapsed = done - first_reached_ms(db) / 1000
    counts = state_counts(db)
    dues = [event["payload"]["dueAt"] for event in events]
    out_of_order = sum(1 for a, b in itertools.pairwise(dues) if b < a)
    ids = {event["id"] for event in events}
    run.check(
        "catch-up: every overdue timer fired once, the future ones untouched",
        counts.get("Reached", 0) == overdue
        and counts.get("Scheduled", 0) == sizes.catchup_stored - overdue
        and stored == overdue
        and len(ids) == overdue,
        f"{counts.get('Reached', 0):,} Reached, {counts.get('Scheduled', 0):,} Scheduled, "
        f"{stored:,} events ({len(ids):,} distinct ids)",
    )
    run.check(
        "catch-up: drained in due order",
        out_of_order == 0 and len(dues) == overdue,
        f"{out_of_order} of {len(dues):,} events earlier-due than the one before them",
    )
    run.results["catchup"] = {
        "stored": sizes.catchup_stored,
        "overdue": overdue,
        "drain_s": round(elapsed, 2),
        "per_s": rate(overdue, elapsed),
        "peak_rss_mb": rss,
    }
    return db


# -- scale -----------------------------------------------------------------------------------


async def poll_costs(dbs: dict[str, Path], batch: int, samples: int) -> dict[str, dict[str, float]]:
    """The worker's per-pass store calls on each database, through the real ``SqliteTimerStore``.

    ``empty_poll_us``: ``find_due`` with nothing due plus ``next_due_at`` (an idle pass);
    ``find_due_us``: ``find_due`` returning a full batch of due timers. Medians, the stores'
    samples taken in turn so both see the same moments of the machine.
    """
    stores = {label: SqliteTimerStore(db) for label, db in dbs.items()}
    for store in stores.values():
        await store.start()
    try:
        # A batch of timers due a minute ago, to time a full find_due (never marked).
        due = now_ms() - 60_000
        for store in stores.values():
            await store.apply(
                [
                    TimerEntry(
                        tenant_id=f"tenant-{i % TENANTS:02d}",
                        service_call_id=f"poll-{i:06d}",
                        due_at=from_epoch_ms(due + i),
                        registered_at=from_epoch_ms(due - 1000),
                    )
                    for i in range(batch)
                ]
            )
        before_due, busy = from_epoch_ms(due - 1), datetime.now(UTC)
        for store in stores.values():
            for _ in range(20):
                await store.find_due(busy, batch)
        empty: dict[str, list[float]] = {label: [] for label in stores}
        full: dict[str, list[float]] = {label: [] for label in stores}
        for _ in range(samples):
            for label, store in stores.items():
                started = time.perf_counter()
                await store.find_due(before_due, batch)
                await store.next_due_at()
                empty[label].append((time.perf_counter() - started) * 1e6)
                started = time.perf_counter()
                found = await store.find_due(busy, batch)
                full[label].append((time.perf_counter() - started) * 1e6)
                if len(found) != batch:
                    raise CheckFailed(f"find_due found {len(found)} of {batch} due timers")
        return {
            label: {
                "empty_poll_us": round(statistics.median(empty[label]), 1),
                "find_due_us": round(statistics.median(full[label]), 1),
            }
            for label in stores
        }
    finally:
        for store in stores.values():
            await store.aclose()


async def scenario_scale(run: Run, big_db: Path | None) -> None:
    """Small and big store in turn: the schedule path ``run.rounds`` times on each (medians),
    then their poll costs sampled alternately."""
    sizes = run.sizes
    small_template = run.scratch("scale-small-template") / "timer.db"
    create_db(small_template)
    base = now_ms() + 86_400_000
    insert_rows(
        small_template,
        timer_rows(
            sizes.scale_small,
            prefix="small",
            due_ms=lambda i: base + random.randrange(86_400_000),
            registered_ms=now_ms(),
        ),
        rebuild_indexes=False,
    )
    if big_db is None:
        big_db = run.scratch("scale-big") / "timer.db"
        copy_db(big_template(run), big_db)
    stored = {"small": sizes.scale_small, "big": sum(state_counts(big_db).values())}
    rounds: dict[str, list[dict[str, Any]]] = {"small": [], "big": []}
    for round_ in range(1, run.rounds + 1):
        # A fresh small store each round (10,000 stays 10,000); the big one takes 20,000
        # more per round, nothing to a million. The last round's small store stays for
        # the poll costs.
        if round_ > 1:
            drop_scratch(run, "scale-small", round_=round_ - 1)
        small = run.scratch(round_name("scale-small", round_)) / "timer.db"
        copy_db(small_template, small)
        for label, db in (("small", small), ("big", big_db)):
            progress(
                f"scale: {sizes.scale_commands:,} commands into {stored[label]:,} stored timers"
            )
            name = round_name(f"scale-{label}", round_)
            async with Broker(run.scratch(name)) as broker:
                rounds[label].append(
                    await measure_schedule_path(run, db, broker, sizes.scale_commands, label=name)
                )
    progress(f"scale: poll cost, {sizes.poll_samples} samples of each store in turn")
    costs = await poll_costs({"small": small, "big": big_db}, run.batch_size, sizes.poll_samples)
    out: dict[str, Any] = {}
    for label in ("small", "big"):
        result = median_round(rounds[label], key=lambda r: r["per_s"])
        if len(rounds[label]) > 1:
            result["rounds_per_s"] = [r["per_s"] for r in rounds[label]]
        result.update(costs[label])
        result["stored"] = stored[label]
        out[label] = result
    run.results["scale"] = out


# -- report ----------------------------------------------------------------------------------


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
    rows: list[dict[str, Any]] = []

    def goal(name: str, value: Any, target: str, ok: bool | None) -> None:
        rows.append({"goal": name, "value": value, "target": target, "met": ok})

    if "fire" in r:
        for size, fire in sorted(r["fire"].items(), key=lambda kv: int(kv[0])):
            ratio = fire["vs_raw"]
            goal(f"fire path / raw pipeline (batch {size})", ratio, ">= 0.8", ratio >= 0.8)
    if "schedule" in r:
        value = r["schedule"]["per_s"]
        goal("schedule path, commands/s", value, ">= 10000", value >= 10_000)
    if "steady" in r:
        late = r["steady"]["readable_lateness"]
        goal("steady lateness p50 (readable), ms", late["p50_ms"], "<= 10", late["p50_ms"] <= 10)
        goal("steady lateness p99 (readable), ms", late["p99_ms"], "<= 50", late["p99_ms"] <= 50)
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


def table(r: dict[str, Any], batch_size: int) -> str:
    lines = ["| measure | value |", "| --- | ---: |"]

    def row(name: str, value: str) -> None:
        lines.append(f"| {name} | {value} |")

    yardsticks = r.get("yardsticks", {})
    for batch, value in yardsticks.get("raw_upserts_per_s", {}).items():
        row(f"yardstick: raw sqlite3 upserts, {batch}/transaction", f"{value:,.0f}/s")
    for batch, raw in yardsticks.get("raw_pipeline", {}).items():
        row(
            f"yardstick: raw select -> publish_async -> mark, batch {batch}",
            f"{raw['per_s']:,.0f}/s ({raw['cpu_us_per_timer']} us CPU/timer)",
        )
    if "schedule" in r:
        s = r["schedule"]
        row(*with_rounds(f"schedule path: {s['commands']:,} ScheduleTimer -> stored + acked", s))
    if "fire" in r:
        for batch, f in sorted(r["fire"].items(), key=lambda kv: int(kv[0])):
            label = "default" if int(batch) == DEFAULT_BATCH else "harness"
            row(
                f"fire path: {f['timers']:,} due -> published + Reached, batch {batch} ({label})",
                f"{f['per_s']:,.0f}/s ({f['cpu_us_per_timer']} us CPU/timer)",
            )
            if f.get("rounds_vs_raw"):
                row(
                    f"fire path / yardstick, batch {batch}, each round (the median one above)",
                    " / ".join(str(x) for x in f["rounds_vs_raw"]),
                )
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


README = _HERE / "README.md"
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
        f"{service['process']}, `TIMER_BATCH_SIZE={service['batch_size']}` (the default, "
        f"{service['default_batch_size']}, on the fire path too), polling interval "
        f"{service['polling_interval_ms']} ms (the default)."
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


async def main_async(run: Run, only: set[str]) -> None:
    big_db: Path | None = None
    if "yardsticks" in only:
        await scenario_yardsticks(run)
    if "schedule" in only:
        await scenario_schedule(run)
    if "fire" in only:
        await scenario_fire(run)
    if "storm" in only:
        await scenario_storm(run)
    if "steady" in only:
        await scenario_steady(run)
    if "catchup" in only:
        big_db = await scenario_catchup(run)
    if "scale" in only:
        await scenario_scale(run, big_db)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1000,
        help="TIMER_BATCH_SIZE of the service in the harness (default 1000; the service's "
        f"default, {DEFAULT_BATCH}, is measured too on the fire path)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of the schedule and fire paths, the median reported (default 3; 1 quick)",
    )
    parser.add_argument("--only", help=f"comma-separated scenarios of {', '.join(SCENARIOS)}")
    parser.add_argument("--output", type=Path, help="JSON result path")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the service under pyinstrument; text profiles in bench/results/",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--readme", action="store_true", help="write the figures into bench/README.md too"
    )
    parser.add_argument(
        "--readme-from",
        type=Path,
        metavar="JSON",
        help="only write the figures of an earlier result into bench/README.md",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme_from is not None:
        if not write_readme(json.loads(args.readme_from.read_text())):
            print(f"no {README_BEGIN} ... {README_END} markers in {README}", file=sys.stderr)
            return 2
        return 0
    only = set(SCENARIOS) if not args.only else set(args.only.split(","))
    unknown = only - set(SCENARIOS)
    if unknown:
        print(f"unknown scenarios: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    output = args.output or RESULTS / ("quick.json" if args.quick else "latest.json")
    RESULTS.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="timer-bench-"))
    run = Run(
        sizes=QUICK if args.quick else FULL,
        quick=args.quick,
        batch_size=args.batch_size,
        workdir=workdir,
        profile=args.profile,
        rounds=args.rounds or (1 if args.quick else 3),
    )
    info = machine()
    progress(
        f"timer-service end to end, {'quick' if args.quick else 'full'} run on "
        f"{info['nproc']} x {info['cpu']}, load {info['load_average_start']}; "
        f"scratch {workdir}"
    )
    started = time.monotonic()
    failure: str | None = None
    try:
        asyncio.run(main_async(run, only))
    except CheckFailed as exc:
        failure = str(exc)
        run.check("harness completed", False, failure)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    goal_rows = goals(run.results)
    document = {
        "mode": "quick" if args.quick else "full",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": info,
        "service": {
            "process": "subprocess: python -m timer_service.cli run (own event loop)",
            "batch_size": run.batch_size,
            "default_batch_size": DEFAULT_BATCH,
            "polling_interval_ms": 5000,
            "command_fetch_batch": run.batch_size,
            "rounds": run.rounds,
        },
        "sizes": run.sizes.__dict__,
        "service_startups_s": run.startups,
        "seconds": round(time.monotonic() - started, 1),
        "results": run.results,
        "goals": goal_rows,
        "checks": run.checks,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    if args.readme and not write_readme(document):
        print(f"no {README_BEGIN} ... {README_END} markers in {README}", file=sys.stderr)
    print()
    print(table(run.results, run.batch_size))
    print()
    print(goals_table(goal_rows, args.quick))
    print()
    failed = [c for c in run.checks if not c["ok"]]
    print(
        f"{len(run.checks) - len(failed)} of {len(run.checks)} checks passed in "
        f"{document['seconds']}s; results in {output}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
