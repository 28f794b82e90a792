"""The host's own function as the way out, no broker: the handler deliveries of the firing
pipeline.

``Timer(store, handler=on_due)`` calls ``on_due`` with each due timer's ``DueTimeReached``
(a coroutine function on the event loop, any other callable in a thread; what a call
returns that can be awaited is awaited), ``Timer(store, batch_handler=on_due_batch)`` with
the timers found due together. A call that returns marks its timer ``Reached``; one that
raises or outlives :attr:`HandlerSettings.timeout_s` (counted from the call's start) leaves
it ``Scheduled`` for a retry. Each is a :class:`~timer_core.delivery.Delivery`: the pipeline
finds, claims, shares among tenants, retries and marks, as it does for a broker.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias

import attrs

from timer_core._checks import field_check, require_count, require_fraction, require_seconds
from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core.delivery import Delivery, Outcome
from timer_core.errors import ConfigurationError, HandlerFailed
from timer_core.ports import tell_delivered, tell_results

__all__ = [
    "DueTimeBatchHandler",
    "DueTimeHandler",
    "HandlerCalls",
    "HandlerSettings",
    "handler_delivery",
]

log = logging.getLogger(__name__)

Event: TypeAlias = MessageEnvelope[DueTimeReached]

#: The host's handler: called with each ``DueTimeReached`` envelope; a coroutine function is
#: awaited on the event loop, a plain function runs in a thread (and what it returns that
#: can be awaited, a coroutine, is awaited on the loop). Returning means "handled": the timer
#: is then marked ``Reached``. Raising (or outliving the timeout) means "not yet".
DueTimeHandler: TypeAlias = Callable[[Event], Awaitable[None] | None]

#: The host's batch handler: called with the due timers found together (at most the
#: Timer's ``batch_size``, 1,000 unless given), awaited on the event loop, up to
#: ``HandlerSettings.max_concurrency`` calls at once. It returns None (every
#: one handled) or one outcome per envelope, in order: None for handled, an exception for
#: "not yet" (that timer alone is retried). Raising or timing out fails the whole call.
DueTimeBatchHandler: TypeAlias = Callable[
    [Sequence[Event]], Awaitable[Sequence[BaseException | None] | None]
]


#: The Timer's ``batch_size`` with a batch handler, unless given: a call's cost is the
#: handler's own per call, so it gets the hand-written loop's pages of a thousand (a per-timer
#: handler or a broker gets 100).
BATCH_HANDLER_BATCH_SIZE = 1000


_COUNT = field_check(require_count)
_SECONDS = field_check(require_seconds)


@attrs.frozen
class HandlerSettings:
    """How a :class:`~timer_core.Timer` calls its handler. Times are in seconds."""

    max_concurrency: int = attrs.field(default=100, validator=_COUNT)
    """Most handler calls running at once (a sync handler's thread pool has as many; a
    batch handler's calls take up to the Timer's ``batch_size`` timers each)."""
    timeout_s: float = attrs.field(default=60.0, validator=_SECONDS)
    """A call still running this long after it started counts as failed and is retried: an
    async one is cancelled; a thread cannot be, so a timed-out threaded call keeps its
    place, and its timer, until it returns (the timer is retried after that)."""
    max_attempts: int = attrs.field(default=10, validator=_COUNT)
    """Failed calls of one timer before it is quarantined (listed, left out until retried)."""
    retry_delay_s: float = attrs.field(default=1.0, validator=_SECONDS)
    """Delay before the second attempt; it doubles with each failure."""
    max_retry_delay_s: float = attrs.field(default=300.0, validator=_SECONDS)
    """Cap of the doubling delay."""
    jitter: float = attrs.field(default=0.5, validator=field_check(require_fraction))
    """Up to this fraction of each delay is taken off at random, so timers that failed
    together (a dependency down) are not all retried at the same moment."""
    shutdown_grace_s: float = attrs.field(default=10.0, validator=_SECONDS)
    """On close, how long calls in flight may finish; the rest are cancelled, stay
    ``Scheduled`` and are delivered again after the restart."""

    def retry_delay(self, failures: int, draw: float) -> float:
        """The delay after ``failures`` failed calls; ``draw`` in [0, 1) takes off jitter."""
        doubled = self.retry_delay_s * 2 ** min(failures - 1, 30)
        return float(min(self.max_retry_delay_s, doubled) * (1 - self.jitter * draw))


def _name(envelope: Event) -> str:
    return f"{envelope.payload.tenant_id}/{envelope.payload.service_call_id}"


def _failure(envelope: Event, why: str, cause: BaseException | None = None) -> HandlerFailed:
    failure = HandlerFailed(f"the handler of {_name(envelope)} failed: {why}")
    failure.__cause__ = cause
    return failure


def _raised(envelope: Event, exc: BaseException) -> HandlerFailed:
    return _failure(envelope, f"{type(exc).__name__}: {exc}", exc)


def _eager_task(
    call: Coroutine[Any, Any, None], loop: asyncio.AbstractEventLoop
) -> asyncio.Task[None]:
    """Python 3.12+ (:attr:`HandlerCalls.eager_start`): a real task, not a hand-rolled first
    send(): current_task(), asyncio.timeout, a cancellation and the call's copy of the
    context are the task's from the first line, as they are when it is scheduled."""
    return asyncio.Task(call, loop=loop, eager_start=True)  # type: ignore[call-arg,unused-ignore]


