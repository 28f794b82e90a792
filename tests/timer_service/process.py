"""The service as a real subprocess for tests: start, probe over HTTP, stop, kill its group."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from timer_service.cli import EXIT_CONFIG


def free_port() -> int:
    """A port of 127.0.0.1 free right now; another process may take it before the service
    listens on it, which :meth:`ServiceProcess.wait_healthy` cures (see :func:`port_taken`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_taken(output: str, env: dict[str, str]) -> bool:
    """Whether a service's ``output`` is its startup failure for the address of ``env``'s
    ``TIMER_HTTP_HOST``:``TIMER_HTTP_PORT`` being in use, and nothing else."""
    host, port = env.get("TIMER_HTTP_HOST", "127.0.0.1"), env["TIMER_HTTP_PORT"]
    failure = f"timer-service: TIMER_HTTP_PORT={port}: cannot listen on {host}:{port}: "
    in_use = os.strerror(errno.EADDRINUSE).lower()
    return any(
        line.startswith(failure) and line.lower().endswith(in_use) for line in output.splitlines()
    )


def isolated_env(**settings: str | int) -> dict[str, str]:
    """The environment of a service a test starts: none of the test run's own ``TIMER_*``
    variables, an HTTP port of its own, then ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    env["TIMER_HTTP_PORT"] = str(free_port())
    env.update({key: str(value) for key, value in settings.items()})
    return env


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class ServiceProcess:
    """``timer-service run`` (or ``command``) in its own process group, killed with it at
    teardown.

    Its HTTP port is ``env["TIMER_HTTP_PORT"]``, one :func:`free_port` found free; should
    another process take it before the service listens, :meth:`wait_healthy` starts the
    service again on a fresh one.
    """

    def __init__(
        self,
        env: dict[str, str],
        cwd: Path,
        log_path: Path,
        command: Sequence[str] = (sys.executable, "-m", "timer_service.cli", "run"),
    ) -> None:
        self.env = env
        self.cwd = cwd
        self.log_path = log_path
        self.command = tuple(command)
        self.proc: subprocess.Popen[bytes] | None = None
        self.args: tuple[str, ...] = ()
        self._log_offset = 0

    def start(self, *args: str) -> ServiceProcess:
        self.args = args
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                [*self.command, *args],
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def http_port(self) -> int:
        return int(self.env["TIMER_HTTP_PORT"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def output(self) -> str:
        """What the service logged since its latest start."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    def wait_healthy(self, timeout: float = 30.0) -> dict[str, object]:
        """Until ``/healthz`` answers 200 (its details); fails if the service exits, unless
        it exited because its port was taken: then it starts again on a fresh port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                if self.proc.returncode == EXIT_CONFIG and port_taken(self.output(), self.env):
                    self.env["TIMER_HTTP_PORT"] = str(free_port())
                    self.start(*self.args)
                    continue
                raise AssertionError(f"service exited {self.proc.returncode}:\n{self.log()}")
            try:
                status, body = http_get(self.http_port, "/healthz")
                if status == 200:
                    return dict(json.loads(body))
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"service not healthy after {timeout}s:\n{self.log()}")

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            # The service's own log says what it was still waiting for.
            tail = self.output()[-20_000:]
            raise AssertionError(f"no exit {timeout} s after SIGTERM; its log:\n{tail}") from exc

    def kill_group(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        """Teardown: kill whatever still runs."""
        self.kill_group()


S = TypeVar("S", bound=ServiceProcess)


class ServiceFactory(Generic[S]):
    """``factory(**TIMER_settings)``: an unstarted service in ``cwd`` with a log of its own;
    :meth:`close` closes every one made (a fixture's teardown)."""

    def __init__(self, kind: type[S], cwd: Path, env: Callable[..., dict[str, str]]) -> None:
        self.kind = kind
        self.cwd = cwd
        self.env = env
        self.made: list[S] = []

    def __call__(self, **settings: str | int) -> S:
        service = self.kind(
            self.env(**settings), self.cwd, self.cwd / f"service-{len(self.made)}.log"
        )
        self.made.append(service)
        return service

    def close(self) -> None:
        for service in self.made:
            service.close()
