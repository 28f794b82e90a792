"""The HTTP endpoint's actions and tenant data answer only a request with the token, the
endpoint's own ``Host`` and no cross-site marks; probes and scrapes need no token, but the
endpoint's ``Host`` (or one of ``TIMER_HTTP_PROBE_HOSTS``) too."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime

import pytest

from timer_core import QuarantinedTimer, ServiceCallId, TenantId, TimerEntry, TimerKey
from timer_service.access import HttpAccess, HttpRequest
from timer_service.http import HealthEndpoint
from timer_service.metrics import PrometheusInstrumentation
from timer_service.settings import Settings, SettingsError

TOKEN = "s3cret-token-for-the-endpoint"
DUE = datetime(2030, 1, 1, tzinfo=UTC)


class Held:
    """A quarantine of one timer that counts the retries asked of it."""

    def __init__(self) -> None:
        entry = TimerEntry(TenantId("tenant-a"), ServiceCallId("call-7"), DUE, DUE)
        self.quarantined = [QuarantinedTimer(entry, 10, "refused", DUE)]
        self.retries = 0

    def retry_quarantined(self, keys: Iterable[TimerKey] | None = None) -> int:
        self.retries += 1
        return len(self.quarantined)


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[HealthEndpoint, Held]]:
    """A started endpoint on 127.0.0.1 with a token, serving one quarantined timer."""
    held = Held()
    server = HealthEndpoint(
        "127.0.0.1",
        0,
        PrometheusInstrumentation().registry,
        lambda: (True, {}),
        quarantine=held,
        access=HttpAccess(TOKEN, "127.0.0.1"),
    )
    await server.start()
    try:
        yield server, held
    finally:
        await server.aclose()


async def send(port: int, request_line: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """Send one raw request (headers exactly as given, Host included); status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = request_line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode("latin-1"))
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def good(port: int, **extra: str) -> dict[str, str]:
    return {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {TOKEN}", **extra}


class TestGuardedEndpoints:
    async def test_retry_with_the_token_is_done_and_logged(
        self, endpoint: tuple[HealthEndpoint, Held], caplog: pytest.LogCaptureFixture
    ) -> None:
        """POST /quarantine/retry with the token and the endpoint's Host retries, is logged
        with the client's address, and the log never shows the token."""
        caplog.set_level(logging.INFO)
        server, held = endpoint
        status, body = await send(server.port, "POST /quarantine/retry HTTP/1.1", good(server.port))
        assert (status, json.loads(body)) == (200, {"retried": 1})
        assert held.retries == 1
        assert "allowed: retry quarantined timers" in caplog.text
        assert "127.0.0.1:" in caplog.text
        assert TOKEN not in caplog.text

    @pytest.mark.parametrize(
        ("change", "status"),
        [
            ({"Authorization": None}, 401),
            ({"Authorization": "Bearer wrong-token-0123456789"}, 401),
            ({"Authorization": f"Basic {TOKEN}"}, 401),
            ({"Origin": "http://evil.example"}, 403),
            ({"Origin": "null"}, 403),
            ({"Sec-Fetch-Site": "cross-site"}, 403),
            ({"Host": "evil.example:{port}"}, 403),
            ({"Host": "127.0.0.1:1"}, 403),
            ({"Host": None}, 403),
            ({"Content-Type": "text/plain"}, 415),
            ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
            ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ],
    )
    async def test_retry_refused(
        self,
        endpoint: tuple[HealthEndpoint, Held],
        caplog: pytest.LogCaptureFixture,
        change: dict[str, str | None],
        status: int,
    ) -> None:
        """POST /quarantine/retry without the token, with a foreign Origin or Host, or a
        content type a cross-site form could send, is refused, logged, and retries nothing."""
        caplog.set_level(logging.INFO)
        server, held = endpoint
        headers: dict[str, str] = good(server.port)
        for name, value in change.items():
            headers.pop(name, None)
            if value is not None:
                headers[name] = value.format(port=server.port)
        got, _ = await send(server.port, "POST /quarantine/retry HTTP/1.1", headers)
        assert got == status
        assert held.retries == 0
        assert "refused" in caplog.text
        assert TOKEN not in caplog.text

    async def test_listing_needs_the_token(self, endpoint: tuple[HealthEndpoint, Held]) -> None:
        """GET /quarantine (tenants' timers) needs the token like the actions do."""
        server, _ = endpoint
        port = server.port
        status, body = await send(port, "GET /quarantine HTTP/1.1", {"Host": f"127.0.0.1:{port}"})
        assert status == 401
        assert b"tenant-a" not in body
        status, body = await send(port, "GET /quarantine HTTP/1.1", good(port))
        assert status == 200
        assert json.loads(body)[0]["tenantId"] == "tenant-a"

    async def test_localhost_names_are_the_endpoints_own(
        self, endpoint: tuple[HealthEndpoint, Held]
    ) -> None:
        """On a loopback address, Host localhost:PORT and a same-origin Origin are accepted."""
        server, held = endpoint
        port = server.port
        headers = good(port, Host=f"localhost:{port}", Origin=f"http://localhost:{port}")
        status, _ = await send(port, "POST /quarantine/retry HTTP/1.1", headers)
        assert status == 200
        assert held.retries == 1

    async def test_probes_need_no_token_but_the_endpoints_host(
        self, endpoint: tuple[HealthEndpoint, Held]
    ) -> None:
        """/healthz and /metrics answer without a token (they show no tenant's data), to a
        request naming the endpoint; a rebound name is refused there too, as is an unknown
        path."""
        server, _ = endpoint
        port = server.port
        for path in ("/healthz", "/metrics"):
            status, _ = await send(port, f"GET {path} HTTP/1.1", {"Host": f"127.0.0.1:{port}"})
            assert status == 200, path
            status, body = await send(
                port, f"GET {path} HTTP/1.1", {"Host": f"evil.example:{port}"}
            )
            assert (status, b"evil.example" in body) == (403, True), path
        status, _ = await send(port, "GET /nothing HTTP/1.1", {"Host": "evil.example"})
        assert status == 403

    async def test_probe_hosts_reach_the_probes_only(self) -> None:
        """A name in TIMER_HTTP_PROBE_HOSTS (with or without a port) reaches /healthz and
        /metrics, and nothing else: the quarantine stays refused to it, token or not."""
        held = Held()
        access = HttpAccess(TOKEN, "127.0.0.1", probe_hosts={"timer.internal", "lb:8443"})
        server = HealthEndpoint(
            "127.0.0.1", 0, PrometheusInstrumentation().registry, lambda: (True, {}), held, access
        )
        await server.start()
        try:
            port = server.port
            for host in (f"timer.internal:{port}", "timer.internal", "lb:8443"):
                for path in ("/healthz", "/metrics"):
                    status, _ = await send(port, f"GET {path} HTTP/1.1", {"Host": host})
                    assert status == 200, (host, path)
            status, _ = await send(port, "GET /healthz HTTP/1.1", {"Host": "lb:9999"})
            assert status == 403
            headers = {"Host": "timer.internal", "Authorization": f"Bearer {TOKEN}"}
            status, _ = await send(port, "GET /quarantine HTTP/1.1", headers)
            assert status == 403
        finally:
            await server.aclose()
        settings = Settings.from_environment({"TIMER_HTTP_PROBE_HOSTS": "timer.internal, lb:8443"})
        assert HttpAccess.from_settings(settings).probe_hosts == {"timer.internal", "lb:8443"}
        with pytest.raises(SettingsError, match="TIMER_HTTP_PROBE_HOSTS"):
            Settings.from_environment({"TIMER_HTTP_PROBE_HOSTS": "not a host/"})

    async def test_no_token_configured_turns_the_actions_off(self) -> None:
        """Without TIMER_HTTP_TOKEN every guarded endpoint answers 403 naming the setting."""
        held = Held()
        server = HealthEndpoint(
            "127.0.0.1", 0, PrometheusInstrumentation().registry, lambda: (True, {}), held
        )
        await server.start()
        try:
            headers = good(server.port)
            status, body = await send(server.port, "POST /quarantine/retry HTTP/1.1", headers)
        finally:
            await server.aclose()
        assert status == 403
        assert b"TIMER_HTTP_TOKEN" in body
        assert held.retries == 0


class TestHostRules:
    def check(self, access: HttpAccess, host: str, port: int = 8080) -> int | None:
        request = HttpRequest(
            "POST", "/quarantine/retry", headers={"host": host, "authorization": f"Bearer {TOKEN}"}
        )
        refusal = access.check(request, port, what="test")
        return None if refusal is None else refusal.status

    def test_wildcard_listen_takes_ip_literals_and_allowed_names_only(self) -> None:
        """Listening on 0.0.0.0, a Host that is an IP literal or an allowed name passes; any
        other name (a rebound one) does not."""
        access = HttpAccess(TOKEN, "0.0.0.0", {"timer.internal"})
        assert self.check(access, "10.1.2.3:8080") is None
        assert self.check(access, "[fd00::1]:8080") is None
        assert self.check(access, "timer.internal:8080") is None
        assert self.check(access, f"{socket.gethostname()}:8080") is None
        assert self.check(access, "rebound.example:8080") == 403
        assert self.check(access, "10.1.2.3:9999") == 403

    def test_allowed_name_without_a_port_takes_any(self) -> None:
        """A name allowed without a port (a proxy's) passes with any port or none; one
        allowed with a port only with that port."""
        access = HttpAccess(TOKEN, "127.0.0.1", {"timer.example", "other.example:9000"})
        assert self.check(access, "timer.example") is None
        assert self.check(access, "timer.example:443") is None
        assert self.check(access, "other.example:9000") is None
        assert self.check(access, "other.example:8080") == 403
        assert self.check(access, "other.example") == 403

    def test_named_listen_address(self) -> None:
        """Listening on one address, only that address (with the port) passes."""
        access = HttpAccess(TOKEN, "192.0.2.7")
        assert self.check(access, "192.0.2.7:8080") is None
        assert self.check(access, "127.0.0.1:8080") == 403


class TestTokenSetting:
    def test_read_from_the_environment_and_never_shown(self) -> None:
        """TIMER_HTTP_TOKEN is read, kept out of repr, and checked for length."""
        settings = Settings.from_environment(
            {"TIMER_HTTP_TOKEN": TOKEN, "TIMER_HTTP_ALLOWED_HOSTS": "Timer.Internal, 10.0.0.1:80"}
        )
        assert settings.http_token == TOKEN
        assert settings.http_allowed_hosts == ("timer.internal", "10.0.0.1:80")
        assert TOKEN not in repr(settings)
        with pytest.raises(SettingsError, match="TIMER_HTTP_TOKEN: expected a token of at least"):
            Settings.from_environment({"TIMER_HTTP_TOKEN": "short"})
        with pytest.raises(SettingsError) as caught:
            Settings.from_environment({"TIMER_HTTP_TOKEN": "has-a-blank in-it-long-enough"})
        assert "blank" not in str(caught.value)