def _reraise(exc: BaseException) -> None:
    raise exc


class _Started:
    """The calls one :meth:`HandlerCalls.start` began: their tasks, how many still run, the
    deadline they share where the delivery's calls begin together, and those handled whose
    outcome is not told yet (told together: calls that end on one turn of the loop are told
    on it, in one step)."""

    __slots__ = ("deadline", "done", "flushing", "handled", "left", "tasks", "timed_out")

    def __init__(self, count: int, done: Outcome) -> None:
        self.tasks: list[asyncio.Future[None] | None] = []
        self.left = count
        self.deadline: asyncio.TimerHandle | None = None
        self.timed_out = False
        self.done = done
        self.handled: list[int] = []
        self.flushing = False

    def flush(self) -> None:
        """Tell the calls handled since the last telling."""
        self.flushing = False
        handled, self.handled = self.handled, []
        if handled:
            tell_delivered(self.done, handled)


class HandlerCalls(Delivery):
    """The host's function called in tasks of the pipeline's: at most
    ``settings.max_concurrency`` timers at once; on :meth:`aclose` the calls under way get
    ``shutdown_grace_s`` and the rest are cancelled (their timers stay ``Scheduled``)."""

    eager_start: bool = sys.version_info >= (3, 12)
    """Whether a call's task starts eagerly (Python 3.12+, and no task factory of the
    host's): its first step runs at once, in its own task and context, so a call that
    returns without waiting is done before :meth:`start` returns and is never scheduled.
    What a handler can see is the same either way (``python -m timer_bench handlers-pythons``
    turns it off to measure what it saves)."""

    #: Whether the calls one :meth:`start` hands out share one deadline: they begin together,
    #: on the loop's next turn (an async handler's), so ``timeout_s`` after that turn is
    #: ``timeout_s`` after each call's start; one timer handle a find rather than one a call.
    shares_deadline = False

    def __init__(self, handler: Callable[..., Any], settings: HandlerSettings) -> None:
        self._handler = handler
        self.settings = settings
        self.places = settings.max_concurrency
        self._calls: set[asyncio.Future[None]] = set()
        self._closing = False

    def _run(self, call: Coroutine[Any, Any, None]) -> asyncio.Future[None] | None:
        """Start one handler call: the one place a call's task is made. It stays in
        ``_calls`` (what :meth:`aclose` waits for) until it ends; None when its eager
        first step raised what stops the loop."""
        loop = asyncio.get_running_loop()
        task: asyncio.Future[None]
        if loop.get_task_factory() is not None:
            task = loop.create_task(call)  # the host's factory makes it, eager or not
        elif self.eager_start:
            try:
                task = _eager_task(call, loop)
            except (KeyboardInterrupt, SystemExit) as exc:
                # A first step that raised one of these: the loop raises it, as it does
                # from any task's step, rather than the pipeline's hand-out (whose worker
                # would wind down first); the calls after it start as plain tasks, behind
                # it, so none of them runs before the loop stops (as on Python 3.11).
                self.eager_start = False
                loop.call_soon(_reraise, exc)
                return None
        else:
            # The loop's own task type, made directly (a fifth of a call's cost).
            task = asyncio.Task(call, loop=loop)
        if not task.done():  # an eager start may have run it to its end
            self._calls.add(task)
        return task

    def _cut_off(self, envelope: Event) -> HandlerFailed:
        return _failure(envelope, "cancelled by the shutdown")

    def _timed_out(self, envelope: Event, cause: BaseException | None = None) -> HandlerFailed:
        return _failure(envelope, f"timed out after {self.settings.timeout_s:g}s", cause)

    def start(self, envelopes: Sequence[Event], done: Outcome) -> None:
        started = _Started(len(envelopes), done)
        tasks = started.tasks
        for index, envelope in enumerate(envelopes):
            tasks.append(self._run(self._told(index, envelope, done, started)))

    async def _told(self, index: int, envelope: Event, done: Outcome, started: _Started) -> None:
        """One timer's call (:meth:`_call`), its outcome told to ``done``: a timeout, a
        shutdown's cut or the handler's exception is that timer's failure alone."""
        if self.shares_deadline and started.deadline is None:
            # The first of the calls to begin: the others begin on this same turn.
            started.deadline = asyncio.get_running_loop().call_later(
                self.settings.timeout_s, _time_out, started
            )
        try:
            await self._call(envelope)
        except TimeoutError as exc:
            done(index, self._timed_out(envelope, exc))
        except asyncio.CancelledError:
            if started.timed_out and not self._closing:
                done(index, self._timed_out(envelope))
                return
            done(index, self._cut_off(envelope))
            raise
        except Exception as exc:
            done(index, _raised(envelope, exc))
        else:
            started.handled.append(index)
        finally:
            # Not yet listed when it ran eagerly to its end (nor then in the calls' set).
            task = started.tasks[index] if index < len(started.tasks) else None
            if task is not None:
                self._calls.discard(task)
            started.left -= 1
            if started.left == 0:
                if started.deadline is not None:
                    started.deadline.cancel()
                started.flush()  # the last call: every handled one is told now
            elif started.handled and not started.flushing:
                # Others still run: those handled on this turn are told at its end.
                started.flushing = True
                asyncio.get_running_loop().call_soon(started.flush)

    def _call(self, envelope: Event) -> Awaitable[None]:
        """Call the handler with one timer's envelope: what to await; it raises TimeoutError
        past the timeout (or is cancelled at the shared deadline). Deliveries of one call per
        timer override it (a batch's overrides :meth:`start`)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        self._closing = True
        calls = set(self._calls)
        if not calls:
            return
        grace = self.settings.shutdown_grace_s
        log.info("waiting up to %gs for %d handler calls", grace, len(calls))
        _, late = await asyncio.wait(calls, timeout=grace)
        if late:
            log.warning(
                "%d handler calls did not finish within %gs of the shutdown; they stay "
                "Scheduled and are delivered again",
                len(late),
                grace,
            )
            for task in late:
                task.cancel()
            await asyncio.wait(late)


def _time_out(started: _Started) -> None:
    """The shared deadline: every call of ``started`` still running is cancelled, and
    counts as timed out."""
    started.timed_out = True
    for task in started.tasks:
        if task is not None and not task.done():
            task.cancel()


class _AsyncCalls(HandlerCalls):
    """A coroutine function, awaited on the event loop, cancelled at its timeout (the
    deadline its find's calls share: they all begin on one turn of the loop)."""

    shares_deadline = True

    def _call(self, envelope: Event) -> Awaitable[None]:
        call: Awaitable[None] = self._handler(envelope)
        return call  # awaited by the call's task itself: no frame between


class _ThreadCalls(HandlerCalls):
    """Any other callable, called in a thread of a pool of ``max_concurrency`` threads (one
    per place, so a call never waits for a thread); an awaitable it returns is awaited on the
    loop, within what is left of the timeout."""

    _executor: ThreadPoolExecutor | None = None

    async def _call(self, envelope: Event) -> None:
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.places, thread_name_prefix="timer-handler")
        context = contextvars.copy_context()
        started: asyncio.Future[float] = loop.create_future()

        def call() -> object:
            loop.call_soon_threadsafe(_started, started, loop)
            return context.run(self._handler, envelope)

        running = loop.run_in_executor(self._executor, call)
        timeout = self.settings.timeout_s
        try:
            # The timeout counts from the call's start in its thread, not from a wait for one.
            await asyncio.wait((started, running), return_when=asyncio.FIRST_COMPLETED)
            begun = started.result() if started.done() else loop.time()
            await asyncio.wait((running,), timeout=max(0.0, begun + timeout - loop.time()))
            if not running.done():
                log.warning(
                    "the handler of %s is still running %gs after it started; its thread "
                    "cannot be stopped, so the timer waits for it to return before a retry",
                    _name(envelope),
                    timeout,
                )
                await asyncio.wait((running,))
                raise TimeoutError
            result = running.result()
            if inspect.isawaitable(result):
                # A plain function that returned a coroutine (a lambda around an async
                # function): its work is that coroutine, run here, never dropped.
                async with asyncio.timeout(max(0.0, begun + timeout - loop.time())):
                    await result
        except asyncio.CancelledError:
            if not running.done():
                # Cut off by the shutdown: the thread runs on, its result unused.
                running.add_done_callback(_retrieve)
            raise

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)


