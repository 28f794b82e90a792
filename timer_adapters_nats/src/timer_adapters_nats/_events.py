"""Events out, read by a host: ``DueTimeReached`` from a durable JetStream consumer, decoded.

A host's own service iterates :class:`DueEventConsumer` (from :meth:`NatsBroker.due_events`)
and settles each :class:`DueEventDelivery`: acked when handled, nak'd with a growing delay
when the handling failed, so JetStream redelivers it; a malformed event is terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Literal, Self

import attrs
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from timer_adapters_nats._connection import (
    JETSTREAM_MISSING,
    NatsConnection,
    jetstream_unavailable,
)
from timer_adapters_nats._pull import PullBatches, PullError, Settlement, settle
from timer_adapters_nats._settings import at_least_one, check_name, doubling_delay, positive
from timer_core import (
    AsyncResource,
    DecodeError,
    DueTimeReached,
    EnvelopeId,
    MessageEnvelope,
    NotRunning,
    ServiceCallId,
    TenantId,
    TimerError,
    ValidationError,
)
from timer_core.codec import decode_event

__all__ = ["DueEventConsumer", "DueEventConsumerSettings", "DueEventDelivery"]

log = logging.getLogger(__name__)

_DELIVER_POLICIES = {"all": DeliverPolicy.ALL, "new": DeliverPolicy.NEW}


def _max_deliver(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value != -1 and value < 1:
        raise ValidationError(f"max_deliver must be -1 (unlimited) or at least 1, got {value!r}")


@attrs.frozen
class DueEventConsumerSettings:
    """How a host's durable consumer of ``DueTimeReached`` is provisioned and read.

    Times are in seconds. The consumer acknowledges explicitly (each event is acked, nak'd
    or terminated one by one); nothing else is offered, as anything else could lose events.
    """

    provision: bool = True
    """Create the durable consumer when absent, and update its configuration when present."""
    deliver_policy: Literal["all", "new"] = attrs.field(
        default="all", validator=attrs.validators.in_(("all", "new"))
    )
    """Where a consumer created now starts: every event the stream still holds (``all``),
    or only those published from now on (``new``). An existing consumer keeps its place."""
    ack_wait_s: float = attrs.field(default=30.0, validator=positive)
    """Time the server gives an event handed out before it redelivers it. Events being
    handled in ``async with delivery:`` or waiting in the fetched batch are kept alive."""
    max_deliver: int = attrs.field(default=-1, validator=_max_deliver)
    """Deliveries of one event before the server gives up on it; -1 is unlimited."""
    max_ack_pending: int = attrs.field(default=1000, validator=at_least_one)
    """Most events handed out and not yet settled, across every reader of the consumer."""
    nak_delay_s: float = attrs.field(default=1.0, validator=positive)
    """Redelivery delay after the first failed handling; it doubles with each delivery."""
    max_nak_delay_s: float = attrs.field(default=60.0, validator=positive)
    """Cap of the doubling redelivery delay."""
    fetch_batch: int = attrs.field(default=16, validator=at_least_one)
    """Most events fetched from the server at once (handed out one by one)."""
    fetch_timeout_s: float = attrs.field(default=1.0, validator=positive)
    """Long-poll time of one fetch (``stop()`` and leaving ``async with`` end it at once)."""

    def nak_delay(self, delivery: int) -> float:
        """Redelivery delay after the ``delivery``-th delivery of an event failed."""
        return doubling_delay(self.nak_delay_s, self.max_nak_delay_s, delivery)


class DueEventDelivery:
    """One delivery of a ``DueTimeReached`` event, to be settled exactly once.

    ``async with delivery:`` acks it when the block ends normally; when the block raises an
    :class:`Exception`, it is nak'd (redelivered after :meth:`DueEventConsumerSettings.nak_delay`),
    the exception is logged with its traceback and *suppressed*, so the consumer loop goes
    on. While the block runs, the server is told the event is in progress, so a handling
    longer than the ack wait is not redelivered meanwhile. Settling explicitly inside the
    block (:meth:`ack`, :meth:`nak`, :meth:`term`) takes precedence; later settles are no-ops.

    The same event can arrive twice (at least once delivery: a lost ack, a crash of the
    handler, the timer service re-publishing after a crash): :attr:`id` is the same on every
    copy, so a handler deduplicates on it; :attr:`redelivered` says the server handed this
    one out before.
    """

    def __init__(
        self,
        message: Msg,
        envelope: MessageEnvelope[DueTimeReached],
        consumer: DueEventConsumer,
    ) -> None:
        self._message = message
        self._consumer = consumer
        self._keep_alive: asyncio.Task[None] | None = None
        self.envelope = envelope
        """The decoded envelope: id, timestamp, correlation id and the event."""
        self.settled: Settlement | None = None
        """How it was settled, or None while it is not."""

    @property
    def event(self) -> DueTimeReached:
        """The ``DueTimeReached`` payload: tenant, service call, ``due_at``, ``reached_at``."""
        return self.envelope.payload

    @property
    def id(self) -> EnvelopeId:
        """The envelope id: equal on every copy of the same firing (deduplicate on it)."""
        return self.envelope.id

    @property
    def num_delivered(self) -> int:
        """How many times the server has handed this event to the consumer (1 the first time)."""
        return int(self._message.metadata.num_delivered)

    @property
    def redelivered(self) -> bool:
        """Whether the server handed this event out before (a nak, an ack wait expired)."""
        return self.num_delivered > 1

    @property
    def stream_sequence(self) -> int:
        """The event's sequence number in the events stream."""
        return int(self._message.metadata.sequence.stream)

    @property
    def subject(self) -> str:
        """The subject it was published on: ``<prefix>.events.<tenantId>.<serviceCallId>``."""
        return self._message.subject

    async def ack(self) -> None:
        """Done with it: the server will not deliver it again (unless this ack is lost)."""
        await self._settle("ack")

    async def nak(self, delay: float | None = None) -> None:
        """Not handled: redeliver after ``delay`` seconds (default: the growing nak delay)."""
        if delay is None:
            delay = self._consumer.settings.nak_delay(self.num_delivered)
        await self._settle("nak", delay)

    async def term(self) -> None:
        """Never deliver it again, though it was not handled (a poison event)."""
        await self._settle("term")

    async def in_progress(self) -> None:
        """Reset the server's ack wait for it: the handling takes longer than ``ack_wait_s``."""
        if self.settled is None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._message.in_progress()

    async def __aenter__(self) -> Self:
        if self._keep_alive is None and self.settled is None:
            self._keep_alive = asyncio.create_task(self._keep_alive_loop())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        keep_alive, self._keep_alive = self._keep_alive, None
        if keep_alive is not None:
            keep_alive.cancel()
        if exc is None:
            await self.ack()
            return False
        if not isinstance(exc, Exception):  # cancellation, KeyboardInterrupt: hand it back now
            if self.settled is None:
                await self._settle("nak", 0.0)
            return False
        if self.settled is None:
            await self.nak()
        log.error(
            "handling DueTimeReached %s (%s/%s, delivery %d) failed; %s",
            self.id,
            self.event.tenant_id,
            self.event.service_call_id,
            self.num_delivered,
            "redelivery later" if self.settled == "nak" else f"settled: {self.settled}",
            exc_info=exc,
        )
        return True

    async def _keep_alive_loop(self) -> None:
        interval = max(0.1, self._consumer.ack_wait_s / 3)
        while self.settled is None:
            await asyncio.sleep(interval)
            await self.in_progress()

    async def _settle(self, how: Settlement, delay: float | None = None) -> None:
        if self.settled is not None:
            return
        self.settled = how
        await self._consumer._settle(self._message, how, delay)

    def __repr__(self) -> str:
        return (
            f"<DueEventDelivery {self.id} {self.event.tenant_id}/{self.event.service_call_id} "
            f"delivery {self.num_delivered}>"
        )


