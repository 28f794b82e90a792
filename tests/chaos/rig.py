"""What the chaos scenarios share: the service as a killable subprocess that is watched for
memory and CPU, fast readers of the JetStream streams and the SQLite file, and polling waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, ClassVar

import attrs
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.client import JetStreamContext

from tests.figures import Figures
from tests.timer_service.process import ServiceProcess, http_get, isolated_env
from timer_adapters_nats import CommandBacklog, NatsSettings, command_backlog

FIGURES = Figures("chaos")
report = FIGURES.report


async def wait_until(
    condition: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    within: float,
    interval: float = 0.05,
    what: str = "condition",
) -> float:
    """Poll ``condition`` until true; returns the seconds it took, fails after ``within``."""
    started = time.monotonic()
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > within:
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


class ProcessWatch:
    """Samples one process's resident memory every few milliseconds, on a thread.

    The pid may change (a restarted service): :meth:`follow` points it at the new one; the peak
    is over every process followed.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak_rss = 0
        self.samples = 0
        self._process: psutil.Process | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-rss", daemon=True)
        self._thread.start()

    def follow(self, pid: int | None) -> None:
        with self._lock:
            self._process = None if pid is None else psutil.Process(pid)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                process = self._process
            if process is None:
                continue
            try:
                rss = process.memory_info().rss
            except psutil.Error:
                continue
            self.samples += 1
            self.peak_rss = max(self.peak_rss, rss)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    @property
    def peak_rss_mb(self) -> float:
        return round(self.peak_rss / 2**20, 1)