class _BatchCalls(HandlerCalls):
    """A batch handler: one call per batch the pipeline found (up to ``per_call`` timers),
    each timer's own outcome; ``settings.max_concurrency`` calls at once."""

    def __init__(
        self, handler: DueTimeBatchHandler, settings: HandlerSettings, per_call: int
    ) -> None:
        super().__init__(handler, settings)
        self.places = settings.max_concurrency * per_call

    def start(self, envelopes: Sequence[Event], done: Outcome) -> None:
        task = self._run(self._call_batch(envelopes, done))
        if task is not None and not task.done():
            task.add_done_callback(self._calls.discard)

    async def _call_batch(self, envelopes: Sequence[Event], done: Outcome) -> None:
        timeout = self.settings.timeout_s
        try:
            async with asyncio.timeout(timeout):
                outcomes = await self._handler(envelopes)
        except TimeoutError as exc:
            tell_results(done, [self._timed_out(envelope, exc) for envelope in envelopes])
            return
        except asyncio.CancelledError:
            tell_results(done, [self._cut_off(envelope) for envelope in envelopes])
            raise
        except Exception as exc:
            tell_results(done, [_raised(envelope, exc) for envelope in envelopes])
            return
        if outcomes is None:
            tell_delivered(done, range(len(envelopes)))
            return
        if len(outcomes) != len(envelopes):
            wrong = ValueError(
                f"the batch handler returned {len(outcomes)} outcomes for {len(envelopes)} "
                "timers; it must return None or one outcome per timer, in order"
            )
            tell_results(done, [_raised(envelope, wrong) for envelope in envelopes])
            return
        tell_results(
            done,
            [
                None if outcome is None else _raised(envelope, outcome)
                for envelope, outcome in zip(envelopes, outcomes, strict=True)
            ],
        )


