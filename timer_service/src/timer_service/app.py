"""The composition root: builds the store, the broker adapters, the clock and the worker from
:class:`Settings` and runs the command consumer and the due-timer worker side by side."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path

from timer_adapters_nats import NatsBroker, NatsSettings
from timer_adapters_nats.embedded import NatsServerProcess
from timer_core import (
    Command,
    CommandOutcome,
    MessageEnvelope,
    ScheduleTimer,
    StoreError,
    SystemClock,
    TimerStore,
    TimerWorker,
    handle_commands,
    redact_url,
)
from timer_service.http import HealthEndpoint
from timer_service.metrics import PrometheusInstrumentation
from timer_service.settings import Settings

__all__ = ["HEALTHY_POLL_AGE_S", "StartupError", "TimerService", "broker_url_file", "serve"]

log = logging.getLogger("timer_service")

#: ``/healthz`` answers 200 while a worker pass completed at most this long ago.
HEALTHY_POLL_AGE_S = 30.0
_PENDING_REFRESH_S = 5.0
_EMBEDDED_PORT = 4222


class StartupError(RuntimeError):
    """The service could not start; ``str()`` is one line naming the variable or path."""


def broker_url_file(settings: Settings) -> Path:
    """Where ``run`` writes the embedded broker's URL, so other subcommands can find it."""
    return settings.nats_store_dir / "url"


def build_store(settings: Settings, *, read_only: bool = False) -> TimerStore:
    """The store the settings ask for: PostgreSQL with a URL, else the SQLite file.

    ``read_only=True``, for commands that only read (``inspect``): nothing is created or
    migrated (a database without the Timer schema raises ``SchemaNotFound``), and
    PostgreSQL's ``LISTEN`` connection is left out, as there is no worker to wake.
    """
    if settings.database_url is not None:
        from timer_adapters_postgres import PostgresTimerStore

        return PostgresTimerStore(
            settings.database_url,
            owner_id=settings.owner_id,
            lease_s=settings.lease_s,
            listen=not read_only,
            migrate=not read_only,
        )
    from timer_adapters_sqlite import SqliteTimerStore

    # A 32 MiB page cache per connection instead of SQLite's 2 MiB: storing commands for
    # random keys and due times touches pages all over a big table's indexes, and with the
    # small cache every one of them is read again and spilled (bench/README.md).
    return SqliteTimerStore(
        settings.db_path,
        synchronous=settings.sqlite_synchronous,
        pragmas={"cache_size": -32768},
        migrate=not read_only,
    )


