"""A Timer service's NATS connection: it provisions the streams and the command consumer, and
hands out the event publisher, the command source, due-event consumers and the dead letters.
While the service runs it tells what of that state has gone missing and recreates it."""

from __future__ import annotations

import json
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
from timer_adapters_nats._lanes import (
    TenantCommandSource,
    command_consumer_config,
    put_command_consumer,
)
from timer_adapters_nats._publisher import NatsEventPublisher
from timer_adapters_nats._settings import NatsSettings
from timer_adapters_nats._source import NatsCommandSource
from timer_core import Instrumentation, TenantId
from timer_core.instrumentation import NO_INSTRUMENTATION

__all__ = ["NatsBroker"]

log = logging.getLogger(__name__)

_STREAM_NAME_IN_USE = 10058
_CONTRACT_DUPLICATE_WINDOW_S = 120.0
#: The commands stream's duplicate window: the shortest JetStream takes. Its window spans
#: every tenant's subject, so an id one tenant sent would drop another's command with the
#: same id; commands are idempotent by their timer's key and need none (docs/design.md).
COMMANDS_DUPLICATE_WINDOW_S = 0.1
# Consumer names per page of $JS.API.CONSUMER.NAMES.
_NAMES_PAGE = 1024


class NatsBroker(NatsConnection):
    """A :class:`NatsConnection` that provisions and hands out the adapters sharing it.

    :meth:`start` connects (failing within ``connect_timeout_s`` with
    :class:`BrokerUnavailable` naming the URL) and, unless ``provision=False``, creates the
    streams ``TIMER_COMMANDS``, ``TIMER_EVENTS`` and ``TIMER_DLQ`` when absent, creates or
    updates the durable pull consumer, and creates the tenants' event consumers of
    ``tenant_consumers``. Once connected the client reconnects forever. While it runs,
    :meth:`missing` tells what of that has gone and :meth:`restore` recreates it.
    """

    def __init__(
        self, settings: NatsSettings, *, instrumentation: Instrumentation = NO_INSTRUMENTATION
    ) -> None:
        super().__init__(settings)
        self.instrumentation = instrumentation
        self._publisher: NatsEventPublisher | None = None
        self._sources: list[NatsCommandSource | TenantCommandSource] = []
        # The command consumer's ack floor as missing() last saw it: every command up to it
        # is settled, whichever instance held it.
        self._ack_floor: int | None = None

    @property
    def publisher(self) -> NatsEventPublisher:
        """The event publisher on this connection (one per broker)."""
        if self._publisher is None:
            self._publisher = NatsEventPublisher(self)
        return self._publisher

    def command_source(self) -> NatsCommandSource | TenantCommandSource:
        """A new command source on this connection: a :class:`TenantCommandSource` (a
        consumer per tenant, :attr:`~NatsSettings.per_tenant_intake`), else a
        :class:`NatsCommandSource` reading the one shared consumer."""
        source: NatsCommandSource | TenantCommandSource
        if self.settings.lanes:
            source = TenantCommandSource(self, instrumentation=self.instrumentation)
        else:
            source = NatsCommandSource(self, instrumentation=self.instrumentation)
        self._sources.append(source)
        return source

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
        """Create the three streams if absent, create or update the consumer, and create the
        consumers of :attr:`~NatsSettings.tenant_consumers` that are absent (idempotent).

        An existing stream is left as its operator configured it; a warning says when it does
        not cover the contract's subjects or its duplicate window is under two minutes. An
        existing command consumer keeps where it starts (a recreated one starts where the
        service left off, see :meth:`restore`).
        """
        settings = self.settings
        subjects = settings.subjects
        try:
            await self._ensure_stream(settings.commands_stream, subjects.commands_filter)
            await self._ensure_stream(settings.events_stream, subjects.events_filter)
            await self._ensure_stream(settings.dlq_stream, subjects.dlq_filter)
            if not settings.lanes:  # the lanes make their own consumers as tenants appear
                await self._ensure_command_consumer(resume_from=None)
            await self._ensure_tenant_consumers(settings.tenant_consumers)
        except JETSTREAM_MISSING as exc:
            raise jetstream_unavailable(exc, settings.url) from exc

    async def missing(self) -> list[str]:
        """What of the service's broker state is not there right now: each missing stream,
        the command consumer and the :attr:`~NatsSettings.tenant_consumers`' consumers, one
        line each (``consumer timer-service on TIMER_COMMANDS``); empty when all is there.

        Raises what the JetStream API raises when it cannot answer (a disconnect, a
        timeout): then nothing is known to be missing.
        """
        settings = self.settings
        js = self.jetstream
        gone: list[str] = []
        for stream in (settings.commands_stream, settings.events_stream, settings.dlq_stream):
            try:
                await js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                gone.append(f"stream {stream}")
        if f"stream {settings.commands_stream}" not in gone and settings.lanes:
            present = await self._consumer_names(settings.commands_stream)
            gone += [
                f"consumer {lane} on {settings.commands_stream}"
                for lane in self._lanes()
                if lane not in present
            ]
        elif f"stream {settings.commands_stream}" not in gone:
            try:
                info = await js.consumer_info(settings.commands_stream, settings.consumer_name)
            except nats.js.errors.NotFoundError:
                gone.append(f"consumer {settings.consumer_name} on {settings.commands_stream}")
            else:
                if info.ack_floor is not None:
                    self._ack_floor = info.ack_floor.stream_seq
        for stream in (settings.events_stream, settings.dlq_stream):
            if settings.tenant_consumers and f"stream {stream}" not in gone:
                present = await self._consumer_names(stream)
                gone += [
                    f"consumer {tenant} on {stream}"
                    for tenant in settings.tenant_consumers
                    if tenant not in present
                ]
        return gone

    async def restore(self) -> list[str]:
        """Recreate what :meth:`missing` finds missing, each logged at ``WARNING``; returns
        what was recreated (empty when nothing was missing).

        A recreated command consumer starts at the first command not known to be settled:
        the lowest of those this broker's command sources hold or handed back, the one after
        the last they acknowledged, and the one after the consumer's ack floor as
        :meth:`missing` last saw it (which covers what other instances held). So every
        command sent while it was gone is delivered, and of those stored before only the few
        acknowledged since that last look come again (applied as stale: no change). The
        sources then fetch at once instead of waiting out their backoff. With nothing known
        (and after the commands stream itself was recreated) it starts at the stream's
        beginning. Tenant consumers are recreated reading their events from the
        start of the stream (the hosts may see events again: at least once).
        """
        gone = await self.missing()
        if not gone:
            return []
        settings = self.settings
        subjects = settings.subjects
        for stream, subject in (
            (settings.commands_stream, subjects.commands_filter),
            (settings.events_stream, subjects.events_filter),
            (settings.dlq_stream, subjects.dlq_filter),
        ):
            if f"stream {stream}" in gone:
                await self._ensure_stream(stream, subject)
        fresh = f"stream {settings.commands_stream}" in gone
        for lane, lanes in self._lanes().items():
            what = f"consumer {lane} on {settings.commands_stream}"
            if what in gone or fresh:
                await lanes.recreate(lane, fresh_stream=fresh)
                if what not in gone:
                    gone.append(what)
        command_consumer = f"consumer {settings.consumer_name} on {settings.commands_stream}"
        if not settings.lanes and (command_consumer in gone or fresh):
            # A new stream starts again at sequence 1: the old positions mean nothing there.
            if fresh:
                self._ack_floor = None
            resume = None if fresh else self._resume_from()
            await self._ensure_command_consumer(resume_from=resume)
            if command_consumer not in gone:
                gone.append(command_consumer)
        await self._ensure_tenant_consumers(settings.tenant_consumers)
        for stream in (settings.events_stream, settings.dlq_stream):
            if f"stream {stream}" in gone:
                gone += [f"consumer {tenant} on {stream}" for tenant in settings.tenant_consumers]
        for what in gone:
            log.warning("%s was missing; recreated it", what)
        for source in self._sources:
            source.retry_now()
        return gone

    def _lanes(self) -> dict[str, TenantCommandSource]:
        """The open lanes of this broker's per-tenant sources, by consumer name."""
        return {
            lane: source
            for source in self._sources
            if isinstance(source, TenantCommandSource)
            for lane in source.lanes
        }

    def _resume_from(self) -> int | None:
        points = [p for p in (source.resume_from for source in self._sources) if p is not None]
        if self._ack_floor is not None:
            points.append(self._ack_floor + 1)
        return min(points) if points else None

    async def _ensure_command_consumer(self, *, resume_from: int | None) -> None:
        """Create the command consumer (starting at ``resume_from``, else at the stream's
        start), or update an existing one, keeping where it starts."""
        await put_command_consumer(
            self.jetstream, self.settings.commands_stream, self.consumer_config(), start=resume_from
        )

    async def _ensure_tenant_consumers(self, tenants: tuple[str, ...]) -> None:
        """Each tenant's event consumer, and its dead-letter consumer (durable, named after
        the tenant, filtered to ``<prefix>.dlq.<tenant>``: the tenant reads why its
        commands were refused), where absent."""
        if not tenants:
            return
        settings = self.settings
        stream = settings.events_stream
        present = await self._consumer_names(stream)
        for tenant in tenants:
            if tenant not in present:
                consumer = DueEventConsumer(self, tenant, tenant_id=tenant)
                await self.jetstream.add_consumer(stream, consumer.consumer_config())
                log.info("created consumer %s on %s for tenant %s", tenant, stream, tenant)
        present = await self._consumer_names(settings.dlq_stream)
        for tenant in tenants:
            if tenant not in present:
                config = ConsumerConfig(
                    name=tenant,
                    durable_name=tenant,
                    description=f"dead letters of tenant {tenant}",
                    deliver_policy=DeliverPolicy.ALL,
                    ack_policy=AckPolicy.EXPLICIT,
                    filter_subject=settings.subjects.dlq(TenantId(tenant)),
                )
                await self.jetstream.add_consumer(settings.dlq_stream, config)
                log.info("created consumer %s on %s", tenant, settings.dlq_stream)

    async def _consumer_names(self, stream: str) -> set[str]:
        """The names of every consumer on ``stream`` (one request per 1024)."""
        names: set[str] = set()
        while True:
            request = json.dumps({"offset": len(names)}).encode()
            answer = await self.client.request(
                f"$JS.API.CONSUMER.NAMES.{stream}", request, timeout=self.settings.ack_timeout_s
            )
            body = json.loads(answer.data)
            error = body.get("error")
            if error is not None:
                nats.js.errors.APIError.from_error(error)  # raises NotFoundError and the like
            page = body.get("consumers") or []
            names.update(page)
            if not page or len(names) >= body.get("total", 0) or len(page) < _NAMES_PAGE:
                return names

    def stream_config(self, name: str, subject: str) -> StreamConfig:
        """The configuration provisioning gives a stream: file storage, limits retention; the
        commands stream with the shortest duplicate window (:data:`COMMANDS_DUPLICATE_WINDOW_S`),
        the others with :attr:`~NatsSettings.duplicate_window_s`."""
        settings = self.settings
        commands = name == settings.commands_stream
        config = StreamConfig(
            name=name,
            subjects=[subject],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            num_replicas=settings.stream_replicas,
            duplicate_window=(
                COMMANDS_DUPLICATE_WINDOW_S if commands else settings.duplicate_window_s
            ),
            max_age=settings.stream_max_age_s,
        )
        if commands and settings.lanes and settings.max_queued_per_tenant is not None:
            # A tenant's subject full: its next publish is refused, nothing is dropped.
            config.max_msgs_per_subject = settings.max_queued_per_tenant
            config.discard = DiscardPolicy.NEW
            config.discard_new_per_subject = True
        elif name == settings.dlq_stream and settings.max_dead_letters_per_tenant is not None:
            config.max_msgs_per_subject = settings.max_dead_letters_per_tenant
        return config

    def consumer_config(self) -> ConsumerConfig:
        """The shared durable pull consumer (see :func:`command_consumer_config`)."""
        settings = self.settings
        return command_consumer_config(
            settings,
            name=settings.consumer_name,
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
        if name != self.settings.commands_stream and (existing.duplicate_window or 0) < min(
            _CONTRACT_DUPLICATE_WINDOW_S, self.settings.duplicate_window_s
        ):
            log.warning(
                "stream %s has a duplicate window of %ss, under the %ss re-publishes rely on",
                name,
                existing.duplicate_window,
                self.settings.duplicate_window_s,
            )
