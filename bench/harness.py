"""The harness of ``bench/run.py``: sizes, timing and database helpers, a ``nats-server`` per
scenario, ``timer-service`` as a subprocess, and the :class:`Run` that collects results and
correctness checks."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import psutil
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from timer_adapters_nats import (
    NatsBroker,
    NatsServerProcess,
    NatsSettings,
    TimerClient,
)
from timer_adapters_sqlite import migrate
from timer_core import from_epoch_ms
from timer_service.cli import EXIT_CONFIG

_HERE = Path(__file__).resolve().parent
RESULTS = _HERE / "results"
TABLE = "timer_schedules"
DEFAULT_BATCH = 100
#: The yardsticks' batch: the hand-written pipelines fetch, select and mark 1,000 at a time.
RAW_BATCH = 1000
#: The service's default TIMER_COMMAND_BATCH_SIZE (commands fetched and stored at once).
DEFAULT_COMMAND_BATCH = 1000
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
    """A port of 127.0.0.1 free right now; :meth:`Service.wait_healthy` starts the service
    again on a fresh one should another process take it before the service listens."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """``timer-service run`` as a subprocess in its own process group, on one database."""

    def __init__(
        self,
        workdir: Path,
        db: Path,
        url: str,
        *,
        batch_size: int,
        command_batch_size: int = DEFAULT_COMMAND_BATCH,
        profile: Path | None,
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
            TIMER_COMMAND_BATCH_SIZE=str(command_batch_size),
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.startup_s = math.nan
        self._log_offset = 0

    def start(self) -> Service:
        command = [sys.executable]
        if self.profile is not None:
            command += ["-m", "pyinstrument", "-r", "text", "-o", str(self.profile)]
        command += ["-m", "timer_service.cli", "run"]
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
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
                if self.proc.returncode == EXIT_CONFIG and self._port_taken():
                    self.http_port = free_port()
                    self.env["TIMER_HTTP_PORT"] = str(self.http_port)
                    self.start()
                    continue
                raise CheckFailed(f"service exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(OSError):
                status, _ = await asyncio.to_thread(self._get, "/healthz")
                if status == 200:
                    self.startup_s = time.monotonic() - self.started_at
                    return
            await asyncio.sleep(0.02)
        raise CheckFailed(f"service not healthy after {within:.0f}s: {self.tail()}")

    def _port_taken(self) -> bool:
        """Whether the service exited because its HTTP address was in use (another process
        took the port :func:`free_port` found), and for nothing else."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            output = log.read().decode(errors="replace")
        port = self.http_port
        failure = f"timer-service: TIMER_HTTP_PORT={port}: cannot listen on 127.0.0.1:{port}: "
        in_use = os.strerror(errno.EADDRINUSE).lower()
        return any(
            line.startswith(failure) and line.lower().endswith(in_use)
            for line in output.splitlines()
        )

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
    service = Service(
        run.workdir,
        db,
        url,
        batch_size=batch_size,
        command_batch_size=run.command_batch_size,
        profile=profile,
    ).start()
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
    command_batch_size: int = DEFAULT_COMMAND_BATCH
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
