"""The running service: a :class:`~timer_core.Timer` on its broker connection, with health and
metrics around it. Built by :func:`timer_service.bootstrap.bootstrap`; started by ``async with``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from timer_adapters_nats import NatsBroker, TimerClient
from timer_core import (
    ComponentFailed,
    ConfigurationError,
    Instrumentation,
    StoreError,
    Timer,
    TimerCensus,
)
from timer_core.redaction import redact_url
from timer_service.access import HttpAccess
from timer_service.census import Census, take_census
from timer_service.console import Console
from timer_service.durability import BrokerDurability, read_durability
from timer_service.http import HealthEndpoint
from timer_service.metrics import PrometheusInstrumentation
from timer_service.settings import Settings

__all__ = [
    "BROKER_CHECK_S",
    "COUNTS_QUIET_S",
    "HEALTHY_POLL_AGE_S",
    "StartupError",
    "TimerService",
]

log = logging.getLogger("timer_service")

#: ``/healthz`` answers 200 while a worker pass completed at most this long ago.
HEALTHY_POLL_AGE_S = 30.0
_PENDING_REFRESH_S = 5.0
#: How often a running service looks for its streams and consumers on the broker.
BROKER_CHECK_S = 1.0
_PENDING_COST_SHARE_INVERSE = 100  # the pending count's pace keeps it to 1% of the time
#: The count of pending timers waits for a moment without commands: none
#: stored for this long (nor the service started less than this long ago). A count reads
#: the whole table (0.8 s of three PostgreSQL processes at 10,000,000 pending timers, 2.9 s
#: of SQLite's reader), and run beside a storm of new timers, or a restart's catch-up on
#: the commands queued meanwhile, it took a third of their rate (bench/README.md).
COUNTS_QUIET_S = 1.0
#: ... at most this long past their time: a steady stream of commands still gets counts.
_COUNT_DEFERRED_MOST_S = 30.0


@runtime_checkable
class PendingGauge(Protocol):
    """Telemetry with a gauge of pending timers of its own (OpenTelemetry's)."""

    def set_pending(self, count: int) -> None: ...


@runtime_checkable
class CensusGauges(Protocol):
    """Telemetry with census gauges of its own (OpenTelemetry's)."""

    def set_census(self, census: Census) -> None: ...


@runtime_checkable
class InstancesGauge(Protocol):
    """Telemetry with a gauge of the instances sharing the tenants (OpenTelemetry's)."""

    def set_instances(self, count: int) -> None: ...


@runtime_checkable
class BrokerStateCounter(Protocol):
    """Telemetry with a counter of recreated streams and consumers (OpenTelemetry's)."""

    def broker_state_recreated(self, what: str) -> None: ...


@runtime_checkable
class SharesTenants(Protocol):
    """A store that shares the tenants with other instances (PostgreSQL's)."""

    @property
    def sharing_with(self) -> tuple[str, ...]: ...


def pending_count_pace(duration_s: float) -> float:
    """Seconds from the start of one count of pending timers to the next: every 5 s, or
    100 times what the last count took when that is longer (1% of the time at most).

    A full count reads the whole due index: 2.9 s at 10 million pending timers on SQLite
    (bench/console.py), where it also holds the reader thread the poll needs.
    """
    return max(_PENDING_REFRESH_S, _PENDING_COST_SHARE_INVERSE * duration_s)


@runtime_checkable
class MeasuresSkew(Protocol):
    """A clock that decides for every instance sharing a database and measures how far this
    host's wall clock is off it (PostgreSQL's :class:`~timer_adapters_postgres.DatabaseClock`)."""

    @property
    def source(self) -> str: ...

    @property
    def skew_s(self) -> float | None: ...


@runtime_checkable
class ClockSkewGauge(Protocol):
    """Telemetry with a clock-skew gauge of its own (OpenTelemetry's)."""

    def set_clock_skew(self, read: Callable[[], float | None]) -> None: ...


class StartupError(RuntimeError):
    """The service could not start; ``str()`` is one line naming the variable or path."""


class TimerService:
    """One Timer service: the broker connection, the :class:`~timer_core.Timer` running on it,
    and the health and metrics endpoint.

    Every part is made before (no I/O here); ``async with`` connects the broker, starts the
    timer (store, worker, command loop) and the endpoint, or raises :class:`StartupError`
    naming the setting at fault, and stops them in reverse order.
    """

    def __init__(
        self,
        settings: Settings,
        broker: NatsBroker,
        timer: Timer,
        instrumentation: PrometheusInstrumentation,
        *,
        telemetry: Instrumentation | None = None,
    ) -> None:
        self.settings = settings
        self.broker = broker
        self.timer = timer
        self.instrumentation = instrumentation
        #: What the parts report to: ``instrumentation``, or OpenTelemetry's around it.
        self.telemetry = instrumentation if telemetry is None else telemetry
        access = HttpAccess.from_settings(settings)
        #: The latest census of pending timers (None before the first, or without one).
        self.census: Census | None = None
        #: The operator's web console (``TIMER_CONSOLE``), or None.
        self.console: Console | None = None
        if settings.console:
            self.console = Console(
                store=timer.store,
                quarantine=timer,
                clock=timer.clock,
                access=access,
                port=lambda: self.http.port,
                census_cap=settings.census_cap,
                dead_letters=broker.dead_letters,
                commands=lambda: TimerClient(broker),
                tenants=settings.console_tenants,
                warnings=self._warnings,
            )
        self.http = HealthEndpoint(
            settings.http_host,
            settings.http_port,
            instrumentation.registry,
            self.health,
            quarantine=timer,
            access=access,
            app=self.console,
        )
        #: What is known of how the broker keeps what it acknowledged (read at start).
        self.durability: BrokerDurability | None = None
        self._running = contextlib.AsyncExitStack()
        # What of the broker state is missing and not recreated (None: all there), and since
        # when (loop time).
        self._broker_fault: str | None = None
        self._broker_fault_since = 0.0
        clock = timer.clock
        if isinstance(clock, MeasuresSkew):
            instrumentation.clock_skew.set_function(lambda: clock.skew_s or 0.0)
            if isinstance(self.telemetry, ClockSkewGauge):
                self.telemetry.set_clock_skew(lambda: clock.skew_s)

    @property
    def broker_url(self) -> str:
        """The broker's URL (the embedded server's, when the service runs one)."""
        return self.broker.settings.url

    @property
    def clock(self) -> str:
        """Which clock decides when timers are due: ``database`` or ``host``."""
        clock = self.timer.clock
        return clock.source if isinstance(clock, MeasuresSkew) else "host"

    @property
    def clock_skew_s(self) -> float | None:
        """This host's wall clock minus the deciding clock, as last measured (None: the
        host's own clock decides)."""
        clock = self.timer.clock
        return clock.skew_s if isinstance(clock, MeasuresSkew) else None

    def describe_clock(self) -> str:
        """Which clock decides, in words, for the start-up log."""
        skew = self.clock_skew_s
        if self.clock == "host":
            return "this host's (one instance on SQLite)"
        measured = "" if skew is None else f", this host's is {skew:+.3f} s off it"
        return f"the {self.clock}'s (shared by every instance{measured})"

    async def __aenter__(self) -> Self:
        settings = self.settings
        async with contextlib.AsyncExitStack() as starting:
            try:
                await starting.enter_async_context(self.broker)
            except Exception as exc:
                raise StartupError(
                    f"TIMER_BROKER_URL={redact_url(self.broker_url)}: cannot connect to the "
                    f"broker: {redact_url(str(exc))}"
                ) from exc
            self.durability = await self._read_durability()
            try:
                await starting.enter_async_context(self.timer)
            except (StoreError, ConfigurationError) as exc:
                what = (
                    "TIMER_DATABASE_URL"
                    if settings.database_url
                    else f"TIMER_DB_PATH={settings.db_path}"
                )
                raise StartupError(
                    f"{what}: cannot open the database: {redact_url(str(exc))}"
                ) from exc
            if settings.http_port:
                try:
                    await self.http.start()
                except OSError as exc:
                    raise StartupError(
                        f"TIMER_HTTP_PORT={settings.http_port}: cannot listen on "
                        f"{settings.http_host}:{settings.http_port}: {exc.strerror or exc}"
                    ) from exc
                starting.push_async_callback(self.http.aclose)
            self._running = starting.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._running.__aexit__(exc_type, exc, tb)

    def health(self) -> tuple[bool, dict[str, object]]:
        """Healthy while a worker pass completed in the last 30 s, the broker is connected and
        none of the service's streams and consumers is missing."""
        timer = self.timer.health()
        age = timer.last_pass_age_s
        connected = self.broker.is_connected
        fault = self._broker_fault
        healthy = (
            timer.running
            and age is not None
            and age <= HEALTHY_POLL_AGE_S
            and connected
            and fault is None
        )
        skew = self.clock_skew_s
        oldest = timer.oldest_quarantined_age_s
        details: dict[str, object] = {
            "last_poll_age_s": None if age is None else round(age, 3),
            "broker_connected": connected,
            "clock": self.clock,
            "clock_skew_s": None if skew is None else round(skew, 4),
            "quarantined": timer.quarantined,
            "oldest_quarantined_age_s": None if oldest is None else round(oldest, 3),
        }
        if fault is not None:
            details["broker_state"] = fault
        if self.durability is not None:
            details.update(self.durability.health())
        return healthy, details

    async def _read_durability(self) -> BrokerDurability:
        """Read what can be known of the broker's durability; warn when an acknowledged
        event can be lost on power loss, or refuse to start (TIMER_REQUIRE_DURABLE_BROKER)."""
        replicas: int | None = None
        stream = self.broker.settings.events_stream
        try:
            info = await self.broker.jetstream.stream_info(stream)
            replicas = info.config.num_replicas
        except Exception as exc:  # provisioning off and no stream yet: replicas unknown
            log.debug("could not read the replicas of %s: %s", stream, exc)
        durability = await read_durability(self.settings, replicas)
        risk = durability.risk()
        if risk is None:
            log.info("the broker forces every acknowledged write to disk before acknowledging it")
        elif self.settings.require_durable_broker:
            raise StartupError(f"TIMER_REQUIRE_DURABLE_BROKER=true: {risk}")
        else:
            log.warning("%s", risk)
        return durability

    def _warnings(self) -> list[str]:
        """What the console shows on its overview: how acknowledged events can be lost."""
        risk = None if self.durability is None else self.durability.risk()
        return [] if risk is None else [f"Broker durability: {risk}."]

    async def run(self, stop: asyncio.Event) -> None:
        """Fire timers and take commands until ``stop`` is set.

        Raises :class:`~timer_core.errors.ComponentFailed` as soon as a part of the timer
        stops on its own; leaving ``async with`` then shuts the rest down cleanly.
        """
        maintenance = asyncio.create_task(self._maintenance(), name="maintenance")
        census = asyncio.create_task(self._census(), name="census")
        stopping = asyncio.create_task(stop.wait(), name="stop")
        failing = asyncio.create_task(self.timer.wait(), name="timer")
        watching = asyncio.create_task(self._watch_broker(), name="broker state")
        tasks = (maintenance, census, stopping, failing, watching)
        try:
            await asyncio.wait({stopping, failing, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in (failing, watching):
            if task.done() and not task.cancelled():
                task.result()
        log.info("shutting down: finishing the batch in flight")

    async def _watch_broker(self) -> None:
        """Every second, look for the streams and consumers the service needs; recreate a
        missing one (provisioning on), else report it on ``/healthz``; raise
        :class:`ComponentFailed` once something stayed missing for the grace period."""
        loop = asyncio.get_running_loop()
        grace = self.settings.broker_state_grace_s
        while True:
            await asyncio.sleep(BROKER_CHECK_S)
            if not self.broker.is_connected:
                continue  # /healthz says so already; nothing can be known now
            try:
                fault = await self._broker_state()
            except Exception as exc:  # no answer (a timeout, a disconnect): unknown, not missing
                log.debug("could not check the broker state: %s", exc)
                continue
            if fault is None:
                if self._broker_fault is not None:
                    log.info("broker state is complete again")
                self._broker_fault = None
                continue
            if self._broker_fault is None:
                self._broker_fault_since = loop.time()
                log.error("%s; the service exits in %gs unless it comes back", fault, grace)
            self._broker_fault = fault
            if loop.time() - self._broker_fault_since >= grace:
                raise ComponentFailed(f"broker state: {fault}, for {grace:g}s")

    async def _broker_state(self) -> str | None:
        """None when every stream and consumer is there (after recreating what was missing,
        with provisioning on); else one line saying what is missing and why it stays so."""
        gone = await self.broker.missing()
        if not gone:
            return None
        what = ", ".join(gone)
        if not self.settings.provision:
            return f"missing: {what} (TIMER_PROVISION=false: recreate it on the broker)"
        try:
            recreated = await self.broker.restore()
        except Exception as exc:
            return f"missing: {what}; recreating it failed: {exc}"
        for item in recreated:
            kind = item.split()[0]  # "stream" or "consumer"
            self.instrumentation.broker_state_recreated.labels(kind).inc()
            if isinstance(self.telemetry, BrokerStateCounter):
                self.telemetry.broker_state_recreated(kind)
        return None

    def _commands_quiet_for(self, started: float) -> float:
        """Seconds since a batch of commands was last stored (or since ``started``, the
        service's start on ``time.monotonic()``, before the first)."""
        age = self.timer.health().last_commands_age_s
        since_start = time.monotonic() - started
        return since_start if age is None else min(age, since_start)

    async def _maintenance(self) -> None:
        """Refresh the instances gauge every few seconds, and the pending-timers gauge as
        often, unless counting takes longer than 1% of the time between two counts; a
        count waits for commands to be quiet (:data:`COUNTS_QUIET_S`), at most 30 s past
        its time."""
        started = time.monotonic()
        count_after = 0.0
        deferred_at: float | None = None  # when the count due was first put off
        while True:
            store = self.timer.store
            instances = 1 + len(store.sharing_with) if isinstance(store, SharesTenants) else 1
            self.instrumentation.instances.set(instances)
            if isinstance(self.telemetry, InstancesGauge):
                self.telemetry.set_instances(instances)
            pause = _PENDING_REFRESH_S
            now = time.monotonic()
            if now >= count_after:
                deferred_at = now if deferred_at is None else deferred_at
                quiet_in = COUNTS_QUIET_S - self._commands_quiet_for(started)
                if quiet_in > 0 and now - deferred_at < _COUNT_DEFERRED_MOST_S:
                    pause = min(pause, quiet_in)  # commands being stored: count later
                else:
                    deferred_at = None
                    try:
                        pending = await store.count_scheduled()
                        self.instrumentation.pending.set(pending)
                        if isinstance(self.telemetry, PendingGauge):
                            self.telemetry.set_pending(pending)
                    except StoreError as exc:
                        log.warning("could not count pending timers: %s", exc)
                    count_after = now + pending_count_pace(time.monotonic() - now)
            await asyncio.sleep(pause)

    async def take_census(self) -> Census | None:
        """Take the census of pending timers now and report it; None when the store cannot."""
        store = self.timer.store
        if not isinstance(store, TimerCensus):
            return None
        census = await take_census(store, self.timer.clock.now(), cap=self.settings.census_cap)
        self.census = census
        self.instrumentation.census_taken(census)
        if isinstance(self.telemetry, CensusGauges):
            self.telemetry.set_census(census)
        return census

    async def _census(self) -> None:
        """Take the census every ``TIMER_CENSUS_INTERVAL`` (never, at 0)."""
        interval = self.settings.census_interval_s
        if not interval or not isinstance(self.timer.store, TimerCensus):
            return
        while True:
            try:
                await self.take_census()
            except StoreError as exc:
                log.warning("could not take the census of pending timers: %s", exc)
            await asyncio.sleep(interval)