class TimerService:
    """One running Timer: store, broker, worker, command consumer, health and metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instrumentation = PrometheusInstrumentation()
        self.clock = SystemClock()
        self.embedded: NatsServerProcess | None = None
        self.store: TimerStore | None = None
        self.broker: NatsBroker | None = None
        self.worker: TimerWorker | None = None
        self.http: HealthEndpoint | None = None
        self.broker_url: str | None = settings.broker_url
        self._started_at = time.monotonic()

    async def start(self) -> None:
        """Start every component, or raise :class:`StartupError` naming what failed."""
        settings = self.settings
        if settings.embedded_broker:
            # Started from the event loop's own thread, which lives as long as the process:
            # the server's parent-death signal is tied to the thread that forked it.
            self.broker_url = self._start_embedded_broker()
        self.store = build_store(settings)
        try:
            await self.store.start()
        except StoreError as exc:
            what = (
                "TIMER_DATABASE_URL"
                if settings.database_url
                else f"TIMER_DB_PATH={settings.db_path}"
            )
            raise StartupError(f"{what}: cannot open the database: {redact_url(str(exc))}") from exc
        assert self.broker_url is not None
        self.broker = NatsBroker(
            NatsSettings(
                url=self.broker_url,
                subject_prefix=settings.subject_prefix,
                consumer_name=settings.consumer_name,
                provision=settings.provision,
                stream_replicas=settings.stream_replicas,
                ack_wait_s=settings.ack_wait_s,
                # The same lever for both directions: commands stored per transaction, as
                # timers fired per pass (bench/README.md measures the trade-off).
                fetch_batch=settings.batch_size,
                **settings.broker_security,
            ),
            instrumentation=self.instrumentation,
        )
        try:
            await self.broker.start()
        except Exception as exc:
            raise StartupError(
                f"TIMER_BROKER_URL={redact_url(self.broker_url)}: cannot connect to the broker: "
                f"{redact_url(str(exc))}"
            ) from exc
        self.worker = TimerWorker(
            self.store,
            self.broker.publisher,
            self.clock,
            polling_interval=settings.polling_interval_s,
            batch_size=settings.batch_size,
            instrumentation=self.instrumentation,
            retention=timedelta(seconds=settings.retention_s),
        )
        if hasattr(self.store, "on_remote_schedule"):
            self.store.on_remote_schedule = self.worker.notify_scheduled
        if settings.http_port:
            self.http = HealthEndpoint(
                settings.http_host, settings.http_port, self.instrumentation.registry, self.health
            )
            try:
                await self.http.start()
            except OSError as exc:
                raise StartupError(
                    f"TIMER_HTTP_PORT={settings.http_port}: cannot listen on "
                    f"{settings.http_host}:{settings.http_port}: {exc.strerror or exc}"
                ) from exc

    def _start_embedded_broker(self) -> str:
        store_dir = self.settings.nats_store_dir
        try:
            store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"TIMER_DB_PATH={self.settings.db_path}: cannot create {store_dir}: "
                f"{exc.strerror or exc}"
            ) from exc
        port = _EMBEDDED_PORT if _port_free(_EMBEDDED_PORT) else 0
        self.embedded = NatsServerProcess(
            store_dir, host="127.0.0.1", port=port, die_with_parent=True
        )
        self.embedded.start()
        broker_url_file(self.settings).write_text(self.embedded.url + "\n")
        log.info(
            "embedded nats-server %s (pid %s), data in %s",
            self.embedded.url,
            self.embedded.pid,
            store_dir,
        )
        return self.embedded.url

    def health(self) -> tuple[bool, dict[str, object]]:
        """Healthy while a worker pass completed in the last 30 s and the broker is connected."""
        worker = self.worker
        last = worker.last_pass_at if worker is not None else None
        age = None if last is None else time.monotonic() - last
        connected = self.broker is not None and self.broker.is_connected
        healthy = age is not None and age <= HEALTHY_POLL_AGE_S and connected
        details: dict[str, object] = {
            "last_poll_age_s": None if age is None else round(age, 3),
            "broker_connected": connected,
        }
        return healthy, details

    async def run(self, stop: asyncio.Event) -> None:
        """Consume commands and fire timers until ``stop`` is set; then shut down cleanly.

        The command batch in the handler is finished and acked, the worker's pass in flight
        finished, nothing acked that was not stored.
        """
        assert self.worker is not None and self.broker is not None and self.store is not None
        worker = self.worker
        source = self.broker.command_source()
        tasks = {
            asyncio.create_task(worker.run(), name="worker"),
            asyncio.create_task(source.run(self._command_handler()), name="commands"),
            asyncio.create_task(self._maintenance(), name="maintenance"),
        }
        stopper = asyncio.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait({*tasks, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for task in done - {stopper}:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s stopped unexpectedly", task.get_name(), exc_info=task.exception())
        log.info("shutting down: finishing the batch in flight")
        stopper.cancel()
        await source.stop()
        worker.stop()
        for task in tasks:
            if task.get_name() == "maintenance":
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("component failed during shutdown: %s", result)

    def _command_handler(
        self,
    ) -> Callable[[Sequence[MessageEnvelope[Command]]], Awaitable[Sequence[CommandOutcome]]]:
        store, clock, worker = self.store, self.clock, self.worker
        assert store is not None and worker is not None
        instrumentation = self.instrumentation

        async def handle(batch: Sequence[MessageEnvelope[Command]]) -> Sequence[CommandOutcome]:
            outcomes = await handle_commands(store, batch, clock, instrumentation=instrumentation)
            scheduled = [
                envelope.payload.due_at
                for envelope, outcome in zip(batch, outcomes, strict=True)
                if outcome is CommandOutcome.SCHEDULED
                and isinstance(envelope.payload, ScheduleTimer)
            ]
            if scheduled:
                worker.notify_scheduled(min(scheduled))
            return outcomes

        return handle

    async def _maintenance(self) -> None:
        """Refresh the pending-timers gauge every few seconds."""
        store = self.store
        assert store is not None
        while True:
            try:
                self.instrumentation.pending.set(await store.count_scheduled())
            except StoreError as exc:
                log.warning("could not count pending timers: %s", exc)
            await asyncio.sleep(_PENDING_REFRESH_S)

    async def aclose(self) -> None:
        """Close everything that was opened, in reverse order; never raises."""
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.aclose()
        if self.broker is not None:
            try:
                await self.broker.aclose()
            except Exception as exc:
                log.warning("closing the broker connection failed: %s", exc)
        if self.store is not None:
            try:
                await self.store.aclose()
            except Exception as exc:
                log.warning("closing the store failed: %s", exc)
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
            with contextlib.suppress(OSError):
                broker_url_file(self.settings).unlink()


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    on_ready: Callable[[TimerService], None] | None = None,
) -> None:
    """Run a :class:`TimerService` until ``stop`` is set; raises :class:`StartupError`."""
    service = TimerService(settings)
    try:
        await service.start()
        log.info(
            "timer-service running: database %s, broker %s, polling every %d ms, batch %d",
            redact_url(settings.database_url or str(settings.db_path)),
            redact_url(service.broker_url or ""),
            settings.polling_interval_ms,
            settings.batch_size,
        )
        if on_ready is not None:
            on_ready(service)
        await service.run(stop)
    finally:
        await service.aclose()
    log.info("timer-service stopped")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
