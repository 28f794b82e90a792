"""SyncTimerClient: TimerClient's calls from synchronous code, against a real nats-server."""

from __future__ import annotations

import asyncio
import inspect
import threading
from datetime import UTC, datetime, timedelta

import pytest

from tests.ports import refused_port
from tests.timer_adapters_nats.jetstream import read_stream
from timer_adapters_nats import (
    BrokerUnavailable,
    NatsBroker,
    SyncTimerClient,
    TimerClient,
)
from timer_core import InvalidIdentifier, NotRunning
from timer_core.codec import decode_command

DUE = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)


class TestSyncClient:
    async def test_schedule_and_cancel_block_until_acked(self, broker: NatsBroker) -> None:
        """From a plain thread, schedule and cancel return once the commands are in the stream."""
        url = broker.settings.url

        def host() -> tuple[str, str]:
            with SyncTimerClient.connect(url) as timers:
                scheduled = timers.schedule("shop-1", "order-1", DUE, correlation_id="req-1")
                cancelled = timers.cancel("shop-1", "order-1")
            return scheduled, cancelled

        scheduled, cancelled = await asyncio.to_thread(host)
        held = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        commands = [decode_command(message.data) for message in held]
        assert [c.id for c in commands] == [scheduled, cancelled]
        assert commands[0].correlation_id == "req-1"
        assert commands[0].payload.due_at == DUE

    async def test_threads_share_one_client(self, broker: NatsBroker) -> None:
        """Eight threads scheduling through one client all get their commands acked."""
        url = broker.settings.url

        def host() -> None:
            timers = SyncTimerClient.connect(url)
            try:
                workers = [
                    threading.Thread(
                        target=timers.schedule,
                        args=("shop-1", f"order-{n}", DUE + timedelta(minutes=n)),
                    )
                    for n in range(8)
                ]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
                errors = timers.send_many([timers.cancel_envelope("shop-1", "order-0")])
                assert errors == [None]
            finally:
                timers.close()
                timers.close()  # idempotent

        await asyncio.to_thread(host)
        assert len(await read_stream(broker.jetstream, "TIMER_COMMANDS")) == 9

    async def test_bad_input_and_a_closed_client_fail_clearly(self, broker: NatsBroker) -> None:
        """Invalid ids raise before sending; a closed client raises NotRunning."""
        url = broker.settings.url

        def host() -> None:
            timers = SyncTimerClient.connect(url)
            with pytest.raises(InvalidIdentifier):
                timers.schedule("shop 1", "order-1", DUE)
            timers.close()
            with pytest.raises(NotRunning, match="closed"):
                timers.schedule("shop-1", "order-1", DUE)

        await asyncio.to_thread(host)

    def test_an_unreachable_server_raises_broker_unavailable(self) -> None:
        """Connecting to a port nobody listens on fails within the connect timeout."""
        with refused_port() as port, pytest.raises(BrokerUnavailable):
            SyncTimerClient.connect(f"nats://127.0.0.1:{port}", connect_timeout_s=0.5)
        leftover = [t for t in threading.enumerate() if t.name == "timer-client"]
        assert leftover == []

    def test_it_has_every_call_of_timer_client(self) -> None:
        """Each public call of TimerClient is on SyncTimerClient with the same parameters."""
        for name, member in inspect.getmembers(TimerClient):
            if name.startswith("_") or not callable(member):
                continue
            ours = inspect.signature(getattr(SyncTimerClient, name))
            assert list(ours.parameters) == list(inspect.signature(member).parameters), name
