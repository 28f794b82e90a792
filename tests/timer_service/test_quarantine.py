"""An operator sees and retries quarantined timers with `timer-service quarantine`, which asks
the running service's HTTP endpoint (here over a real worker on the memory adapters)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator

import pytest

from tests.timer_core.test_poison import POISON, Rig
from timer_service.access import HttpAccess
from timer_service.cli import EXIT_CONFIG, main
from timer_service.http import HealthEndpoint
from timer_service.metrics import PrometheusInstrumentation

#: The endpoint's TIMER_HTTP_TOKEN; the CLI reads the same variable.
TOKEN = "quarantine-token-0123456789"


@pytest.fixture
async def quarantined(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Rig, int]]:
    """A worker that quarantined the poison timer, and the port of its HTTP endpoint (its
    token in the environment the CLI reads)."""
    monkeypatch.setenv("TIMER_HTTP_TOKEN", TOKEN)
    metrics = PrometheusInstrumentation()
    rig = Rig(instrumentation=metrics)
    await rig.store.start()
    rig.bus.fail_when(lambda event: event.payload.service_call_id == POISON)
    rig.task = asyncio.ensure_future(rig.worker.run())
    endpoint = HealthEndpoint(
        "127.0.0.1",
        0,
        metrics.registry,
        lambda: (True, {}),
        quarantine=rig.worker,
        access=HttpAccess(TOKEN),
    )
    await endpoint.start()
    try:
        await rig.schedule(POISON, 0)
        for i in range(120):
            await rig.schedule(f"call-{i}", 0.5 * i)
        await rig.run_until(60)
        assert len(rig.worker.quarantined) == 1
        yield rig, endpoint.port
    finally:
        await endpoint.aclose()
        rig.worker.stop()
        await asyncio.wait_for(rig.task, 5)


async def scrape(port: int, series: str) -> float:
    """One series' value as /metrics shows it (read on a thread: the endpoint runs here)."""

    def read() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return str(response.read().decode())

    for line in (await asyncio.to_thread(read)).splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    raise AssertionError(f"{series} is not exposed")


async def cli(*args: str) -> int:
    return await asyncio.to_thread(main, ["quarantine", *args])


class TestQuarantineCommand:
    async def test_list_shows_the_timer_and_retry_fires_it(
        self, quarantined: tuple[Rig, int], capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`quarantine list` shows the quarantined timer with its last error; once its cause
        is fixed, `quarantine retry TENANT CALL` puts it back and it fires."""
        rig, port = quarantined
        assert await scrape(port, "timer_quarantined_total") == 1.0
        assert await scrape(port, "timer_timers_quarantined") == 1.0
        assert await cli("list", "--json", "--http-port", str(port)) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert (row["tenantId"], row["serviceCallId"]) == ("tenant-a", POISON)
        assert row["dueAt"] == "2030-01-01T00:00:00.000Z"
        assert row["failures"] >= 10
        assert "refused on purpose" in row["error"]
        rig.bus.fail_when(None)
        assert await cli("retry", "tenant-a", POISON, "--http-port", str(port)) == 0
        assert "1 timer(s) put back" in capsys.readouterr().out
        published = await rig.bus.wait_for_published(121)
        assert POISON in {e.payload.service_call_id for e in published}
        assert await cli("list", "--json", "--http-port", str(port)) == 0
        assert json.loads(capsys.readouterr().out) == []
        assert await scrape(port, "timer_timers_quarantined") == 0.0

    async def test_retry_of_nothing_and_bad_usage(
        self, quarantined: tuple[Rig, int], capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Retrying a timer that is not quarantined exits 1; a tenant without a call is a
        usage error; no service listening is a clear error."""
        _, port = quarantined
        assert await cli("retry", "tenant-a", "other", "--http-port", str(port)) == 1
        assert await cli("retry", "tenant-a", "--http-port", str(port)) == EXIT_CONFIG
        assert "name the SERVICE_CALL" in capsys.readouterr().err
        assert await cli("list", "--http-port", "1") == EXIT_CONFIG
        assert "no Timer service answered" in capsys.readouterr().err

    async def test_without_the_token_the_command_is_refused(
        self,
        quarantined: tuple[Rig, int],
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Without TIMER_HTTP_TOKEN (or with another one) `quarantine` is refused with 401 and
        retries nothing."""
        rig, port = quarantined
        monkeypatch.delenv("TIMER_HTTP_TOKEN")
        assert await cli("retry", "--all", "--http-port", str(port)) == EXIT_CONFIG
        assert "HTTP 401" in capsys.readouterr().err
        monkeypatch.setenv("TIMER_HTTP_TOKEN", "another-token-0123456789")
        assert await cli("list", "--http-port", str(port)) == EXIT_CONFIG
        assert "HTTP 401" in capsys.readouterr().err
        assert len(rig.worker.quarantined) == 1