def _started(started: asyncio.Future[float], loop: asyncio.AbstractEventLoop) -> None:
    if not started.done():
        started.set_result(loop.time())


def _retrieve(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()


def _is_coroutine_function(handler: object) -> bool:
    if isinstance(handler, functools.partial):
        return _is_coroutine_function(handler.func)
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 (an object with an async __call__)
    )


def handler_settings(settings: object) -> HandlerSettings:
    """``settings`` as given to the Timer, refused unless it is a :class:`HandlerSettings`."""
    if settings is None:
        return HandlerSettings()
    if not isinstance(settings, HandlerSettings):
        shown = f"{type(settings).__name__} {settings!r}"[:200]
        hint = (
            f"HandlerSettings(**{settings!r})"
            if isinstance(settings, dict)
            else "HandlerSettings(...)"
        )
        raise ConfigurationError(
            f"Timer's handler_settings must be a HandlerSettings, e.g. {hint}; got {shown}"
        )
    return settings


def handler_delivery(
    handler: DueTimeHandler | None,
    batch_handler: DueTimeBatchHandler | None,
    settings: HandlerSettings,
    *,
    batch_size: int = BATCH_HANDLER_BATCH_SIZE,
) -> HandlerCalls:
    """The delivery that calls the host's ``handler`` (or ``batch_handler``, with up to
    ``batch_size`` timers a call) with ``settings``."""
    if batch_handler is not None:
        if not _is_coroutine_function(batch_handler):
            raise ConfigurationError(
                "Timer's batch_handler must be a coroutine function (async def) taking a "
                f"sequence of DueTimeReached envelopes; got {type(batch_handler).__name__} "
                f"{batch_handler!r}"[:300]
            )
        return _BatchCalls(batch_handler, settings, batch_size)
    assert handler is not None
    if _is_coroutine_function(handler):
        return _AsyncCalls(handler, settings)
    return _ThreadCalls(handler, settings)
