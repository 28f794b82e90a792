"""The handler path on PostgreSQL: instances share the due timers under the store's leases."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime

from timer_adapters_postgres import PostgresTimerStore
from timer_core import DueTimeReached, HandlerSettings, MessageEnvelope, Timer, TimerEntry

Event = MessageEnvelope[DueTimeReached]


class TestSharedWork:
    async def test_two_instances_share_the_timers_each_handled_once(
        self, fresh_postgres_url: str
    ) -> None:
        """Two hosts on one database hand out every due timer once between them, both busy."""
        calls: Counter[str] = Counter()
        by_instance: Counter[str] = Counter()
        both = asyncio.Event()

        def handler_of(name: str) -> object:
            async def handler(event: Event) -> None:
                by_instance[name] += 1
                if len(by_instance) == 2:
                    both.set()
                # Each instance's first calls hold its places until the other has calls
                # too, however late it started on a busy machine: both take part.
                await asyncio.wait_for(both.wait(), 60)
                await asyncio.sleep(0.005)
                calls[event.payload.service_call_id] += 1

            return handler

        now = datetime.now(UTC)
        wanted = [f"order-{n}" for n in range(200)]
        settings = HandlerSettings(max_concurrency=8)
        async with PostgresTimerStore(fresh_postgres_url, pool_size=2) as seed:
            await seed.apply(
                [TimerEntry(f"shop-{n % 4}", call, now, now) for n, call in enumerate(wanted)]
            )
        async with (
            Timer(
                PostgresTimerStore(fresh_postgres_url, pool_size=2, owner_id="a"),
                handler=handler_of("a"),  # type: ignore[arg-type]
                handler_settings=settings,
            ),
            Timer(
                PostgresTimerStore(fresh_postgres_url, pool_size=2, owner_id="b"),
                handler=handler_of("b"),  # type: ignore[arg-type]
                handler_settings=settings,
            ) as second,
        ):
            deadline = time.monotonic() + 60
            while await second.store.count_scheduled():
                assert time.monotonic() < deadline, f"{sum(calls.values())} handled in 60 s"
                await asyncio.sleep(0.05)
        assert set(calls) == set(wanted)
        assert max(calls.values()) == 1  # the leases kept each timer to one instance
        assert by_instance["a"] > 0 and by_instance["b"] > 0
