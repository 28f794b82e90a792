"""`timer-service run` twice on one TIMER_DB_PATH: the second exits at once naming the fix,
before it starts an embedded broker beside the first's, and the first runs on, its CLI
included. (A SIGKILLed service's restart: tests/timer_service/test_service.py,
TestEmbeddedBroker.)"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil

from tests.timer_service.process import ServiceProcess, free_port
from tests.timer_service.test_service import run_cli
from timer_service.cli import EXIT_CONFIG


def embedded_env(db_path: Path) -> dict[str, str]:
    """A service on ``db_path`` with its embedded broker (no TIMER_BROKER_URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    env.update(TIMER_DB_PATH=str(db_path), TIMER_HTTP_PORT=str(free_port()))
    return env


def nats_servers(service: ServiceProcess) -> list[psutil.Process]:
    assert service.proc is not None
    children = psutil.Process(service.proc.pid).children()
    return [child for child in children if "nats-server" in child.name()]


class TestSecondServiceOnOneFile:
    def test_the_second_exits_naming_the_fix_and_the_first_runs_on(self, tmp_path: Path) -> None:
        """The second `run` on the file exits 2 with one line naming TIMER_DB_PATH, the first
        service's pid and the fix, without starting a nats-server; the first stays healthy,
        keeps its broker URL file, and takes `schedule` and `inspect` from the CLI."""
        db_path = tmp_path / "timer.db"
        first = ServiceProcess(embedded_env(db_path), tmp_path, tmp_path / "first.log")
        second = ServiceProcess(embedded_env(db_path), tmp_path, tmp_path / "second.log")
        try:
            first.start()
            first.wait_healthy()
            assert first.proc is not None
            url_file = tmp_path / "timer.db.nats" / "url"
            assert url_file.exists(), sorted(p.name for p in tmp_path.iterdir())
            url = url_file.read_text()

            second.start()
            assert second.proc is not None
            assert second.proc.wait(60) == EXIT_CONFIG, second.log()
            error = second.output().strip().splitlines()[-1]
            assert error.startswith(f"timer-service: TIMER_DB_PATH={db_path}: "), error
            assert f"(in process {first.proc.pid})" in error
            assert "stop it first, or give this service a TIMER_DB_PATH of its own" in error
            assert "PostgreSQL (TIMER_DATABASE_URL)" in error
            assert "embedded nats-server" not in second.log()

            assert url_file.read_text() == url
            assert len(nats_servers(first)) == 1
            first.wait_healthy()
            env = first.env
            scheduled = run_cli(
                "schedule", "tenant-a", "call-1", "--in", "1h", env=env, cwd=tmp_path
            )
            assert scheduled.returncode == 0, scheduled.stderr
            # The command reaches the store through the broker: `inspect` shows it once stored.
            deadline = time.monotonic() + 60
            while True:
                shown = run_cli(
                    "inspect",
                    "tenant-a",
                    "--service-call",
                    "call-1",
                    "--json",
                    env=env,
                    cwd=tmp_path,
                )
                if shown.returncode == 0 or time.monotonic() > deadline:
                    break
            assert [row["state"] for row in json.loads(shown.stdout)] == ["Scheduled"]
            assert first.terminate() == 0, first.log()
        finally:
            second.kill_group()
            first.kill_group()
