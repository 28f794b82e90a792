"""The service as a real subprocess for tests: start, probe over HTTP, stop, kill its group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    """``timer-service run`` in its own process group, killed with it at teardown."""

    def __init__(self, env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.env = env
        self.cwd = cwd
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *args: str) -> ServiceProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "timer_service.cli", "run", *args],
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

    def wait_healthy(self, timeout: float = 30.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
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
        return self.proc.wait(timeout)

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