class DueEventConsumer(AsyncResource):
    """The ``DueTimeReached`` events of a durable JetStream consumer, decoded, one by one.

    Use it as ``async with broker.due_events("billing") as events: async for delivery in
    events: ...`` (or build it on any started :class:`NatsConnection`). Entering provisions
    the durable consumer ``name`` on the events stream (unless ``settings.provision`` is off)
    filtered to ``tenant_id``'s events when given, and subscribes; leaving hands the fetched
    but not yet handed out events straight back to the server and unsubscribes. The durable
    consumer stays on the server: the next ``async with`` (this process or another one, with
    the same name) resumes where this one stopped. Several readers of one name share its
    events (each event goes to one of them).

    An event that does not decode, or whose subject names another tenant or service call
    than its body, is terminated with a warning in the log: it cannot wedge the consumer.
    Disconnects and fetch errors are logged and retried; the iteration ends only when the
    ``async with`` block is left (or :meth:`stop` is called).
    """

    def __init__(
        self,
        connection: NatsConnection,
        name: str,
        *,
        tenant_id: str | None = None,
        settings: DueEventConsumerSettings | None = None,
    ) -> None:
        self.name = check_name("consumer name", name)
        self.tenant_id = None if tenant_id is None else TenantId(tenant_id)
        self.settings = settings if settings is not None else DueEventConsumerSettings()
        self._connection = connection
        self._subjects = connection.settings.subjects
        self._stream = connection.settings.events_stream
        self._puller: PullBatches | None = None
        self._ready: deque[Msg] = deque()  # fetched, not handed out yet
        self._stop = asyncio.Event()
        self._keep_alive: asyncio.Task[None] | None = None
        self.ack_wait_s = self.settings.ack_wait_s

    @property
    def filter_subject(self) -> str:
        """The subjects this consumer reads: one tenant's events, or all of them."""
        if self.tenant_id is None:
            return self._subjects.events_filter
        return f"{self._subjects.prefix}.events.{self.tenant_id}.>"

    def consumer_config(self) -> ConsumerConfig:
        """The durable pull consumer provisioning creates: explicit acks, the settings' limits."""
        settings = self.settings
        return ConsumerConfig(
            name=self.name,
            durable_name=self.name,
            description="DueTimeReached events read by a Timer host",
            deliver_policy=_DELIVER_POLICIES[settings.deliver_policy],
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=settings.ack_wait_s,
            max_deliver=settings.max_deliver,
            max_ack_pending=settings.max_ack_pending,
            filter_subject=self.filter_subject,
        )

    async def start(self) -> None:
        """Provision (when asked to) and subscribe; idempotent.

        Raises :class:`TimerError` when the events stream or (with provisioning off) the
        consumer does not exist or the consumer's configuration cannot be changed to this
        one, :class:`~timer_adapters_nats.BrokerUnavailable` when JetStream does not answer, and
        :class:`~timer_core.errors.NotRunning` when the connection is not started. With
        provisioning off, a consumer of another account (the per-tenant account recipe, whose
        tenants may pull from their consumer but have no JetStream API) is checked by a first
        pull instead of its info; the consumer's ack wait is then taken to be
        ``settings.ack_wait_s``.
        """
        if self._puller is not None:
            return
        js = self._connection.jetstream
        info: ConsumerInfo | None = None
        try:
            if self.settings.provision:
                await js.add_consumer(self._stream, self.consumer_config())
            info = await js.consumer_info(self._stream, self.name)
        except nats.js.errors.NotFoundError as exc:
            raise TimerError(
                f"cannot read DueTimeReached: stream {self._stream} or its consumer {self.name} "
                f"does not exist ({exc.description or exc})"
            ) from exc
        except JETSTREAM_MISSING as exc:
            if self.settings.provision:
                raise jetstream_unavailable(exc, self._connection.settings.url) from exc
            # No JetStream API here: the consumer is another account's, which lets this one
            # pull from it and ack (the per-tenant account recipe). The first pull tells.
            log.debug("consumer info of %s/%s unavailable (%s)", self._stream, self.name, exc)
        except nats.js.errors.APIError as exc:
            # e.g. a deliver policy an existing durable consumer cannot change to
            raise TimerError(
                f"cannot provision consumer {self.name} on {self._stream}: "
                f"{exc.description or exc} (delete the consumer to change that setting, "
                "or use another name)"
            ) from exc
        self.ack_wait_s = (
            info.config.ack_wait if info is not None and info.config.ack_wait else None
        ) or self.settings.ack_wait_s
        self._stop.clear()
        puller = PullBatches(self._connection.client, stream=self._stream, consumer=self.name)
        await puller.start()
        if info is None:
            try:
                first = await puller.fetch_now(
                    self.settings.fetch_batch, self._connection.settings.ack_timeout_s
                )
            except PullError as exc:
                await puller.aclose()
                raise TimerError(
                    f"cannot read DueTimeReached: consumer {self.name} on {self._stream} "
                    f"does not answer ({exc}): it does not exist, or this user may not "
                    "read it"
                ) from exc
            self._ready.extend(first)
        self._puller = puller
        self._keep_alive = asyncio.create_task(self._keep_held_alive())

    async def stop(self) -> None:
        """End the iteration: a pending ``__anext__`` stops waiting for events at once."""
        self._stop.set()
        if self._puller is not None:
            self._puller.interrupt()

    async def aclose(self) -> None:
        """Hand back the events fetched but not handed out, and unsubscribe; idempotent."""
        self._stop.set()
        puller, self._puller = self._puller, None
        keep_alive, self._keep_alive = self._keep_alive, None
        if keep_alive is not None:
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive
        if puller is None:
            return
        left = [*self._ready, *await puller.finish()]
        self._ready.clear()
        for message in left:
            await self._settle(message, "nak", 0.0)
        with contextlib.suppress(Exception):
            if self._connection.is_connected:
                await self._connection.client.flush(timeout=2)
        await puller.aclose()

    def __aiter__(self) -> AsyncIterator[DueEventDelivery]:
        return self

    async def __anext__(self) -> DueEventDelivery:
        failures = 0
        while not self._stop.is_set():
            puller = self._puller
            if puller is None:
                raise NotRunning("DueEventConsumer is not started: use `async with`")
            if not self._ready:
                try:
                    fetched = await puller.fetch(
                        self.settings.fetch_batch, self.settings.fetch_timeout_s
                    )
                except Exception as exc:  # a disconnect or a server error: back off, go on
                    failures += 1
                    delay = min(5.0, 0.1 * 2 ** min(failures - 1, 6))
                    log.warning(
                        "fetching DueTimeReached from %s/%s failed (%s); retrying in %.1fs",
                        self._stream,
                        self.name,
                        exc or type(exc).__name__,
                        delay,
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
                    continue
                failures = 0
                self._ready.extend(fetched)
                if self._stop.is_set():
                    break
            while self._ready:
                message = self._ready.popleft()
                envelope = await self._decode(message)
                if envelope is not None:
                    return DueEventDelivery(message, envelope, self)
        raise StopAsyncIteration

    async def _decode(self, message: Msg) -> MessageEnvelope[DueTimeReached] | None:
        """The envelope, or None once a malformed event has been terminated and logged."""
        try:
            envelope = decode_event(message.data)
            self._check_subject(message.subject, envelope)
        except (DecodeError, ValueError) as exc:
            await self._settle(message, "term")
            log.warning(
                "terminated malformed DueTimeReached seq %s on %s (consumer %s): %s",
                message.metadata.sequence.stream,
                message.subject,
                self.name,
                exc,
            )
            return None
        return envelope

    def _check_subject(self, subject: str, envelope: MessageEnvelope[DueTimeReached]) -> None:
        event = envelope.payload
        head = f"{self._subjects.prefix}.events."
        tenant, _, call = subject[len(head) :].partition(".")
        if (
            not subject.startswith(head)
            or TenantId(tenant) != event.tenant_id
            or ServiceCallId(call) != event.service_call_id
        ):
            raise DecodeError(
                "tenantId",
                f"the subject {subject!r} does not name the event's tenant "
                f"{str(event.tenant_id)!r} and service call {str(event.service_call_id)!r}",
            )

    async def _keep_held_alive(self) -> None:
        """Keep the fetched events not handed out yet from redelivery while they wait."""
        interval = max(0.1, self.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for message in list(self._ready):
                with contextlib.suppress(nats.errors.Error, OSError):
                    await message.in_progress()

    async def _settle(self, message: Msg, how: Settlement, delay: float | None = None) -> None:
        await settle(message, how, delay=delay or None, what="DueTimeReached")
