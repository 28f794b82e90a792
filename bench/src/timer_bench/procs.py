"""The real processes a scenario measures: a ``nats-server`` with Timer's streams, PostgreSQL,
``timer-service`` as a subprocess, and the CPU each of them used.

Every server listens on 127.0.0.1 on a free port and is stopped by its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
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
    command_backlog,
    find_nats_server,
)
from timer_service.cli import EXIT_CONFIG

#: The service's durable consumer of ``TIMER_COMMANDS``.
CONSUMER = "timer-service"
#: PostgreSQL as durable as a production server: every commit flushed.
DURABLE_PG = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


class CheckFailed(Exception):
    """A correctness check of a scenario failed (lost, early or out-of-order timers)."""


def nats_server_version() -> str:
    try:
        out = subprocess.run(
            [str(find_nats_server()), "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return "nats-server unknown"
    return out.replace("nats-server: ", "nats-server ")


def package_versions(*names: str) -> str:
    return ", ".join(f"{name} {version(name)}" for name in names)


def free_port() -> int:
    """A port of 127.0.0.1 free right now (:meth:`Service.wait_healthy` copes with another
    process taking it first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- NATS ------------------------------------------------------------------------------------


class Broker:
    """A fresh ``nats-server`` with Timer's streams and consumer, and a connection to it."""

    def __init__(self, root: Path) -> None:
        self.server = NatsServerProcess(root / "nats", host="127.0.0.1", port=0)
        self.nc: Client | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int | None:
        return self.server.pid

    async def __aenter__(self) -> Broker:
        await asyncio.to_thread(self.server.start)
        try:
            self.nc = await nats.connect(self.url, max_reconnect_attempts=0)
            # The streams and the consumer exactly as the service provisions them.
            async with NatsBroker(
                NatsSettings(url=self.url, consumer_name=CONSUMER, per_tenant_intake=False)
            ):
                pass
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

    async def stream_messages(self, stream: str = "TIMER_EVENTS") -> int:
        info = await self.client.jetstream(timeout=10).stream_info(stream)
        return int(info.state.messages)

    async def command_backlog(self) -> int:
        """Commands the service has not acknowledged yet (pending + in flight)."""
        settings = NatsSettings(url=self.url, consumer_name=CONSUMER)
        backlog = await command_backlog(self.client.jetstream(timeout=10), settings)
        return backlog.pending + backlog.in_hand

    async def send_schedules(self, timers: list[tuple[str, str, int]]) -> None:
        """Publish ``ScheduleTimer`` for ``(tenant, serviceCallId, due ms)``; every one acked."""
        from timer_core.instants import from_epoch_ms

        sender = TimerClient(self.client, publish_window=1000, ack_timeout_s=30)
        for start in range(0, len(timers), 5000):
            envelopes = [
                sender.schedule_envelope(tenant, call, from_epoch_ms(due))
                for tenant, call, due in timers[start : start + 5000]
            ]
            failed = [error for error in await sender.send_many(envelopes) if error is not None]
            if failed:
                raise CheckFailed(f"{len(failed)} commands not acked by JetStream: {failed[0]}")

    async def read_events(self, expected: int, *, idle_s: float = 30.0) -> list[dict[str, Any]]:
        """The payload of every ``DueTimeReached`` in ``TIMER_EVENTS``, in stream order (with
        the envelope's ``id`` as ``_id``), by a pull consumer without acks."""
        js = self.client.jetstream(timeout=30)
        subscription = await js.pull_subscribe(
            "timer.events.>",
            stream="TIMER_EVENTS",
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
                inactive_threshold=60.0,
            ),
        )
        events: list[dict[str, Any]] = []
        idle_until = time.monotonic() + idle_s
        try:
            while len(events) < expected and time.monotonic() < idle_until:
                try:
                    batch = await subscription.fetch(min(10_000, expected - len(events)), timeout=2)
                except TimeoutError:
                    continue
                idle_until = time.monotonic() + idle_s
                for message in batch:
                    body = json.loads(message.data)
                    events.append({**body["payload"], "_id": body["id"]})
        finally:
            await subscription.unsubscribe()
        return events


