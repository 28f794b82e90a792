"""What both broker-less synchronous clients promise (``SqliteTimerClient``,
``PostgresTimerClient``), written once and bound by each store's tests with three hooks."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from timer_core import (
    CommandOutcome,
    DueTimeReached,
    MessageEnvelope,
    Timer,
    TimerState,
    TimerStore,
    ValidationError,
)


class SyncClientContract:
    """Bind with a ``location`` fixture (the database), ``open_client(location)`` and
    ``store(location)`` (the store a firing ``Timer`` runs on)."""

    def open_client(self, location: str) -> Any:
        raise NotImplementedError

    def store(self, location: str) -> TimerStore:
        raise NotImplementedError

    async def test_a_scheduled_timer_fires_and_a_cancelled_one_does_not(
        self, location: str
    ) -> None:
        """Scheduled from another thread while a Timer with a handler runs on the database
        (polling once a minute), a timer fires within seconds: the commit woke the Timer.
        One cancelled before its due time never fires; once fired, a timer is neither
        re-armed nor cancelled."""
        fired: list[str] = []
        kept_fired = asyncio.Event()

        async def handler(event: MessageEnvelope[DueTimeReached]) -> None:
            fired.append(event.payload.service_call_id)
            if event.payload.service_call_id == "kept":
                kept_fired.set()

        async with Timer(self.store(location), handler=handler, polling_interval=60.0) as timer:
            client = await asyncio.to_thread(self.open_client, location)
            try:
                due = datetime.now(UTC) + timedelta(milliseconds=300)
                for call in ("dropped", "kept"):
                    outcome = await asyncio.to_thread(
                        client.schedule, "shop", call, due, correlation_id=f"order-{call}"
                    )
                    assert outcome is CommandOutcome.SCHEDULED
                cancelled = await asyncio.to_thread(client.cancel, "shop", "dropped")
                assert cancelled is CommandOutcome.CANCELLED
                await asyncio.wait_for(kept_fired.wait(), timeout=20)
                deadline = asyncio.get_running_loop().time() + 20
                while (entry := await timer.get("shop", "kept")) is None or (
                    entry.state is not TimerState.REACHED
                ):
                    assert asyncio.get_running_loop().time() < deadline, "never marked Reached"
                    await asyncio.sleep(0.02)
                assert entry.correlation_id == "order-kept"
                later = due + timedelta(hours=1)
                again = await asyncio.to_thread(client.schedule, "shop", "kept", later)
                assert again is CommandOutcome.IGNORED_REACHED
                assert await asyncio.to_thread(client.cancel, "shop", "kept") is (
                    CommandOutcome.CANCEL_NOOP
                )
                assert await asyncio.to_thread(client.cancel, "shop", "dropped") is (
                    CommandOutcome.CANCEL_NOOP
                )
            finally:
                await asyncio.to_thread(client.close)
        assert fired == ["kept"]

    async def test_bad_arguments_are_refused_before_anything_is_written(
        self, location: str
    ) -> None:
        """A naive due time, a tenant id with a space and an empty service call id each
        raise ValidationError, and no timer is stored."""
        client = await asyncio.to_thread(self.open_client, location)
        try:
            aware = datetime.now(UTC) + timedelta(hours=1)
            for call in (
                lambda: client.schedule("shop", "t-1", datetime(2030, 1, 1)),
                lambda: client.schedule("bad tenant", "t-1", aware),
                lambda: client.cancel("shop", ""),
            ):
                with pytest.raises(ValidationError):
                    await asyncio.to_thread(call)
        finally:
            await asyncio.to_thread(client.close)
        async with self.store(location) as store:
            assert await store.list_for_tenant("shop") == []
