"""Acknowledged means on disk: the embedded nats-server syncs before it acknowledges, and the
service says when an external one may not (log, /healthz, console) or refuses to start."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import NatsServerFactory
from tests.timer_service.console_rig import console_rig, fetch
from tests.timer_service.process import ServiceFactory, ServiceProcess, free_port, isolated_env
from timer_adapters_nats.embedded import NatsServerProcess
from timer_service.app import _start_embedded
from timer_service.cli import EXIT_CONFIG
from timer_service.durability import read_monitor
from timer_service.settings import Settings


@pytest.fixture
def monitored(nats_server_factory: NatsServerFactory) -> Callable[..., NatsServerProcess]:
    """``monitored(sync_always=...)``: a started nats-server with its monitoring endpoint on
    a free port (stopped at teardown)."""

    def start(*, sync_always: bool) -> NatsServerProcess:
        server = nats_server_factory(sync_always=sync_always, extra_args=("-m", str(free_port())))
        server.start()
        return server

    return start


def monitor_url(server: NatsServerProcess) -> str:
    port = server.extra_args[server.extra_args.index("-m") + 1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def services(tmp_path: Path) -> Iterator[ServiceFactory[ServiceProcess]]:
    """``services(**TIMER_settings)``: an unstarted service on ``tmp_path/timer.db``, killed
    by its group at teardown."""
    factory = ServiceFactory(
        ServiceProcess,
        tmp_path,
        lambda **settings: isolated_env(TIMER_DB_PATH=str(tmp_path / "timer.db"), **settings),
    )
    try:
        yield factory
    finally:
        factory.close()


Services = ServiceFactory[ServiceProcess]
Monitored = Callable[..., NatsServerProcess]


class TestEmbeddedServer:
    def test_the_server_syncs_before_it_acknowledges(self, monitored: Monitored) -> None:
        """A NatsServerProcess made with sync_always runs JetStream with sync_interval
        always (its own /varz says so); without it, the server's two-minute default."""
        synced = monitored(sync_always=True)
        default = monitored(sync_always=False)
        assert read_monitor(monitor_url(synced))["sync_always"] is True
        config = read_monitor(monitor_url(default))
        assert not config.get("sync_always", False)
        assert config["sync_interval"] == 120 * 10**9

    def test_timer_service_run_starts_it_synced_and_says_so(self, services: Services) -> None:
        """With no TIMER_BROKER_URL the service's own nats-server runs with sync_interval
        always, and /healthz says acknowledgements are on disk."""
        service = services().start()
        health = service.wait_healthy(60)
        assert health["broker_acks_on_disk"] is True
        assert "broker_durability" not in health
        (server,) = [
            child
            for child in psutil.Process(service.proc.pid).children(recursive=True)  # type: ignore[union-attr]
            if "nats-server" in child.name()
        ]
        config = Path(server.cmdline()[server.cmdline().index("-c") + 1]).read_text()
        assert "sync_interval: always" in config
        assert service.terminate() == 0

    def test_the_sync_can_be_turned_back_to_the_interval(self, services: Services) -> None:
        """TIMER_EMBEDDED_NATS_SYNC=interval runs nats-server's default, and the service warns
        that a power loss can lose what it acknowledged."""
        service = services(TIMER_EMBEDDED_NATS_SYNC="interval").start()
        health = service.wait_healthy(60)
        assert health["broker_acks_on_disk"] is False
        assert "power loss of this machine" in str(health["broker_durability"])
        assert "WARNING" in service.output() and "power loss" in service.output()
        assert service.terminate() == 0


class TestExternalServer:
    def test_unknown_sync_is_a_warning(self, monitored: Monitored, services: Services) -> None:
        """Without TIMER_BROKER_MONITOR_URL the service cannot tell, and says so: a WARNING
        in the log and the line on /healthz, naming the setting that tells."""
        server = monitored(sync_always=False)
        service = services(TIMER_BROKER_URL=server.url).start()
        health = service.wait_healthy(60)
        assert health["broker_acks_on_disk"] is None
        assert "TIMER_BROKER_MONITOR_URL" in str(health["broker_durability"])
        warnings = [line for line in service.output().splitlines() if "WARNING" in line]
        assert any("power loss of the server" in line for line in warnings), warnings

    def test_a_server_that_syncs_every_two_minutes_is_named(
        self, monitored: Monitored, services: Services
    ) -> None:
        """With the monitoring endpoint, the server's own sync_interval is read and said."""
        server = monitored(sync_always=False)
        service = services(
            TIMER_BROKER_URL=server.url,
            TIMER_BROKER_MONITOR_URL=monitor_url(server),
        ).start()
        health = service.wait_healthy(60)
        assert health["broker_acks_on_disk"] is False
        assert "only every 120s" in str(health["broker_durability"])

    def test_a_synced_server_raises_no_warning(
        self, monitored: Monitored, services: Services
    ) -> None:
        """A server with sync_interval always, read through its monitoring endpoint: on disk,
        no warning, and TIMER_REQUIRE_DURABLE_BROKER lets the service start."""
        server = monitored(sync_always=True)
        service = services(
            TIMER_BROKER_URL=server.url,
            TIMER_BROKER_MONITOR_URL=monitor_url(server),
            TIMER_REQUIRE_DURABLE_BROKER="true",
        ).start()
        health = service.wait_healthy(60)
        assert health["broker_acks_on_disk"] is True
        assert "broker_durability" not in health
        assert "power loss" not in service.output()

    def test_a_setting_refuses_to_start_on_a_server_that_can_lose_acks(
        self, monitored: Monitored, services: Services
    ) -> None:
        """TIMER_REQUIRE_DURABLE_BROKER=true: the service exits with the configuration error
        status, its one line naming the setting and the risk."""
        server = monitored(sync_always=False)
        service = services(
            TIMER_BROKER_URL=server.url,
            TIMER_BROKER_MONITOR_URL=monitor_url(server),
            TIMER_REQUIRE_DURABLE_BROKER="true",
        ).start()
        assert service.proc is not None
        assert service.proc.wait(60) == EXIT_CONFIG
        assert "TIMER_REQUIRE_DURABLE_BROKER" in service.output()
        assert "power loss" in service.output()


class TestConsole:
    async def test_the_overview_shows_how_acked_events_can_be_lost(self) -> None:
        """The service's durability warning heads the console's overview, as an alert."""
        risk = "Broker durability: a power loss of the server can lose DueTimeReached events."
        async with console_rig(warnings=[risk]) as rig:
            page = await fetch(rig.port, "/console")
        assert page.status == 200
        assert f'<p class="notice" role="alert">{risk}</p>' in page.body


class TestEmbeddedPort:
    def test_a_port_taken_as_the_server_starts_falls_back_to_any(self, tmp_path: Path) -> None:
        """The service looks for 4222 free, then starts nats-server on it; another process
        that binds it in between (two services or test runs starting at once) costs nothing:
        the embedded server starts on a port of its own instead of failing the start."""
        settings = Settings.from_environment({"TIMER_DB_PATH": str(tmp_path / "timers.db")})
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            server = _start_embedded(settings, port)
            try:
                assert server.running
                assert server.port not in (port, 0)
            finally:
                server.stop()
