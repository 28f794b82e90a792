"""The running service: a :class:`~timer_core.Timer` on its broker connection, with health and
metrics around it. Built by :func:`timer_service.bootstrap.bootstrap`; started by ``async with``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from timer_adapters_nats import NatsBroker
from timer_core import Instrumentation, StoreError, Timer, redact_url
from timer_service.access import HttpAccess
from timer_service.http import HealthEndpoint
from timer_service.metrics import PrometheusInstrumentation
from timer_service.settings import Settings

__all__ = ["HEALTHY_POLL_AGE_S", "StartupError", "TimerService"]

log = logging.getLogger("timer_service")

#: ``/healthz`` answers 200 while a worker pass completed at most this long ago.
HEALTHY_POLL_AGE_S = 30.0
_PENDING_REFRESH_S = 5.0


@runtime_checkable
class PendingGauge(Protocol):
    """Telemetry with a gauge of pending timers of its own (OpenTelemetry's)."""

    def set_pending(self, count: int) -> None: ...


@runtime_checkable
class InstancesGauge(Protocol):
    """Telemetry with a gauge of the instances sharing the tenants (OpenTelemetry's)."""

    def set_instances(self, count: int) -> None: ...


@runtime_checkable
class SharesTenants(Protocol):
    """A store that shares the tenants with other instances (PostgreSQL's)."""

    @property
    def sharing_with(self) -> tuple[str, ...]: ...


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
        self.http = HealthEndpoint(
            settings.http_host,
            settings.http_port,
            instrumentation.registry,
            self.health,
            quarantine=timer,
            access=HttpAccess.from_settings(settings),
        )
        self._running = contextlib.AsyncExitStack()

    @property
    def broker_url(self) -> str:
        """The broker's URL (the embedded server's, when the service runs one)."""
        return self.broker.settings.url

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
            try:
                await starting.enter_async_context(self.timer)
            except StoreError as exc:
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
        """Healthy while a worker pass completed in the last 30 s and the broker is connected."""
        timer = self.timer.health()
        age = timer.last_pass_age_s
        connected = self.broker.is_connected
        healthy = timer.running and age is not None and age <= HEALTHY_POLL_AGE_S and connected
        details: dict[str, object] = {
            "last_poll_age_s": None if age is None else round(age, 3),
            "broker_connected": connected,
        }
        return healthy, details

    async def run(self, stop: asyncio.Event) -> None:
        """Fire timers and take commands until ``stop`` is set.

        Raises :class:`~timer_core.errors.ComponentFailed` as soon as a part of the timer
        stops on its own; leaving ``async with`` then shuts the rest down cleanly.
        """
        maintenance = asyncio.create_task(self._maintenance(), name="maintenance")
        stopping = asyncio.create_task(stop.wait(), name="stop")
        failing = asyncio.create_task(self.timer.wait(), name="timer")
        try:
            await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (maintenance, stopping, failing):
                task.cancel()
            await asyncio.gather(maintenance, stopping, failing, return_exceptions=True)
        if failing.done() and not failing.cancelled():
            failing.result()
        log.info("shutting down: finishing the batch in flight")

    async def _maintenance(self) -> None:
        """Refresh the pending-timers and instances gauges every few seconds."""
        while True:
            store = self.timer.store
            instances = 1 + len(store.sharing_with) if isinstance(store, SharesTenants) else 1
            self.instrumentation.instances.set(instances)
            if isinstance(self.telemetry, InstancesGauge):
                self.telemetry.set_instances(instances)
            try:
                pending = await store.count_scheduled()
                self.instrumentation.pending.set(pending)
                if isinstance(self.telemetry, PendingGauge):
                    self.telemetry.set_pending(pending)
            except StoreError as exc:
                log.warning("could not count pending timers: %s", exc)
            await asyncio.sleep(_PENDING_REFRESH_S)
