"""The composition root builds without I/O; the service it builds surfaces a failed part."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest

from timer_adapters_memory import MemoryEventBus, MemoryTimerStore
from timer_adapters_nats import NatsBroker
from timer_adapters_postgres import PostgresTimerStore
from timer_core import CommandBatchHandler, CommandSource, ComponentFailed, SystemClock, Timer
from timer_service.app import serve
from timer_service.bootstrap import bootstrap, nats_settings
from timer_service.metrics import PrometheusInstrumentation
from timer_service.service import TimerService
from timer_service.settings import Settings


class DyingSource(CommandSource):
    """A command source whose loop dies at once, as one whose consumer was deleted would."""

    async def run(self, handler: CommandBatchHandler) -> None:
        raise RuntimeError("consumer timer-service was deleted")

    async def stop(self) -> None:
        pass


class TestBootstrap:
    def test_builds_every_part_and_opens_nothing(self, tmp_path: Path) -> None:
        """bootstrap() makes the broker, the timer and the endpoint without touching a file,
        a socket or the broker."""
        db_path = tmp_path / "not-yet" / "timer.db"
        settings = Settings(db_path=db_path, broker_url="nats://127.0.0.1:4222")
        service = bootstrap(settings, "nats://127.0.0.1:4222")
        assert not db_path.parent.exists()
        assert not service.broker.is_connected
        assert service.broker_url == "nats://127.0.0.1:4222"
        health = service.timer.health()
        assert (health.running, health.components) == (False, {})
        assert service.health() == (
            False,
            {
                "last_poll_age_s": None,
                "broker_connected": False,
                "clock": "host",
                "clock_skew_s": None,
                "quarantined": 0,
                "oldest_quarantined_age_s": None,
            },
        )

    def test_on_postgresql_the_database_clock_decides(self) -> None:
        """With TIMER_DATABASE_URL the timer's clock is the store's database clock, told in
        /healthz and the start-up line, and TIMER_CLOCK_SKEW_WARNING reaches it; on SQLite
        this host's clock decides."""
        settings = Settings.from_environment(
            {
                "TIMER_DATABASE_URL": "postgresql://timer@127.0.0.1:1/timer",
                "TIMER_CLOCK_SKEW_WARNING": "250ms",
            }
        )
        service = bootstrap(settings, "nats://127.0.0.1:4222")
        store = service.timer.store
        assert isinstance(store, PostgresTimerStore)
        assert service.timer.clock is store.shared_clock()
        assert store.shared_clock()._skew_warning_s == 0.25
        assert (service.clock, service.clock_skew_s) == ("database", None)
        assert "the database's (shared by every instance)" in service.describe_clock()
        sqlite = bootstrap(Settings(), "nats://127.0.0.1:4222")
        assert isinstance(sqlite.timer.clock, SystemClock)
        assert "this host's" in sqlite.describe_clock()

    def test_defaults_keep_the_promises(self) -> None:
        """At the defaults SQLite syncs acknowledged commits (FULL) and the skew warning is
        at 1 s."""
        default = Settings.from_environment({})
        assert (default.sqlite_synchronous, default.clock_skew_warning_s) == ("FULL", 1.0)

    def test_command_fetch_has_its_own_setting(self) -> None:
        """The command consumer fetches TIMER_COMMAND_BATCH_SIZE (default 1000), not the
        firing batch."""
        default = Settings.from_environment({})
        assert (default.batch_size, default.command_batch_size) == (100, 1000)
        assert nats_settings(default, "nats://127.0.0.1:4222").fetch_batch == 1000
        tuned = Settings.from_environment(
            {"TIMER_BATCH_SIZE": "50", "TIMER_COMMAND_BATCH_SIZE": "250"}
        )
        assert nats_settings(tuned, "nats://127.0.0.1:4222").fetch_batch == 250


class TestFailedPart:
    async def test_run_raises_when_a_part_of_the_timer_dies(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """A command loop that dies ends run() with ComponentFailed, and /healthz turns 503."""
        settings = Settings(db_path=tmp_path / "timer.db", broker_url=nats_url, http_port=0)
        instrumentation = PrometheusInstrumentation()
        broker = NatsBroker(nats_settings(settings, nats_url), instrumentation=instrumentation)
        timer = Timer(MemoryTimerStore(), MemoryEventBus(), commands=DyingSource())
        service = TimerService(settings, broker, timer, instrumentation)
        async with service:
            with pytest.raises(ComponentFailed, match="consumer timer-service was deleted"):
                await asyncio.wait_for(service.run(asyncio.Event()), 10)
            healthy, _ = service.health()
        assert not healthy


class _Node:
    """An object that can sit in a reference cycle and be watched through a weak reference."""

    def __init__(self) -> None:
        self.me = self


class TestServe:
    async def test_the_started_heap_is_frozen_out_of_the_cyclic_collector(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """Once started, the service has frozen what it holds (gc.freeze), so the collector's
        full passes walk only what traffic makes; cyclic garbage is collected, not frozen."""
        settings = Settings(db_path=tmp_path / "timer.db", broker_url=nats_url, http_port=0)
        stop = asyncio.Event()
        seen: list[tuple[int, bool]] = []
        garbage = weakref.ref(_Node())  # only its own cycle keeps it

        def on_ready(service: TimerService) -> None:
            seen.append((gc.get_freeze_count(), garbage() is None))
            stop.set()

        gc.unfreeze()
        try:
            await asyncio.wait_for(serve(settings, stop, on_ready=on_ready), 30)
        finally:
            gc.unfreeze()
        ((frozen, collected),) = seen
        assert frozen > 1000
        assert collected
