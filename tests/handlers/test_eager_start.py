"""How a handler call starts: eagerly on Python 3.12+ (a call that finishes at once is done
before the pipeline's hand-out returns, and no task of its own is ever scheduled), as a plain
task on 3.11, and nothing a handler or its host can see differs between the two: the call's
own task and copy of the context from its first line, its timeouts and cancellation, an
exception out of its first step. Every test runs on every Python CI runs."""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from timer_adapters_memory import FakeClock, MemoryTimerStore
from timer_core import (
    DueTimeReached,
    HandlerSettings,
    Instrumentation,
    MessageEnvelope,
    PublishError,
    Timer,
    TimerEntry,
    TimerState,
)
from timer_core.events import due_events
from timer_core.handlers import HandlerCalls, handler_delivery
from timer_core.ports import Uuid7EnvelopeIds

T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
Event = MessageEnvelope[DueTimeReached]
#: Whether this Python starts tasks eagerly.
EAGER = sys.version_info >= (3, 12)
host_value: contextvars.ContextVar[str] = contextvars.ContextVar("host_value", default="unset")


def envelopes(count: int) -> list[Event]:
    entries = [TimerEntry("shop-1", f"order-{n}", T0, T0) for n in range(count)]
    return due_events(entries, T0, Uuid7EnvelopeIds())


async def returns_at_once(event: Event) -> None:
    """A handler whose call finishes without waiting (most do: a write to a queue, a log)."""


