"""The workers' one way to wait: on the clock, cut short by an event."""

from __future__ import annotations

import asyncio

from timer_core.ports import Clock

__all__ = ["sleep_unless"]


async def sleep_unless(
    clock: Clock, seconds: float, interrupt: asyncio.Event, *, stop: asyncio.Event
) -> None:
    """Sleep ``seconds`` on ``clock``, or less once ``interrupt`` is set; only a yield when
    there is nothing to wait for or ``stop`` is already set."""
    if seconds <= 0 or stop.is_set():
        await asyncio.sleep(0)
        return
    waits: set[asyncio.Future[object]] = {
        asyncio.ensure_future(clock.sleep(seconds)),
        asyncio.ensure_future(interrupt.wait()),
    }
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
