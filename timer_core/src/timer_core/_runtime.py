"""The runtime a host embeds: one object that starts, runs and stops the store, the publisher,
the worker and the command loop together, and the one place the worker hears of new timers."""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import weakref
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self

import attrs

from timer_core._checks import require_count
from timer_core._entry import TimerEntry, TimerKey
from timer_core._ids import ServiceCallId, TenantId
from timer_core._messages import CancelTimer, Command, MessageEnvelope, ScheduleTimer
from timer_core.commands import cancel_timer, handle_commands, schedule_timer
from timer_core.errors import (
    ComponentFailed,
    ConfigurationError,
    NotRunning,
    StoreInUse,
    ValidationError,
    WaitTimedOut,
)
from timer_core.handlers import (
    BATCH_HANDLER_BATCH_SIZE,
    DueTimeBatchHandler,
    DueTimeHandler,
    HandlerSettings,
    handler_delivery,
)
from timer_core.handlers import handler_settings as handler_settings_of
from timer_core.instrumentation import NO_INSTRUMENTATION, Instrumentation
from timer_core.ports import (
    AsyncResource,
    Clock,
    CommandOutcome,
    CommandSource,
    EnvelopeIdGenerator,
    EventPublisher,
    ExclusiveFiring,
    ReportsRemoteSchedules,
    SharedClockStore,
    SystemClock,
    TimerStore,
)
from timer_core.worker import QuarantinedTimer, TimerWorker

__all__ = ["Timer", "TimerHealth"]

log = logging.getLogger(__name__)

_WORKER = "worker"
_COMMANDS = "command loop"


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@attrs.frozen
class TimerHealth:
    """A snapshot of a :class:`Timer`, for health checks."""

    running: bool
    """Started, not stopping, and every component still running."""
    components: Mapping[str, bool]
    """Each running part (``worker``, and ``command loop`` when there is a command source)
    and whether it is running right now."""
    last_pass_age_s: float | None
    """Seconds since the worker last completed a pass (on the clock's monotonic time);
    None before the first. An idle worker passes at least once per polling interval."""
    passes: int
    """Worker passes completed since start."""
    failure: str | None = None
    """Why a component stopped on its own, if one did."""
    quarantined: int = 0
    """Timers quarantined now: left out of every pass until retried (see
    :attr:`Timer.quarantined`)."""
    oldest_quarantined_age_s: float | None = None
    """Seconds since the longest-held of them was quarantined (the clock's time); None when
    none is."""
    last_commands_age_s: float | None = None
    """Seconds since a batch of commands was last stored (from the command source, or by
    :meth:`Timer.schedule` / :meth:`Timer.cancel`), on the clock's monotonic time; None
    before the first. A host defers work that reads the whole table (a count of pending
    timers) until commands have been quiet for a moment."""