class Told:
    """The outcomes a delivery reports, in the order it reports them."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[int, PublishError | None]] = []

    def __call__(self, index: int, error: PublishError | None) -> None:
        self.outcomes.append((index, error))


class TestHowACallStarts:
    async def test_a_call_that_returns_at_once_needs_no_task_scheduled_on_3_12_and_later(
        self,
    ) -> None:
        """3.12+: every outcome is in when start() returns and no task is left; 3.11: the
        calls run in tasks of their own on the next turn of the loop."""
        delivery = handler_delivery(returns_at_once, None, HandlerSettings())
        assert delivery.eager_start is EAGER
        told = Told()
        before = len(asyncio.all_tasks())
        delivery.start(envelopes(3), told)
        if EAGER:
            assert told.outcomes == [(0, None), (1, None), (2, None)]
            assert len(asyncio.all_tasks()) == before
        else:
            assert told.outcomes == []
            assert len(asyncio.all_tasks()) == before + 3
        await asyncio.sleep(0)
        assert told.outcomes == [(0, None), (1, None), (2, None)]
        assert len(asyncio.all_tasks()) == before
        await delivery.aclose()

    async def test_without_eager_start_every_call_waits_for_its_task(self) -> None:
        """Turned off (as the benchmark does to measure it): plain tasks on every Python."""
        delivery = handler_delivery(returns_at_once, None, HandlerSettings())
        delivery.eager_start = False
        told = Told()
        delivery.start(envelopes(2), told)
        assert told.outcomes == []
        await asyncio.sleep(0)
        assert told.outcomes == [(0, None), (1, None)]
        await delivery.aclose()

    async def test_a_task_factory_of_the_hosts_makes_every_call_task(self) -> None:
        """A host that set its own task factory keeps it: it decides how calls start."""
        loop = asyncio.get_running_loop()
        made: list[asyncio.Task[Any]] = []

        def factory(
            loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
        ) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop, **kwargs)
            made.append(task)
            return task

        loop.set_task_factory(factory)  # type: ignore[arg-type]
        try:
            delivery = handler_delivery(returns_at_once, None, HandlerSettings())
            told = Told()
            delivery.start(envelopes(2), told)
            assert len(made) == 2
            await asyncio.sleep(0)
            assert told.outcomes == [(0, None), (1, None)]
            await delivery.aclose()
        finally:
            loop.set_task_factory(None)

    async def test_a_call_that_waits_is_left_running_and_awaited_on_close(self) -> None:
        """A call still running after its first step is a task like any other: the delivery
        holds it, and its close waits for it."""
        release = asyncio.Event()

        async def waits(event: Event) -> None:
            await release.wait()

        delivery = handler_delivery(waits, None, HandlerSettings())
        told = Told()
        delivery.start(envelopes(1), told)
        await asyncio.sleep(0)
        assert told.outcomes == []
        closing = asyncio.ensure_future(delivery.aclose())
        await asyncio.sleep(0)
        assert not closing.done()
        release.set()
        await closing
        assert told.outcomes == [(0, None)]


class Marked(Instrumentation):
    def __init__(self) -> None:
        self.marked: list[str] = []

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        self.marked.extend(entry.service_call_id for entry in entries)


class TestWhatAHandlerSees:
    """The same on every Python, eager or not."""

    async def test_each_call_runs_in_a_task_of_its_own_with_a_copy_of_the_hosts_context(
        self,
    ) -> None:
        seen: list[tuple[str, str, asyncio.Task[Any] | None]] = []

        async def handler(event: Event) -> None:
            seen.append((event.payload.service_call_id, host_value.get(), asyncio.current_task()))
            host_value.set(event.payload.service_call_id)  # its own copy: no one else sees it

        token = host_value.set("host")
        try:
            clock = FakeClock(T0)
            async with Timer(MemoryTimerStore(), handler=handler, clock=clock) as timer:
                for n in range(3):
                    await timer.schedule("shop-1", f"order-{n}", T0 + timedelta(seconds=1))
                await timer.wait_until_idle()
                clock.advance(1)
                await timer.wait_until_idle()
                assert host_value.get() == "host"
        finally:
            host_value.reset(token)
        assert [(call, value) for call, value, _ in seen] == [
            ("order-0", "host"),
            ("order-1", "host"),
            ("order-2", "host"),
        ]
        tasks = {task for _, _, task in seen}
        assert len(tasks) == 3 and asyncio.current_task() not in tasks

    async def test_a_timeout_inside_the_first_step_is_the_calls_own(self) -> None:
        """asyncio.timeout in the handler's first line cancels the call's task, never the
        worker that started it: the worker goes on handling timers."""
        outcomes: list[str] = []

        async def handler(event: Event) -> None:
            try:
                async with asyncio.timeout(0):
                    await asyncio.Event().wait()
            except TimeoutError:
                outcomes.append(f"{event.payload.service_call_id} timed out")

        clock = FakeClock(T0)
        async with Timer(MemoryTimerStore(), handler=handler, clock=clock) as timer:
            await timer.schedule("shop-1", "order-0", T0)
            await timer.wait_until_idle()
            await timer.schedule("shop-1", "order-1", T0)
            await timer.wait_until_idle()
            states = [(await timer.get("shop-1", f"order-{n}")) for n in range(2)]
        assert outcomes == ["order-0 timed out", "order-1 timed out"]
        assert all(s is not None and s.state is TimerState.REACHED for s in states)

    async def test_a_call_past_its_timeout_is_cancelled_and_retried(self) -> None:
        """A call that waits after an eager first step is cancelled at its timeout like any."""
        cancelled: list[str] = []

        async def handler(event: Event) -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(event.payload.service_call_id)
                raise

        settings = HandlerSettings(timeout_s=0.01, retry_delay_s=60, max_attempts=2)
        async with Timer(
            MemoryTimerStore(), handler=handler, handler_settings=settings, clock=FakeClock(T0)
        ) as timer:
            await timer.schedule("shop-1", "order-0", T0)
            await timer.wait_until_idle()
            stored = await timer.get("shop-1", "order-0")
        assert cancelled == ["order-0"]
        assert stored is not None and stored.state is TimerState.SCHEDULED

    def test_a_system_exit_from_a_first_step_stops_the_loop_before_anything_else_runs(
        self,
    ) -> None:
        """A handler that raises SystemExit at once: the loop stops with it, as from any
        task's step; the worker does not wind down first (nothing is marked), and the calls
        after it in the same batch never start."""
        calls: list[str] = []
        marks = Marked()
        clock = FakeClock(T0)

        async def handler(event: Event) -> None:
            calls.append(event.payload.service_call_id)
            if event.payload.service_call_id == "order-1":
                raise SystemExit(3)

        async def host() -> None:
            async with Timer(
                MemoryTimerStore(), handler=handler, clock=clock, instrumentation=marks
            ) as timer:
                for n in range(3):
                    await timer.schedule("shop-1", f"order-{n}", T0 + timedelta(seconds=1))
                await timer.wait_until_idle()
                clock.advance(1)  # the three are found due together: one batch
                await asyncio.Event().wait()

        loop = asyncio.new_event_loop()
        main = loop.create_task(host())
        try:
            with pytest.raises(SystemExit):
                loop.run_until_complete(main)
            assert calls == ["order-0", "order-1"]
            assert marks.marked == []
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.close()
        assert calls == ["order-0", "order-1"]  # order-2 was cut off before it started


def test_the_delivery_class_says_how_calls_start() -> None:
    assert HandlerCalls.eager_start is EAGER