class ChaosService(ServiceProcess):
    """``timer-service run`` whose output goes through a pipe (so a file-size limit put on the
    service never stops its log from reaching the test) and whose memory is sampled."""

    def __init__(self, env: dict[str, str], cwd: Path, log_path: Path) -> None:
        super().__init__(env, cwd, log_path)
        self.watch = ProcessWatch()
        self.starts = 0
        self.kills = 0
        self._copier: threading.Thread | None = None
        self._lines: list[str] = []
        self._lines_offset = 0
        self._lines_lock = threading.Lock()

    def start(self, *args: str) -> ChaosService:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._join_copier()  # the output of a run that ended on its own, before the next
        self.args = args
        with self._lines_lock:
            self._lines_offset = len(self._lines)
        self.proc = subprocess.Popen(
            [*self.command, *args],
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._copier = threading.Thread(
            target=self._copy, args=(self.proc.stdout,), name="chaos-service-log", daemon=True
        )
        self._copier.start()
        self.starts += 1
        self.watch.follow(self.proc.pid)
        return self

    def _copy(self, stream: IO[bytes]) -> None:
        with self.log_path.open("ab") as log:
            for raw in stream:
                log.write(raw)
                log.flush()
                with self._lines_lock:
                    self._lines.append(raw.decode("utf-8", "replace"))
        stream.close()

    def lines(self) -> list[str]:
        """Every line the service logged so far, over all its starts."""
        with self._lines_lock:
            return list(self._lines)

    def output(self) -> str:
        """What the service logged since its latest start (all of it, once it exited)."""
        if self.proc is not None and self.proc.poll() is not None:
            self._join_copier()
        with self._lines_lock:
            return "".join(self._lines[self._lines_offset :])

    def count_lines(self, needle: str) -> int:
        return sum(needle in line for line in self.lines())

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the service's process group, like a crash, and reap it."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.kills += 1
        self._join_copier()

    def terminate(self, timeout: float = 30.0) -> int:
        code = super().terminate(timeout)
        self._join_copier()
        return code

    def kill_group(self) -> None:
        super().kill_group()
        self._join_copier()

    def close(self) -> None:
        """Kill whatever still runs and stop sampling (teardown)."""
        self.kill_group()
        self.watch.close()

    def _join_copier(self) -> None:
        if self._copier is not None:
            self._copier.join(5)
            self._copier = None

    def metric(self, name: str) -> float:
        """One sample of ``/metrics`` (the sum over its label sets); 0 if absent."""
        status, body = http_get(self.http_port, "/metrics")
        assert status == 200, body
        total = 0.0
        for line in body.splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def cpu_seconds(self) -> float:
        """User plus system CPU time the service process has used so far."""
        times = psutil.Process(self.pid).cpu_times()
        return float(times.user + times.system)


def service_env(tmp_path: Path, broker_url: str, **settings: str | int) -> dict[str, str]:
    """The environment of a service on ``tmp_path/timer.db`` and ``broker_url``."""
    defaults: dict[str, str | int] = {
        "TIMER_DB_PATH": str(tmp_path / "timer.db"),
        "TIMER_BROKER_URL": broker_url,
        "TIMER_POLLING_INTERVAL": "500",
    }
    return isolated_env(**{**defaults, **settings})


@attrs.frozen
class Event:
    """One ``DueTimeReached`` as ``TIMER_EVENTS`` holds it."""

    seq: int
    stored_at: datetime
    """When JetStream stored it (the stream's timestamp)."""
    msg_id: str
    tenant_id: str
    service_call_id: str
    due_at: datetime
    reached_at: datetime
    body: dict[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return self.tenant_id, self.service_call_id


async def read_stream(js: JetStreamContext, stream: str, *, within: float = 60.0) -> list[Msg]:
    """Every message ``stream`` holds right now, in stream order, through an ordered push
    consumer (ten times faster than pulling, which matters for 100,000 events)."""
    info = await js.stream_info(stream)
    total = info.state.messages
    if total == 0:
        return []
    (subject,) = info.config.subjects or [">"]
    messages: list[Msg] = []
    complete = asyncio.Event()

    async def collect(msg: Msg) -> None:
        messages.append(msg)
        if len(messages) >= total:
            complete.set()

    sub = await js.subscribe(
        subject,
        stream=stream,
        cb=collect,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    try:
        await asyncio.wait_for(complete.wait(), within)
    except TimeoutError:
        raise AssertionError(f"read {len(messages)} of {total} messages of {stream}") from None
    finally:
        await sub.unsubscribe()
    return messages[:total]


def stream_position(msg: Msg) -> tuple[int, datetime]:
    """The stream sequence of a delivered message and when the stream stored it."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<cseq>.<ns>.<pending>
        seq, nanos = int(tokens[5]), int(tokens[7])
        return seq, datetime.fromtimestamp(nanos / 1e9, UTC)
    metadata = msg.metadata
    return metadata.sequence.stream, metadata.timestamp


async def read_events(js: JetStreamContext, stream: str = "TIMER_EVENTS") -> list[Event]:
    """Every ``DueTimeReached`` in the events stream, in stream order."""
    events = []
    for msg in await read_stream(js, stream):
        body = json.loads(msg.data)
        payload = body["payload"]
        seq, stored_at = stream_position(msg)
        events.append(
            Event(
                seq=seq,
                stored_at=stored_at,
                msg_id=(msg.headers or {}).get("Nats-Msg-Id", ""),
                tenant_id=payload["tenantId"],
                service_call_id=payload["serviceCallId"],
                # Timer writes one canonical form, which fromisoformat reads in C.
                due_at=datetime.fromisoformat(payload["dueAt"]),
                reached_at=datetime.fromisoformat(payload["reachedAt"]),
                body=body,
            )
        )
    return events


async def count_messages(js: JetStreamContext, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


def duplicates(events: Iterable[Event]) -> int:
    """Events beyond the first for the same timer key and due time."""
    seen: set[tuple[str, str, datetime]] = set()
    extra = 0
    for event in events:
        firing = (event.tenant_id, event.service_call_id, event.due_at)
        if firing in seen:
            extra += 1
        seen.add(firing)
    return extra


def db_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of the timer table, read with a connection of our own (WAL lets it read
    while the service writes)."""
    with contextlib.closing(
        sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    ) as connection:
        connection.row_factory = sqlite3.Row
        rows = connection.execute("SELECT * FROM timer_schedules").fetchall()
    return [dict(row) for row in rows]


def db_count(path: Path, where: str = "1") -> int:
    """How many timers match the SQL condition ``where``."""
    with contextlib.closing(
        sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    ) as connection:
        (count,) = connection.execute(
            f"SELECT count(*) FROM timer_schedules WHERE {where}"
        ).fetchone()
    return int(count)


async def at_least(count: Awaitable[int], minimum: int) -> bool:
    """Whether the awaited count reached ``minimum`` (for :func:`wait_until`)."""
    return await count >= minimum


class AckLog:
    """Every ack, nak and term the service's consumer sends for a command, as the test saw
    them go by on ``$JS.ACK.<stream>.>`` (a copy of the service's own ack messages).

    Times are when the test received them: upper bounds of when the service settled each.
    """

    KINDS: ClassVar[dict[bytes, str]] = {
        b"": "ack",
        b"+ACK": "ack",
        b"-NAK": "nak",
        b"+TERM": "term",
        b"+WPI": "progress",
    }

    def __init__(self, stream: str = "TIMER_COMMANDS") -> None:
        self.stream = stream
        self.settled: dict[int, list[tuple[str, datetime, int]]] = {}
        self._sub: Any = None

    async def start(self, nc: Client) -> AckLog:
        self._sub = await nc.subscribe(f"$JS.ACK.{self.stream}.>", cb=self._on_ack)
        await nc.flush()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_ack(self, msg: Msg) -> None:
        metadata = Msg.Metadata._from_reply(msg.subject)
        kind = self.KINDS.get(msg.data.split(b" ", 1)[0], "other")
        when = datetime.now(UTC)
        self.settled.setdefault(metadata.sequence.stream, []).append(
            (kind, when, metadata.num_delivered)
        )

    def first(self, seq: int, kind: str = "ack") -> datetime | None:
        """When the command at stream sequence ``seq`` was first settled as ``kind``."""
        return next((at for k, at, _ in self.settled.get(seq, []) if k == kind), None)

    def kinds(self, seq: int) -> list[str]:
        return [kind for kind, _, _ in self.settled.get(seq, [])]


# Takes the database's write lock and holds it until a line arrives on stdin.
_LOCKER = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
connection.execute("ROLLBACK")
"""


@contextlib.asynccontextmanager
async def write_lock(path: Path) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Another process holds ``BEGIN EXCLUSIVE`` on the database until the yielded release
    is awaited (or the block ends); it is killed by pid if anything goes wrong."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LOCKER,
        str(path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None
    stdin = process.stdin

    async def release() -> None:
        if process.returncode is None:
            stdin.write(b"\n")
            await stdin.drain()
            assert await asyncio.wait_for(process.wait(), 30) == 0

    try:
        assert await asyncio.wait_for(process.stdout.readline(), 30) == b"locked\n"
        yield release
        await release()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def service_backlog(js: JetStreamContext) -> CommandBacklog:
    """What the service (consumer name ``timer-service``) has not settled of its commands,
    over its consumer per tenant (or its shared consumer)."""
    return await command_backlog(
        js, NatsSettings(url="nats://127.0.0.1", consumer_name="timer-service")
    )