class Timer:
    """Durable timers inside a host: a store, a publisher and, optionally, a command source.

    ``async with Timer(store, publisher, commands=source) as timer:`` starts the store, the
    publisher and the command source, then the worker (which fires due timers) and the
    command loop (which stores the commands ``source`` delivers and acknowledges them once
    stored). Leaving the block stops them in reverse order: the command loop finishes and
    acknowledges the batch in flight, the worker finishes its pass, then the command source,
    the publisher and the store are closed.
    Nothing is acknowledged that was not stored, nothing marked fired that was not published.

    Without a broker, ``Timer(store, handler=on_due)`` calls the host's own function with
    each ``DueTimeReached`` envelope instead of publishing it (a coroutine function on the
    event loop, a plain one in a thread) and marks the timer ``Reached`` only once it
    returned (what a plain function returns that can be awaited is awaited);
    ``Timer(store, batch_handler=on_due_batch)`` calls an async function with the timers
    found due together and takes each one's outcome. :class:`~timer_core.HandlerSettings`
    (concurrency, timeout, retries, quarantine, shutdown grace) is passed as
    ``handler_settings``; anything else there is refused at once.

    A host in the same process schedules with :meth:`schedule` and :meth:`cancel`; the
    worker is woken whenever a new timer is due before it would look again (from either
    path, and from other instances when the store reports them, see
    :meth:`TimerStore.watch_remote_schedules`).

    A component that stops on its own (a bug, a command source whose consumer was deleted)
    is logged at once, shown by :meth:`health`, raised as
    :class:`~timer_core.errors.ComponentFailed` by :meth:`wait`, and raised again on
    leaving ``async with`` unless :meth:`wait` already did. The other components keep
    running until the host leaves the block.

    The constructor does no I/O and validates the worker's settings at once
    (:class:`~timer_core.errors.ValidationError`): ``polling_interval`` is the longest the
    worker sleeps without looking (seconds), ``batch_size`` the most timers fired per store
    round trip (100; 1,000 with a batch handler), ``retention`` how long fired timers are kept
    (None: forever). ``clock`` decides when timers are due and stamps ``reachedAt``: by
    default the clock of a store shared by several instances
    (:class:`~timer_core.ports.SharedClockStore`: PostgreSQL's database clock), else this
    host's (:class:`~timer_core.ports.SystemClock`).
    ``max_pending_per_tenant`` caps each tenant's ``Scheduled`` timers for commands from
    ``commands`` (None: no cap): a ``ScheduleTimer`` over it is refused and dead-lettered by
    the source (see :func:`~timer_core.handle_commands`). A Timer runs once; make a new one
    to run again.

    A store object serves one running Timer at a time (two would each fire every timer): a
    second Timer started on the same object before the first is closed is refused with
    :class:`~timer_core.errors.StoreInUse`, whatever the store (a user's own included). Once
    the first is closed, a new Timer may run on the object again.
    """

    def __init__(
        self,
        store: TimerStore,
        publisher: EventPublisher | None = None,
        *,
        handler: DueTimeHandler | None = None,
        handler_settings: HandlerSettings | None = None,
        batch_handler: DueTimeBatchHandler | None = None,
        commands: CommandSource | None = None,
        clock: Clock | None = None,
        polling_interval: float = 5.0,
        batch_size: int | None = None,
        retention: timedelta | None = None,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        ids: EnvelopeIdGenerator | None = None,
        max_pending_per_tenant: int | None = None,
    ) -> None:
        _require(store, TimerStore, "store", "a TimerStore, e.g. SqliteTimerStore('timers.db')")
        ways_out = sum(way is not None for way in (publisher, handler, batch_handler))
        if ways_out != 1:
            raise ConfigurationError(
                "a Timer needs one way out: a publisher (Timer(store, broker.publisher)), a "
                "handler (Timer(store, handler=on_due)) or a batch handler "
                "(Timer(store, batch_handler=on_due_batch)), not "
                + ("neither" if ways_out == 0 else "both" if ways_out == 2 else "all three")
            )
        if publisher is not None:
            _require(
                publisher,
                EventPublisher,
                "publisher",
                "an EventPublisher, e.g. NatsBroker.publisher (or pass handler=)",
            )
        elif handler is not None and not callable(handler):
            raise ConfigurationError(
                f"Timer's handler must be a function taking a DueTimeReached envelope; "
                f"got {_shown(handler)}"
            )
        elif batch_handler is not None and not callable(batch_handler):
            raise ConfigurationError(
                "Timer's batch_handler must be an async function taking a sequence of "
                f"DueTimeReached envelopes; got {_shown(batch_handler)}"
            )
        if handler_settings is not None and publisher is not None:
            raise ConfigurationError(
                "handler_settings is for Timer(store, handler=...) or batch_handler= only"
            )
        if commands is not None:
            _require(commands, CommandSource, "commands", "a CommandSource or None")
        if clock is not None and not isinstance(clock, Clock):
            raise ConfigurationError(
                f"Timer's clock must be a Clock (now, monotonic, sleep), got {_shown(clock)}"
            )
        self._store = store
        self._publisher = publisher
        self._commands = commands
        self._clock: Clock = clock or _deciding_clock(store)
        self._instrumentation = instrumentation
        if max_pending_per_tenant is not None and max_pending_per_tenant < 1:
            raise ValidationError(
                f"max_pending_per_tenant must be at least 1 (or None), got {max_pending_per_tenant}"
            )
        self._max_pending_per_tenant = max_pending_per_tenant
        if batch_size is None:
            batch_size = BATCH_HANDLER_BATCH_SIZE if batch_handler is not None else 100
        require_count("batch_size", batch_size)
        self._worker = TimerWorker(
            store,
            publisher
            if publisher is not None
            else handler_delivery(
                handler,
                batch_handler,
                handler_settings_of(handler_settings),
                batch_size=batch_size,
            ),
            self._clock,
            polling_interval=polling_interval,
            batch_size=batch_size,
            ids=ids,
            instrumentation=instrumentation,
            retention=retention,
        )
        self._state = _State.NEW
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._finished = asyncio.Event()
        self._failure: tuple[str, BaseException | None] | None = None
        self._failure_raised = False

    # -- what a host reads ---------------------------------------------------------------

    @property
    def store(self) -> TimerStore:
        """The store this Timer runs (for reads such as ``count_scheduled``)."""
        return self._store

    @property
    def publisher(self) -> EventPublisher | None:
        """The publisher ``DueTimeReached`` goes out through; None with a handler."""
        return self._publisher

    @property
    def clock(self) -> Clock:
        """The clock the worker and the command path read."""
        return self._clock

    def health(self) -> TimerHealth:
        """Where the Timer is now: running components, the last worker pass, any failure."""
        components = {name: not task.done() for name, task in self._tasks.items()}
        last = self._worker.last_pass_at
        applied = self._worker.last_applied_at
        return TimerHealth(
            running=self._state is _State.RUNNING and self._failure is None,
            components=components,
            last_pass_age_s=None if last is None else self._clock.monotonic() - last,
            passes=self._worker.passes,
            failure=None if self._failure is None else self._failure_text(),
            quarantined=len(self._worker.quarantined),
            oldest_quarantined_age_s=self._worker.quarantine_age(),
            last_commands_age_s=None if applied is None else self._clock.monotonic() - applied,
        )

    @property
    def quarantined(self) -> list[QuarantinedTimer]:
        """Timers whose publish kept failing while others went out (or whose handler failed
        ``HandlerSettings.max_attempts`` times), left out of every pass until retried."""
        return self._worker.quarantined

    def retry_quarantined(self, keys: Iterable[TimerKey] | None = None) -> int:
        """Put quarantined timers (all, or those of ``keys``) back; returns how many."""
        return self._worker.retry_quarantined(keys)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the store, the publisher and the command source, then the worker and the
        command loop.

        If one of them fails to start, those started are closed again and the error raised.
        A store object another Timer runs (started, not yet closed) is refused with
        :class:`~timer_core.errors.StoreInUse` before anything starts, so that Timer keeps
        its store.
        """
        if self._state is not _State.NEW:
            raise NotRunning(f"this Timer is {self._state.value}; a Timer runs only once")
        try:
            _RUNNING_STORES.claim(self)
        except StoreInUse:
            self._state = _State.CLOSED
            self._finished.set()
            raise
        self._state = _State.RUNNING
        opened: list[AsyncResource] = []
        try:
            for resource in self._resources():
                await resource.start()
                opened.append(resource)
            if isinstance(self._store, ExclusiveFiring):
                await self._store.acquire_firing()  # a second firing Timer is refused here
        except BaseException:
            self._state = _State.CLOSED
            self._finished.set()
            try:
                await _close_all(opened[::-1], [])
            finally:
                _RUNNING_STORES.release(self)
            raise
        if isinstance(self._store, ReportsRemoteSchedules):
            self._store.watch_remote_schedules(self._worker.notify_scheduled)
        self._spawn(_WORKER, self._worker.run())
        if self._commands is not None:
            self._spawn(_COMMANDS, self._commands.run(self._handle_commands))
        log.debug(
            "timer started: %r, %r, commands from %r", self._store, self._publisher, self._commands
        )

    async def aclose(self) -> None:
        """Stop the command loop, then the worker; then close the command source, the
        publisher and the store.

        Idempotent. Raises :class:`~timer_core.errors.ComponentFailed` if a component had
        stopped on its own (unless :meth:`wait` raised it already), else the first error
        met while closing, after everything was closed.
        """
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            self._finished.set()
            return
        if self._state is not _State.RUNNING:
            return
        self._state = _State.CLOSING
        errors: list[BaseException] = []
        try:
            commands = self._tasks.get(_COMMANDS)
            if commands is not None and self._commands is not None:
                if not commands.done():
                    try:
                        await self._commands.stop()
                    except Exception as exc:
                        errors.append(exc)
                await self._stopped(_COMMANDS, errors)
            self._worker.stop()
            await self._stopped(_WORKER, errors)
        finally:
            for task in self._tasks.values():
                task.cancel()  # only those left running by a cancelled close
            if isinstance(self._store, ReportsRemoteSchedules):
                self._store.watch_remote_schedules(None)
            try:
                await _close_all(self._resources()[::-1], errors)
            finally:
                # Only once the store is closed: a next Timer never starts it under this one.
                _RUNNING_STORES.release(self)
                self._state = _State.CLOSED
                self._finished.set()
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure_error()
        if errors:
            raise errors[0]

    async def wait(self) -> None:
        """Return once the Timer is closed; raise ``ComponentFailed`` as soon as a component
        stops on its own. ``await timer.wait()`` is how a host runs it until then."""
        if self._state is _State.NEW:
            raise NotRunning("this Timer is not started: use `async with Timer(...)`")
        await self._finished.wait()
        if self._failure is not None:
            self._failure_raised = True
            raise self._failure_error()

    async def wait_until_idle(self, *, timeout: float | None = 10.0) -> None:  # noqa: ASYNC109
        """Return once the worker has fired everything due by the clock's now and sleeps.

        For tests on a ``FakeClock``: ``assert bus.published == []`` means something only
        after this. Raises :class:`~timer_core.errors.WaitTimedOut` after ``timeout`` real
        seconds (None: wait forever), :class:`~timer_core.errors.NotRunning` when the Timer
        is not running.
        """
        if self._state is not _State.RUNNING:
            raise NotRunning(f"this Timer is {self._state.value}: use `async with Timer(...)`")
        try:
            await asyncio.wait_for(self._worker.wait_until_idle(), timeout)
        except TimeoutError:
            raise WaitTimedOut(
                f"gave up after {timeout:g} s waiting for the Timer's worker to be idle "
                f"(health: {self.health()})"
            ) from None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        except Exception as close_error:
            if exc is None:
                raise
            # The block's own exception is the one to see; this one is only logged.
            log.warning("closing the timer after an error failed too: %s", close_error)

    # -- in-process scheduling -----------------------------------------------------------

    async def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
    ) -> CommandOutcome:
        """Store (or reschedule) a timer durably, and wake the worker if it is due sooner.

        Returns ``SCHEDULED``, or ``IGNORED_REACHED`` for a timer that already fired (it is
        never re-armed). Invalid ids or a naive or out-of-range ``due_at`` raise
        :class:`~timer_core.errors.ValidationError`; a store that is not started (or down)
        raises :class:`~timer_core.errors.StoreError`.
        """
        command = ScheduleTimer(tenant_id, service_call_id, due_at)
        with self._worker.storing_commands():
            outcome = await schedule_timer(
                self._store, command, self._clock, correlation_id=correlation_id
            )
        self._worker.notify_applied()
        if outcome is CommandOutcome.SCHEDULED:
            self._worker.notify_scheduled(command.due_at)
        return outcome

    async def cancel(self, tenant_id: str, service_call_id: str) -> CommandOutcome:
        """Remove a ``Scheduled`` timer (``CANCELLED``); a no-op otherwise (``CANCEL_NOOP``)."""
        with self._worker.storing_commands():
            outcome = await cancel_timer(self._store, CancelTimer(tenant_id, service_call_id))
        self._worker.notify_applied(cancelled=int(outcome is CommandOutcome.CANCELLED))
        return outcome

    async def get(self, tenant_id: str, service_call_id: str) -> TimerEntry | None:
        """The timer of this service call, ``Scheduled`` or ``Reached``, or None."""
        return await self._store.get(TenantId(tenant_id), ServiceCallId(service_call_id))

    # -- inside ----------------------------------------------------------------------------

    async def _handle_commands(
        self, batch: Sequence[MessageEnvelope[Command]]
    ) -> Sequence[CommandOutcome]:
        """Store a delivered batch (before it is acked), then wake the worker if need be."""
        with self._worker.storing_commands():
            outcomes = await handle_commands(
                self._store,
                batch,
                self._clock,
                instrumentation=self._instrumentation,
                max_pending_per_tenant=self._max_pending_per_tenant,
            )
        self._worker.notify_applied(
            cancelled=sum(outcome is CommandOutcome.CANCELLED for outcome in outcomes)
        )
        scheduled = [
            envelope.payload.due_at
            for envelope, outcome in zip(batch, outcomes, strict=True)
            if outcome is CommandOutcome.SCHEDULED and isinstance(envelope.payload, ScheduleTimer)
        ]
        if scheduled:
            self._worker.notify_scheduled(min(scheduled))
        return outcomes

    def _resources(self) -> list[AsyncResource]:
        """What is started in this order, and closed in the reverse one."""
        resources: list[AsyncResource] = [self._store]
        if self._publisher is not None:
            resources.append(self._publisher)
        if self._commands is not None:
            resources.append(self._commands)
        return resources

    def _spawn(self, name: str, run: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(run, name=f"timer {name}")
        task.add_done_callback(functools.partial(self._component_done, name))
        self._tasks[name] = task

    def _component_done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._state is not _State.RUNNING or self._failure is not None:
            return  # stopped on purpose, or after the first failure (that one is reported)
        cause = None if task.cancelled() else task.exception()
        self._failure = (name, cause)
        log.error("%s", self._failure_text(), exc_info=cause)
        self._finished.set()

    async def _stopped(self, name: str, errors: list[BaseException]) -> None:
        """Wait for a component asked to stop; an error it raises now is a closing error."""
        task = self._tasks[name]
        reported = self._failure is not None and self._failure[0] == name
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the close itself was cancelled
        except Exception as exc:
            if not task.done():
                raise
            if not reported:
                log.error("the timer's %s failed while stopping: %s", name, exc, exc_info=exc)
                errors.append(exc)

    def _failure_text(self) -> str:
        assert self._failure is not None
        name, cause = self._failure
        if cause is None:
            return f"the timer's {name} stopped unexpectedly"
        return f"the timer's {name} stopped unexpectedly: {cause!r}"

    def _failure_error(self) -> ComponentFailed:
        assert self._failure is not None
        error = ComponentFailed(self._failure_text())
        error.__cause__ = self._failure[1]
        return error


class _RunningStores:
    """The store objects running Timers hold, each with its Timer: one Timer per store object
    at a time, whatever the store (a user's own included, hashable or not), in this process.

    Keyed by the store's ``id()``: the Timer holding an entry holds its store, so the id
    cannot be reused meanwhile; the Timer itself is held weakly, so one dropped without
    being closed holds nothing. A lock, as Timers may run on several threads' event loops.
    """

    def __init__(self) -> None:
        self._timers: dict[int, weakref.ref[Timer]] = {}
        self._lock = threading.Lock()

    def claim(self, timer: Timer) -> None:
        """Make ``timer`` its store's running Timer, or raise :class:`StoreInUse`."""
        store = timer.store
        with self._lock:
            for key, ref in list(self._timers.items()):
                if ref() is None:
                    del self._timers[key]  # a Timer dropped while running
            held = self._timers.get(id(store))
            owner = None if held is None else held()
            if owner is not None and owner is not timer and owner.store is store:
                raise StoreInUse(
                    f"another Timer runs on this store object ({store!r:.200}, in this "
                    "process): a store object serves one Timer at a time (two would each "
                    "fire every timer). Close that Timer first, or share it (its schedule(), "
                    "cancel() and get() serve the rest of the process); a second Timer needs "
                    "a store object of its own (another PostgresTimerStore on the same "
                    "database shares the work; a SQLite file serves one firing Timer at a time)",
                    "this process",
                )
            self._timers[id(store)] = weakref.ref(timer)

    def release(self, timer: Timer) -> None:
        """Give ``timer``'s store back, if ``timer`` holds it."""
        with self._lock:
            held = self._timers.get(id(timer.store))
            if held is not None and held() is timer:
                del self._timers[id(timer.store)]


_RUNNING_STORES = _RunningStores()


def _require(value: object, kind: type, name: str, expected: str) -> None:
    """Refuse a wrong argument at construction, not at ``async with`` with an AttributeError."""
    if not isinstance(value, kind):
        raise ConfigurationError(f"Timer's {name} must be {expected}; got {_shown(value)}")


def _shown(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:200]


def _deciding_clock(store: TimerStore) -> Clock:
    """The clock that decides when none is given: the one the store's instances share (the
    database's), else this host's."""
    if isinstance(store, SharedClockStore):
        return store.shared_clock()
    return SystemClock()


async def _close_all(resources: Sequence[AsyncResource], errors: list[BaseException]) -> None:
    """Close each resource in the given order even if one fails; collect the failures."""
    for resource in resources:
        try:
            await resource.aclose()
        except Exception as exc:
            log.warning("closing %r failed: %s", resource, exc)
            errors.append(exc)