# -- PostgreSQL ------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres(settings: dict[str, str] | None = DURABLE_PG) -> Iterator[Any]:
    """A throwaway PostgreSQL cluster (the test suite's, ``tests/pg.py``): durable unless
    given other ``settings`` (None: the suite's, fast and not durable). The kit runs from the
    repository's root, where ``tests`` is importable."""
    try:
        pg = importlib.import_module("tests.pg")
    except ImportError as exc:
        raise SystemExit(
            "the PostgreSQL scenarios start the test suite's cluster (tests/pg.py): "
            "run `python -m timer_bench` from the repository's root"
        ) from exc
    root = Path(tempfile.mkdtemp(prefix="timer-bench-pg-"))
    os.chmod(root, 0o755)  # handed to the postgres user when we are root
    cluster = pg.start_cluster(root, settings)
    try:
        yield cluster
    finally:
        cluster.stop()
        subprocess.run(["rm", "-rf", str(root)], check=False)


def postgres_version() -> str:
    bin_dir = importlib.import_module("tests.pg").postgres_bin_dir()
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True
    ).stdout.strip()
    return out.replace("postgres (PostgreSQL)", "PostgreSQL")


# -- the service -----------------------------------------------------------------------------


class Service:
    """``timer-service run`` as a subprocess in its own process group, with ``settings`` as
    its ``TIMER_*`` environment (none of this process's own)."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        settings: Mapping[str, object],
        profile: Path | None = None,
    ) -> None:
        self.workdir = workdir
        self.log_path = workdir / f"service-{name}.log"
        self.profile = profile
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        self.env.update({key: str(value) for key, value in settings.items()})
        self.env.setdefault("TIMER_HTTP_PORT", str(free_port()))
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.startup_s = float("nan")
        self._log_offset = 0

    @property
    def http_port(self) -> int:
        return int(self.env["TIMER_HTTP_PORT"])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

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
                cwd=self.workdir,
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
        """Until ``/healthz`` answers 200; should another process have taken the HTTP port
        first, the service starts again on a fresh one."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                if self.proc.returncode == EXIT_CONFIG and self._port_taken():
                    self.env["TIMER_HTTP_PORT"] = str(free_port())
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

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise CheckFailed(f"service exited {self.proc.returncode}: {self.tail()}")

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
        """Peak resident memory of the service so far (``VmHWM``), in MiB."""
        return round(vm_kib(self.pid, "VmHWM") / 1024, 1)

    def cpu_s(self) -> float:
        times = psutil.Process(self.pid).cpu_times()
        return float(times.user + times.system)

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> int:
        """SIGTERM, then wait for the clean exit the contract promises (exit 0)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc is not None else 0
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
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def vm_kib(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak RSS) of a process from /proc, in KiB (0 once it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# -- CPU accounting --------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """CPU seconds per group of processes, and the machine's busy seconds, at one moment."""

    wall: float
    cpu: dict[str, float]
    busy: float

    @classmethod
    def now(cls, groups: dict[str, list[int]]) -> Usage:
        """The CPU seconds of each group of pids (see :func:`with_children`)."""

        def seconds(pids: list[int]) -> float:
            total = 0.0
            for pid in pids:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = psutil.Process(pid).cpu_times()
                    total += times.user + times.system
            return total

        machine = psutil.cpu_times()
        return cls(
            wall=time.perf_counter(),
            cpu={group: seconds(pids) for group, pids in groups.items()},
            busy=machine.user + machine.system + machine.nice + machine.irq + machine.softirq,
        )

    def cores(self, later: Usage) -> dict[str, float]:
        """Cores each group kept busy until ``later``; ``other``: the rest of the machine
        (other work sharing it)."""
        wall = later.wall - self.wall
        used = {group: (later.cpu[group] - self.cpu[group]) / wall for group in self.cpu}
        used["other"] = max(0.0, (later.busy - self.busy) / wall - sum(used.values()))
        return used


def with_children(pid: int) -> list[int]:
    """A process and all its descendants (a PostgreSQL server's backends, say)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    return []
