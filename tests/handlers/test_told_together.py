"""A per-timer handler's calls that end on one turn of the event loop are told to the
pipeline together (one step for their bookkeeping), a failure at once, and a slow call holds
back no other's outcome."""

from __future__ import annotations

import asyncio

from tests.handlers.test_eager_start import Event, envelopes
from timer_core import HandlerSettings, PublishError
from timer_core.handlers import handler_delivery


class ToldTogether:
    """A ``done`` that takes handled calls several at a time, as the pipeline's does."""

    def __init__(self) -> None:
        self.tellings: list[list[int]] = []
        self.results: dict[int, PublishError | None] = {}

    def __call__(self, index: int, error: PublishError | None) -> None:
        assert index not in self.results, f"call {index} told twice"
        self.tellings.append([index])
        self.results[index] = error

    def delivered(self, indices: list[int]) -> None:
        for index in indices:
            assert index not in self.results, f"call {index} told twice"
            self.results[index] = None
        self.tellings.append(list(indices))


async def test_calls_that_end_together_are_told_in_one_step() -> None:
    """Fifty calls that return at once: all fifty handled, told in one telling."""

    async def handler(event: Event) -> None:
        return None

    delivery = handler_delivery(handler, None, HandlerSettings())
    told = ToldTogether()
    delivery.start(envelopes(50), told)
    await delivery.aclose()
    assert told.results == dict.fromkeys(range(50))
    assert told.tellings == [list(range(50))]


async def test_a_failure_is_told_at_once_beside_the_handled() -> None:
    """One call of ten raises: its failure is told on its own, the nine others together."""

    async def handler(event: Event) -> None:
        if event.payload.service_call_id == "order-3":
            raise RuntimeError("refused")

    delivery = handler_delivery(handler, None, HandlerSettings())
    told = ToldTogether()
    delivery.start(envelopes(10), told)
    await delivery.aclose()
    assert "RuntimeError: refused" in str(told.results[3])
    assert sorted(told.tellings) == [[0, 1, 2, 4, 5, 6, 7, 8, 9], [3]]


async def test_a_slow_call_holds_back_no_other_outcome() -> None:
    """Nine calls return at once and one waits: the nine are told on the turn they end,
    while the tenth still runs; the tenth is told when it returns."""
    release = asyncio.Event()

    async def handler(event: Event) -> None:
        if event.payload.service_call_id == "order-0":
            await release.wait()

    delivery = handler_delivery(handler, None, HandlerSettings())
    told = ToldTogether()
    delivery.start(envelopes(10), told)
    for _ in range(5):
        await asyncio.sleep(0)
    assert told.results == dict.fromkeys(range(1, 10))
    release.set()
    await delivery.aclose()
    assert told.results == dict.fromkeys(range(10))
    assert told.tellings == [list(range(1, 10)), [0]]
