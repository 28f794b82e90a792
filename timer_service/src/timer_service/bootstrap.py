"""The composition root: turns :class:`Settings` into the service's parts, with no I/O.

Everything is built here and nothing is started; the caller runs the result with one
``async with`` (see :func:`timer_service.app.serve`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from timer_adapters_nats import NatsBroker, NatsSettings
from timer_core import Instrumentation, Timer, TimerStore
from timer_service.metrics import PrometheusInstrumentation
from timer_service.service import TimerService
from timer_service.settings import Settings

__all__ = ["bootstrap", "build_store", "nats_settings"]


def bootstrap(
    settings: Settings,
    broker_url: str,
    *,
    telemetry: Callable[[Instrumentation], Instrumentation] | None = None,
    store: TimerStore | None = None,
) -> TimerService:
    """The service for ``settings`` on the broker at ``broker_url``, built but not started.

    ``telemetry`` wraps the Prometheus instrumentation in what the parts report to instead
    (OpenTelemetry's: :func:`timer_service.otel.configure`). ``store`` is the one
    :func:`build_store` made already (default: a new one).
    """
    metrics = PrometheusInstrumentation()
    instrumentation = metrics if telemetry is None else telemetry(metrics)
    broker = NatsBroker(nats_settings(settings, broker_url), instrumentation=instrumentation)
    timer = Timer(
        build_store(settings) if store is None else store,
        broker.publisher,
        commands=broker.command_source(),
        # No clock given: the store's shared one decides (the database's on PostgreSQL),
        # else this host's (SQLite, one instance).
        polling_interval=settings.polling_interval_s,
        batch_size=settings.batch_size,
        retention=timedelta(seconds=settings.retention_s),
        instrumentation=instrumentation,
        max_pending_per_tenant=settings.max_pending_per_tenant,
    )
    return TimerService(settings, broker, timer, metrics, telemetry=instrumentation)


def nats_settings(settings: Settings, broker_url: str) -> NatsSettings:
    """The NATS adapter's settings for the service."""
    return NatsSettings(
        url=broker_url,
        subject_prefix=settings.subject_prefix,
        consumer_name=settings.consumer_name,
        client_name="timer-service",
        provision=settings.provision,
        per_tenant_intake=settings.intake == "per-tenant",
        max_queued_per_tenant=settings.max_queued_per_tenant,
        max_dead_letters_per_tenant=settings.max_dead_letters_per_tenant,
        stream_replicas=settings.stream_replicas,
        ack_wait_s=settings.ack_wait_s,
        # Commands fetched and stored per transaction: their own setting, so the schedule
        # path's throughput at the defaults does not hang on TIMER_BATCH_SIZE (the fire
        # path's per-pass bound; bench/README.md measures both).
        fetch_batch=settings.command_batch_size,
        tenant_consumers=settings.tenants or (),
        **settings.broker_security,
    )


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
            clock_skew_warning_s=settings.clock_skew_warning_s,
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
