"""One publish that JetStream never acknowledges, through a ``Timer`` on a real nats-server:
the other tenants' timers are published and marked while its acknowledgement is awaited."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from nats.aio.msg import Msg

from tests.timer_adapters_nats.jetstream import read_stream, wait_until
from timer_adapters_nats import NatsBroker, NatsSettings
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import Timer, TimerState

#: Longer than the test may take: only a result told before its ack timeout can pass.
ACK_TIMEOUT_S = 120.0
#: How long the test waits for the others (a busy 2-core machine included).
BUDGET_S = 60.0
TENANTS = [f"tenant-{t}" for t in range(6)]


class SilentStream:
    """The poison tenant's event subject taken out of TIMER_EVENTS and read by a plain
    subscriber that does not answer: a publish there is never acknowledged (no stream, and no
    "no responders" either) until :meth:`answer` refuses it."""

    def __init__(self) -> None:
        self.held: list[Msg] = []

    async def install(self, broker: NatsBroker, poison_tenant: str) -> None:
        js = broker.jetstream
        config = (await js.stream_info(broker.settings.events_stream)).config
        prefix = broker.settings.subject_prefix
        config.subjects = [f"{prefix}.events.{tenant}.*" for tenant in TENANTS]
        await js.update_stream(config)

        async def hold(msg: Msg) -> None:
            self.held.append(msg)

        await broker.client.subscribe(f"{prefix}.events.{poison_tenant}.*", cb=hold)
        await broker.client.flush()

    async def answer(self, broker: NatsBroker) -> None:
        """Refuse every held publish (so the Timer's shutdown need not wait out the ack)."""
        refusal = json.dumps({"error": {"code": 503, "description": "released by the test"}})
        for msg in self.held:
            assert msg.reply
            await broker.client.publish(msg.reply, refusal.encode())
        await broker.client.flush()


class TestUnacknowledgedPublish:
    async def test_holds_back_no_other_timer(self, nats_url: str, tmp_path: Path) -> None:
        """The poison timer is due with five others in one batch and 60 more follow over a
        second: all 65 are published and marked Reached while the poison one's
        acknowledgement is still awaited (its ack timeout is longer than the test)."""
        settings = NatsSettings(url=nats_url, ack_timeout_s=ACK_TIMEOUT_S)
        silent = SilentStream()
        async with NatsBroker(settings) as broker:
            await silent.install(broker, "poison")
            async with Timer(SqliteTimerStore(tmp_path / "timers.db"), broker.publisher) as timer:
                start = timer.clock.now() + timedelta(milliseconds=300)
                others = [(tenant, "together") for tenant in TENANTS[:5]]
                others += [(TENANTS[n % 6], f"call-{n}") for n in range(60)]
                await timer.schedule("poison", "held", start)
                for n, (tenant, call) in enumerate(others):
                    due = start if call == "together" else start + timedelta(milliseconds=20 * n)
                    await timer.schedule(tenant, call, due)
                try:

                    async def all_reached() -> bool:
                        for tenant, call in others:
                            entry = await timer.get(tenant, call)
                            if entry is None or entry.state is not TimerState.REACHED:
                                return False
                        return True

                    await wait_until(all_reached, within=BUDGET_S, what="the others Reached")
                    assert len(silent.held) == 1  # published once, still unacknowledged
                    poison = await timer.get("poison", "held")
                    assert poison is not None and poison.state is TimerState.SCHEDULED
                    held = await read_stream(broker.jetstream, settings.events_stream)
                    assert len(held) == len(others)
                finally:
                    await silent.answer(broker)
