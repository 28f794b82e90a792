"""The test harness's service process: a port taken before the service listens costs a restart
on a fresh port, never a failed test; any other startup failure still fails."""

from __future__ import annotations

import socket

import pytest

from tests.timer_service.process import ServiceProcess


class TestTakenPort:
    def test_a_port_taken_before_the_service_listens_is_replaced(
        self, service: ServiceProcess
    ) -> None:
        """When another process holds the service's HTTP port, wait_healthy starts it again on
        a fresh port and it becomes healthy there."""
        taken = service.http_port
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            service.start()
            service.wait_healthy()
            assert service.http_port != taken
        assert f"TIMER_HTTP_PORT={taken}: cannot listen on 127.0.0.1:{taken}: " in service.log()

    def test_another_startup_failure_is_not_retried(self, service: ServiceProcess) -> None:
        """A service that cannot listen for another reason (an address not of this host)
        fails wait_healthy with its message, after one start."""
        service.env["TIMER_HTTP_HOST"] = "192.0.2.1"  # TEST-NET-1: never a local address
        port = service.http_port
        service.start()
        with pytest.raises(AssertionError, match="service exited 2"):
            service.wait_healthy()
        assert service.http_port == port
        assert service.log().count("cannot listen on 192.0.2.1") == 1
