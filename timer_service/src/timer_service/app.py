"""Running the service: the embedded broker when none is configured, then the parts
:func:`~timer_service.bootstrap.bootstrap` builds, under one ``async with``, until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from timer_adapters_nats.embedded import NatsServerError, NatsServerProcess
from timer_core import (
    ConfigurationError,
    ExclusiveFiring,
    Instrumentation,
    StoreError,
    StoreInUse,
)
from timer_core.redaction import redact_url
from timer_service.bootstrap import bootstrap, build_store
from timer_service.service import HEALTHY_POLL_AGE_S, StartupError, TimerService
from timer_service.settings import Settings

__all__ = [
    "HEALTHY_POLL_AGE_S",
    "StartupError",
    "TimerService",
    "broker_url_file",
    "build_store",
    "embedded_broker",
    "serve",
]

log = logging.getLogger("timer_service")

_EMBEDDED_PORT = 4222


def broker_url_file(settings: Settings) -> Path:
    """Where ``run`` writes the embedded broker's URL, so other subcommands can find it."""
    return settings.nats_store_dir / "url"


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    on_ready: Callable[[TimerService], None] | None = None,
) -> None:
    """Run the service until ``stop`` is set; raises :class:`StartupError`, or
    :class:`~timer_core.errors.ComponentFailed` after a clean shutdown if a part stopped."""
    async with contextlib.AsyncExitStack() as stack:
        store = build_store(settings)
        if isinstance(store, ExclusiveFiring):
            # SQLite: the file's firing is this service's before anything starts beside it (a
            # second service would start a second embedded nats-server on the same directory).
            stack.push_async_callback(store.aclose)  # a no-op once the timer closed it
            await _acquire_firing(store, settings)
        broker_url = settings.broker_url
        if broker_url is None:
            broker_url = await stack.enter_async_context(embedded_broker(settings))
        telemetry = None
        if settings.otel:
            telemetry, shutdown = _opentelemetry(settings)
            stack.callback(shutdown)  # after the service stopped: flushes the last spans
        service = await stack.enter_async_context(
            bootstrap(settings, broker_url, telemetry=telemetry, store=store)
        )
        # What is made by now (modules, settings, connections, caches) lasts as long as the
        # process: frozen out of the cyclic collector, whose full collections then walk only
        # what the traffic makes instead of the whole heap (bench/README.md, issue 14).
        gc.collect()
        gc.freeze()
        log.info(
            "timer-service running: database %s, broker %s, polling every %d ms, batch %d; "
            "the clock that decides when timers are due: %s",
            redact_url(settings.database_url or str(settings.db_path)),
            redact_url(broker_url),
            settings.polling_interval_ms,
            settings.batch_size,
            service.describe_clock(),
        )
        if on_ready is not None:
            on_ready(service)
        await service.run(stop)
    log.info("timer-service stopped")


async def _acquire_firing(store: ExclusiveFiring, settings: Settings) -> None:
    try:
        await store.acquire_firing()
    except StoreInUse as exc:
        raise StartupError(
            f"TIMER_DB_PATH={settings.db_path}: another timer-service (or Timer) fires this "
            f"file's timers (in {exc.owner}): stop it first, or give this service a "
            "TIMER_DB_PATH of its own; several instances sharing the work need PostgreSQL "
            "(TIMER_DATABASE_URL)"
        ) from exc
    except (StoreError, ConfigurationError) as exc:
        raise StartupError(f"TIMER_DB_PATH={settings.db_path}: {exc}") from exc


@contextlib.asynccontextmanager
async def embedded_broker(settings: Settings) -> AsyncIterator[str]:
    """Run a ``nats-server`` with JetStream beside the database; yields its URL.

    Port 4222 when free, else any; the URL is written to :func:`broker_url_file` for the
    other subcommands, and removed when the server stops.
    """
    store_dir = settings.nats_store_dir
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(
            f"TIMER_DB_PATH={settings.db_path}: cannot create {store_dir}: {exc.strerror or exc}"
        ) from exc
    # Started from the event loop's own thread, which lives as long as the process: the
    # server's parent-death signal is tied to the thread that forked it.
    server = _start_embedded(settings, _EMBEDDED_PORT if _port_free(_EMBEDDED_PORT) else 0)
    try:
        broker_url_file(settings).write_text(server.url + "\n")
        log.info("embedded nats-server %s (pid %s), data in %s", server.url, server.pid, store_dir)
        yield server.url
    finally:
        await asyncio.to_thread(server.stop)
        with contextlib.suppress(OSError):
            broker_url_file(settings).unlink()


def _opentelemetry(
    settings: Settings,
) -> tuple[Callable[[Instrumentation], Instrumentation], Callable[[], None]]:
    """OpenTelemetry's instrumentation (around the Prometheus one) on SDK providers set up
    from the environment, and their shutdown; :class:`StartupError` without the extra."""
    try:
        from timer_service.otel import OtelInstrumentation, configure
    except ImportError as exc:
        raise StartupError(
            f"TIMER_OTEL: OpenTelemetry is not installed ({exc}); "
            "install timer-service[otel] or set TIMER_OTEL=0"
        ) from None
    tracer_provider, meter_provider, shutdown = configure()

    def telemetry(inner: Instrumentation) -> Instrumentation:
        return OtelInstrumentation(
            inner,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
            timer_spans=settings.otel_timer_spans,
            lateness_sample=settings.otel_lateness_sample,
        )

    return telemetry, shutdown


def _start_embedded(settings: Settings, port: int) -> NatsServerProcess:
    """The embedded server started on ``port``; on any port if another process took that one
    between the check and the server's bind (two services, or test runs, starting at once)."""
    server = NatsServerProcess(
        settings.nats_store_dir,
        host="127.0.0.1",
        port=port,
        die_with_parent=True,
        sync_always=settings.embedded_nats_sync == "always",
    )
    try:
        server.start()
    except NatsServerError as exc:
        if port == 0 or "address already in use" not in str(exc):
            raise
        log.info("port %d was taken as the embedded nats-server started; using any port", port)
        return _start_embedded(settings, 0)
    return server


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
