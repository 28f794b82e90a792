"""The service as users run it: a real subprocess, a real nats-server, a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import pytest

from tests.ports import refused_port
from tests.timer_service.process import ServiceProcess, free_port, http_get
from timer_adapters_nats import TimerClient
from timer_core.codec import decode_event


def run_cli(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timer_service.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class TestCommandToEvent:
    async def test_scheduled_timer_fires_as_event(
        self, service: ServiceProcess, nats_url: str
    ) -> None:
        """A ScheduleTimer published by a client comes out as a DueTimeReached on its subject."""
        service.start()
        await asyncio.to_thread(service.wait_healthy)
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            sub = await js.subscribe("timer.events.tenant-a.call-1", ordered_consumer=True)
            due = datetime.now(UTC) + timedelta(milliseconds=300)
            async with TimerClient.connect(nats_url) as client:
                await client.schedule("tenant-a", "call-1", due, correlation_id="req-42")
            msg = await sub.next_msg(timeout=10)
            event = decode_event(msg.data)
        finally:
            await nc.close()
        assert event.payload.tenant_id == "tenant-a"
        assert event.payload.service_call_id == "call-1"
        assert event.correlation_id == "req-42"
        assert event.aggregate_id == "call-1"
        assert event.causation_id is None
        assert event.payload.reached_at >= event.payload.due_at
        assert abs((event.payload.due_at - due).total_seconds()) < 0.002
        assert msg.headers is not None and msg.headers["Nats-Msg-Id"] == event.id

    async def test_inspect_shows_the_timer(
        self, service: ServiceProcess, nats_url: str, tmp_path: Path
    ) -> None:
        """`inspect` reads a tenant's timers from the database while the service runs."""
        service.start()
        await asyncio.to_thread(service.wait_healthy)
        async with TimerClient.connect(nats_url) as client:
            await client.schedule("tenant-b", "call-9", datetime.now(UTC) + timedelta(hours=1))
        for _ in range(200):
            result = run_cli("inspect", "tenant-b", "--json", env=service.env, cwd=tmp_path)
            if result.returncode == 0:
                break
            await asyncio.sleep(0.05)
        rows = json.loads(result.stdout)
        assert [(r["serviceCallId"], r["state"]) for r in rows] == [("call-9", "Scheduled")]


class TestHealthAndMetrics:
    def test_endpoints_answer(self, service: ServiceProcess) -> None:
        """/healthz is 200 with a recent poll, /metrics exposes the contract's series."""
        service.start()
        details = service.wait_healthy()
        assert details["broker_connected"] is True
        assert (details["quarantined"], details["oldest_quarantined_age_s"]) == (0, None)
        status, body = http_get(service.http_port, "/metrics")
        assert status == 200
        for series in (
            "timer_commands_received_total",
            "timer_schedules_processed_total",
            "timer_polling_duration_seconds_bucket",
            "timer_firing_lateness_seconds_bucket",
            "timer_publish_failures_total",
            "timer_timers_pending",
            "timer_timers_quarantined",
            "timer_oldest_quarantined_seconds",
        ):
            assert series in body, series
        assert "\ntimer_instances_sharing 1.0\n" in body  # SQLite: this one alone
        assert http_get(service.http_port, "/nope")[0] == 404


class TestLifecycle:
    def test_sigterm_exits_zero(self, service: ServiceProcess) -> None:
        """SIGTERM shuts the service down cleanly with exit code 0."""
        service.start()
        service.wait_healthy()
        assert service.terminate() == 0, service.log()

    def test_runs_with_nothing_configured(self, tmp_path: Path) -> None:
        """In an empty directory with no settings, `run` starts a nats-server and a timer.db."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env["TIMER_HTTP_PORT"] = str(free_port())
        proc = ServiceProcess(env, tmp_path, tmp_path.parent / f"{tmp_path.name}.log")
        try:
            proc.start()
            proc.wait_healthy()
            assert (tmp_path / "timer.db").exists()
            url_file = tmp_path / "timer.db.nats" / "url"
            assert url_file.read_text().startswith("nats://127.0.0.1:")
            result = run_cli("schedule", "t1", "c1", "--in", "1h", env=env, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            assert proc.terminate() == 0, proc.log()
            assert not url_file.exists()
        finally:
            proc.kill_group()


class TestBadSettings:
    @pytest.mark.parametrize(
        ("variable", "value"),
        [
            ("TIMER_BATCH_SIZE", "lots"),
            ("TIMER_COMMAND_BATCH_SIZE", "0"),
            ("TIMER_POLLING_INTERVAL", "-5"),
            ("TIMER_HTTP_PORT", "70000"),
            ("TIMER_BROKER_URL", "localhost:4222"),
            ("TIMER_SUBJECT_PREFIX", "a.b"),
            ("TIMER_RETENTION", "0"),
            ("TIMER_MAX_PENDING_PER_TENANT", "0"),
        ],
    )
    def test_bad_value_names_the_variable(self, tmp_path: Path, variable: str, value: str) -> None:
        """A bad setting exits non-zero with one line naming the variable."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env[variable] = value
        result = run_cli("run", env=env, cwd=tmp_path)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert variable in lines[0]

    def test_unreachable_broker_names_the_variable(self, tmp_path: Path) -> None:
        """A broker that does not answer at start is a one-line error naming TIMER_BROKER_URL."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        with refused_port() as port:
            env.update(TIMER_BROKER_URL=f"nats://127.0.0.1:{port}", TIMER_HTTP_PORT="0")
            result = run_cli("run", env=env, cwd=tmp_path)
        assert result.returncode != 0
        assert "TIMER_BROKER_URL" in result.stderr.strip().splitlines()[-1]

    def test_unwritable_database_names_the_path(self, tmp_path: Path, nats_url: str) -> None:
        """A database path that cannot be created is a one-line error naming TIMER_DB_PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        env.update(
            TIMER_DB_PATH=str(blocker / "timer.db"), TIMER_BROKER_URL=nats_url, TIMER_HTTP_PORT="0"
        )
        result = run_cli("run", env=env, cwd=tmp_path)
        assert result.returncode != 0
        assert "TIMER_DB_PATH" in result.stderr.strip().splitlines()[-1]


class TestDemo:
    def test_demo_runs_to_its_summary(self, tmp_path: Path) -> None:
        """`timer-service demo` fires every timer, none early, and prints the summary."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        result = run_cli(
            "demo",
            "--timers",
            "600",
            "--tenants",
            "12",
            "--spread",
            "3",
            "--plain",
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "OK: 600/600 timers fired, 0 early" in result.stdout


class TestEmbeddedBroker:
    def test_embedded_server_dies_with_a_killed_service(self, tmp_path: Path) -> None:
        """SIGKILL of the service takes its embedded nats-server with it; a restart works."""
        import psutil

        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env["TIMER_HTTP_PORT"] = str(free_port())
        proc = ServiceProcess(env, tmp_path, tmp_path.parent / f"{tmp_path.name}-kill.log")
        try:
            proc.start()
            proc.wait_healthy()
            assert proc.proc is not None
            children = psutil.Process(proc.proc.pid).children()
            servers = [child for child in children if "nats-server" in child.name()]
            assert len(servers) == 1
            proc.proc.kill()
            proc.proc.wait()
            _gone, alive = psutil.wait_procs(servers, timeout=10)
            assert alive == [], "the embedded nats-server outlived its service"
            proc.start()
            proc.wait_healthy()
            assert proc.terminate() == 0, proc.log()
        finally:
            proc.kill_group()
