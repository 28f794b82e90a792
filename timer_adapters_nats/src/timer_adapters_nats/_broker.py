"""A Timer service's NATS connection: it provisions the streams and the command consumer, and
hands out the event publisher, the command source, due-event consumers and the dead letters."""

from __future__ import annotations

import logging

import nats.js.errors
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from timer_adapters_nats._connection import (
    JETSTREAM_MISSING,
    NatsConnection,
    jetstream_unavailable,
)
from timer_adapters_nats._dead_letters import DeadLetters
from timer_adapters_nats._events import DueEventConsumer, DueEventConsumerSettings
from timer_adapters_nats._publisher import NatsEventPublisher
from timer_adapters_nats._settings import NatsSettings
from timer_adapters_nats._source import NatsCommandSource
from timer_core import NO_INSTRUMENTATION, Instrumentation

__all__ = ["NatsBroker"]

log = logging.getLogger(__name__)

_STREAM_NAME_IN_USE = 10058
_CONTRACT_DUPLICATE_WINDOW_S = 120.0


class NatsBroker(NatsConnection):
    """A :class:`NatsConnection` that provisions and hands out the adapters sharing it.

    :meth:`start` connects (failing within ``connect_timeout_s`` with
    :class:`BrokerUnavailable` naming the URL) and, unless ``provision=False``, creates the
    streams ``TIMER_COMMANDS``, ``TIMER_EVENTS`` and ``TIMER_DLQ`` when absent and creates or
    updates the durable pull consumer. Once connected the client reconnects forever.
    """

    def __init__(
        self, settings: NatsSettings, *, instrumentation: Instrumentation = NO_INSTRUMENTATION
    ) -> None:
        super().__init__(settings)
        self.instrumentation = instrumentation
        self._publisher: NatsEventPublisher | None = None

    @property
    def publisher(self) -> NatsEventPublisher:
        """The event publisher on this connection (one per broker)."""
        if self._publisher is None:
            self._publisher = NatsEventPublisher(self)
        return self._publisher

    def command_source(self) -> NatsCommandSource:
        """A new command source reading the durable consumer on this connection."""
        return NatsCommandSource(self, instrumentation=self.instrumentation)

    def due_events(
        self,
        name: str,
        *,
        tenant_id: str | None = None,
        settings: DueEventConsumerSettings | None = None,
    ) -> DueEventConsumer:
        """The ``DueTimeReached`` events of the durable consumer ``name``, as an async iterator.

        ``tenant_id`` limits it to one tenant's events (the consumer's subject filter). Use
        it as ``async with broker.due_events("billing") as events: async for delivery in
        events: async with delivery: ...`` (see :class:`DueEventConsumer`); the broker must be
        started first.
        """
        return DueEventConsumer(self, name, tenant_id=tenant_id, settings=settings)

    def dead_letters(self) -> DeadLetters:
        """The dead-letter stream on this connection, to list and replay rejected commands."""
        return DeadLetters(self)

    async def start(self) -> None:
        """Connect and provision; idempotent. Raises :class:`BrokerUnavailable` on failure."""
        if self._nc is not None:
            return
        await super().start()
        try:
            if self.settings.provision:
                await self.provision()
        except BaseException:
            await self.aclose()
            raise

    async def provision(self) -> None:
        """Create the three streams if absent and create or update the consumer (idempotent).

        An existing stream is left as its operator configured it; a warning says when it does
        not cover the contract's subjects or its duplicate window is under two minutes.
        """
        settings = self.settings
        subjects = settings.subjects
        try:
            await self._ensure_stream(settings.commands_stream, subjects.commands_filter)
            await self._ensure_stream(settings.events_stream, subjects.events_filter)
            await self._ensure_stream(settings.dlq_stream, subjects.dlq_filter)
            await self.jetstream.add_consumer(settings.commands_stream, self.consumer_config())
        except JETSTREAM_MISSING as exc:
            raise jetstream_unavailable(exc, settings.url) from exc

    def stream_config(self, name: str, subject: str) -> StreamConfig:
        """The configuration provisioning gives a stream: file storage, limits retention."""
        settings = self.settings
        return StreamConfig(
            name=name,
            subjects=[subject],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            num_replicas=settings.stream_replicas,
            duplicate_window=settings.duplicate_window_s,
            max_age=settings.stream_max_age_s,
        )

    def consumer_config(self) -> ConsumerConfig:
        """The durable pull consumer: explicit acks, bounded ack wait and max deliver.

        The backoff is the source's doubling nak delay. A consumer-level ``backoff`` is left
        out on purpose: the server applies it over explicit nak delays from the second
        redelivery on, which would turn a 1 s retry into an ack-wait-long one. Room for eight
        fetch batches unacknowledged: the one being stored and the next, read ahead, of four
        instances (the server's default of 1000 would stall a read-ahead at batches of 1000;
        room for two instances only cut four instances' batches to a third).
        """
        settings = self.settings
        return ConsumerConfig(
            name=settings.consumer_name,
            durable_name=settings.consumer_name,
            description="Timer commands (ScheduleTimer, CancelTimer)",
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=settings.ack_wait_s,
            max_deliver=settings.max_deliver,
            max_ack_pending=max(1000, 8 * settings.fetch_batch),
            filter_subject=settings.subjects.commands_filter,
        )

    async def _ensure_stream(self, name: str, subject: str) -> None:
        config = self.stream_config(name, subject)
        try:
            info = await self.jetstream.stream_info(name)
        except nats.js.errors.NotFoundError:
            try:
                await self.jetstream.add_stream(config)
                log.info("created stream %s (%s)", name, subject)
                return
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:  # lost a creation race: fine
                    raise
            info = await self.jetstream.stream_info(name)
        existing = info.config
        if subject not in (existing.subjects or []):
            log.warning(
                "stream %s exists with subjects %s, not %s; leaving it as it is",
                name,
                existing.subjects,
                subject,
            )
        if (existing.duplicate_window or 0) < min(
            _CONTRACT_DUPLICATE_WINDOW_S, self.settings.duplicate_window_s
        ):
            log.warning(
                "stream %s has a duplicate window of %ss, under the %ss re-publishes rely on",
                name,
                existing.duplicate_window,
                self.settings.duplicate_window_s,
            )
