"""Bad input at the NATS edge fails at once and clearly: no URL, a silent server, a due time
past year 9999; and TimerClient is the TimerScheduler a host codes against."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import pytest_asyncio

from tests.ports import refused_port
from tests.timer_adapters_nats.jetstream import read_stream
from timer_adapters_nats import BrokerUnavailable, NatsBroker, NatsSettings, TimerClient
from timer_core import EnvelopeId, InvalidTimestamp, TimerScheduler, ValidationError

LAST_MICROSECOND = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
ROOT = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture
async def silent_server() -> AsyncIterator[str]:
    """A URL whose server accepts connections and never says a word (a hung broker)."""
    connections: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A URL whose port refuses connections (held bound, never listening) during the test."""
    with refused_port() as port:
        yield f"nats://127.0.0.1:{port}"


class TestNoServerUrl:
    @pytest.mark.parametrize("url", ["", "   ", ",", " , "])
    def test_settings_without_a_server_are_a_validation_error(self, url: str) -> None:
        """NatsSettings refuses a URL naming no server, saying what a URL looks like."""
        with pytest.raises(ValidationError, match="must name at least one server"):
            NatsSettings(url=url)

    async def test_client_connect_to_an_empty_url_fails_at_once(self) -> None:
        """TimerClient.connect('') raises a ValidationError instead of spinning forever."""
        async with asyncio.timeout(5):
            with pytest.raises(ValidationError, match="must name at least one server"):
                async with TimerClient.connect(""):
                    raise AssertionError("connected to no server")


class TestConnectTimeout:
    @pytest.mark.parametrize("kind", ["silent server", "closed port"])
    async def test_broker_start_gives_up_within_the_connect_timeout(
        self, kind: str, silent_server: str, refused_url: str
    ) -> None:
        """NatsBroker.start() against a server that never answers fails within its timeout."""
        url = silent_server if kind == "silent server" else refused_url
        broker = NatsBroker(NatsSettings(url=url, connect_timeout_s=0.5))
        # The budget is the timeout plus a busy machine's slack, far below "forever".
        async with asyncio.timeout(10):
            with pytest.raises(BrokerUnavailable, match="cannot connect to NATS at") as raised:
                await broker.start()
        assert "\n" not in str(raised.value)
        assert not broker.is_connected

    async def test_client_connect_gives_up_within_the_connect_timeout(
        self, silent_server: str
    ) -> None:
        """TimerClient.connect() to a silent server raises BrokerUnavailable, one line."""
        async with asyncio.timeout(10):
            with pytest.raises(BrokerUnavailable, match=r"within 0\.5s") as raised:
                async with TimerClient.connect(silent_server, connect_timeout_s=0.5):
                    raise AssertionError("connected to a silent server")
        assert "\n" not in str(raised.value)


class TestTimerScheduler:
    async def test_a_due_time_past_year_9999_is_a_validation_error(
        self, broker: NatsBroker
    ) -> None:
        """The last microsecond of 9999 cannot be rounded up: ValidationError, nothing sent."""
        client = TimerClient(broker)
        with pytest.raises(InvalidTimestamp, match="9999-12-31"):
            await client.schedule("tenant-a", "call-1", LAST_MICROSECOND)
        assert await read_stream(broker.jetstream, "TIMER_COMMANDS") == []

    async def test_timer_client_schedules_through_the_protocol(self, broker: NatsBroker) -> None:
        """Host code typed on TimerScheduler publishes its commands through TimerClient."""

        async def place_order(timers: TimerScheduler) -> EnvelopeId:
            await timers.schedule("shop-1", "order-1", datetime(2030, 1, 1, tzinfo=UTC))
            return await timers.cancel("shop-1", "order-1", causation_id="paid")

        cancel_id = await place_order(TimerClient(broker))
        held = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert [message.json()["type"] for message in held] == ["ScheduleTimer", "CancelTimer"]
        assert held[1].json()["id"] == cancel_id

    def test_both_clients_satisfy_the_protocol_for_mypy(self, tmp_path: Path) -> None:
        """mypy --strict accepts TimerClient and MemoryTimerClient as a TimerScheduler, and
        rejects a class whose schedule lacks the protocol's parameters (the check can fail)."""
        module = tmp_path / "scheduler_check.py"
        module.write_text(
            textwrap.dedent(
                """
                from datetime import datetime

                from timer_adapters_memory import MemoryTimerClient
                from timer_adapters_nats import TimerClient
                from timer_core import EnvelopeId, TimerScheduler


                class TooSimple:
                    async def schedule(self, tenant_id: str, due_at: datetime) -> EnvelopeId:
                        raise NotImplementedError

                    async def cancel(self, tenant_id: str, service_call_id: str) -> EnvelopeId:
                        raise NotImplementedError


                def accepted(nats: TimerClient, memory: MemoryTimerClient) -> None:
                    first: TimerScheduler = nats
                    second: TimerScheduler = memory


                def refused(other: TooSimple) -> None:
                    third: TimerScheduler = other
                """
            )
        )
        result = subprocess.run(
            [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(module)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        errors = [line for line in result.stdout.splitlines() if ": error:" in line]
        assert len(errors) == 1, result.stdout + result.stderr
        assert '"TooSimple", variable has type "TimerScheduler"' in errors[0]
