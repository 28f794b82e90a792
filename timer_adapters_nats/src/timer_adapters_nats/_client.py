"""The host's side of Timer: send ``ScheduleTimer`` and ``CancelTimer`` commands over JetStream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client

from timer_adapters_nats._acked import AckedPublisher, Outgoing
from timer_adapters_nats._connection import NatsConnection, close_client, connect
from timer_adapters_nats._settings import Subjects
from timer_adapters_nats._tracing import current_trace_context
from timer_core import (
    CancelTimer,
    Clock,
    Command,
    EnvelopeId,
    EnvelopeIdGenerator,
    MessageEnvelope,
    PublishError,
    ScheduleTimer,
    ServiceCallId,
    SystemClock,
    TenantId,
    TraceContext,
    Uuid7EnvelopeIds,
    command_envelope,
)
from timer_core.codec import encode_envelope

__all__ = ["TimerClient"]

_C = TypeVar("_C", ScheduleTimer, CancelTimer)
#: What :meth:`TimerClient.send` accepts: any command envelope.
CommandEnvelope = (
    MessageEnvelope[ScheduleTimer] | MessageEnvelope[CancelTimer] | MessageEnvelope[Command]
)


class TimerClient:
    """Schedules and cancels timers by publishing commands to ``<prefix>.commands.<tenantId>``.

    Each call fills in a fresh UUID v7 envelope id (sent without a ``Nats-Msg-Id``: the
    commands stream's duplicate window spans tenants, so another tenant's id could drop the
    command; a retried send may be stored twice and changes nothing more), ``timestampMs``
    from ``clock``,
    ``aggregateId`` (the service call id), and returns the envelope id once JetStream acked
    the command. The correlation id defaults to that envelope id, starting a new trace.
    ``schedule`` also sends the caller's current W3C trace context (``traceparent`` and
    ``tracestate`` headers) when OpenTelemetry is installed and a span is active, so the
    ``DueTimeReached`` can be linked to it; otherwise the command is sent without. A
    failed or unacknowledged send raises :class:`~timer_core.errors.PublishError`; invalid
    ids or a naive or out-of-range ``due_at`` raise
    :class:`~timer_core.errors.ValidationError` before anything is sent. It implements
    :class:`timer_core.TimerScheduler`, as ``MemoryTimerClient`` does for a host's tests.

    ``connection`` is a started :class:`~timer_adapters_nats.NatsConnection` (a
    :class:`~timer_adapters_nats.NatsBroker` is one), whose subject prefix is the default,
    or a connected nats-py ``Client``.
    """

    def __init__(
        self,
        connection: Client | NatsConnection,
        *,
        subject_prefix: str | None = None,
        ack_timeout_s: float = 5.0,
        publish_window: int = 256,
        clock: Clock | None = None,
        ids: EnvelopeIdGenerator | None = None,
    ) -> None:
        if isinstance(connection, NatsConnection):
            nc = connection.client
            subject_prefix = subject_prefix or connection.settings.subject_prefix
        else:
            nc = connection
        self.subjects = Subjects(subject_prefix or "timer")
        self._publisher = AckedPublisher(nc, window=publish_window, ack_timeout_s=ack_timeout_s)
        self._clock = clock or SystemClock()
        self._ids = ids or Uuid7EnvelopeIds()

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        url: str,
        *,
        subject_prefix: str = "timer",
        connect_timeout_s: float = 5.0,
        ack_timeout_s: float = 5.0,
        publish_window: int = 256,
        clock: Clock | None = None,
        ids: EnvelopeIdGenerator | None = None,
        name: str = "timer-client",
        tls_ca_file: Path | str | None = None,
        tls_cert_file: Path | str | None = None,
        tls_key_file: Path | str | None = None,
        creds_file: Path | str | None = None,
        nkey_seed_file: Path | str | None = None,
        token: str | None = None,
        inbox_prefix: str = "_INBOX",
    ) -> AsyncIterator[TimerClient]:
        """Connect to ``url`` (reconnecting once connected), yield a client, then close.

        The TLS, authentication and inbox arguments mean what they mean on
        :class:`~timer_adapters_nats.NatsSettings` (``**settings.security_options()`` passes
        a settings object's). Raises :class:`~timer_adapters_nats.BrokerUnavailable` naming
        the URL (its secrets redacted) when the server cannot be reached within
        ``connect_timeout_s`` or refuses the credentials.
        """
        nc = await connect(
            url,
            connect_timeout_s=connect_timeout_s,
            name=name,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            creds_file=creds_file,
            nkey_seed_file=nkey_seed_file,
            token=token,
            inbox_prefix=inbox_prefix,
        )
        try:
            yield cls(
                nc,
                subject_prefix=subject_prefix,
                ack_timeout_s=ack_timeout_s,
                publish_window=publish_window,
                clock=clock,
                ids=ids,
            )
        finally:
            await close_client(nc)

    def schedule_envelope(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_context: TraceContext | None = None,
    ) -> MessageEnvelope[ScheduleTimer]:
        """The ``ScheduleTimer`` envelope :meth:`schedule` would send (validated).

        ``trace_context`` defaults to the caller's current one (see the class docstring).
        """
        payload = ScheduleTimer(TenantId(tenant_id), ServiceCallId(service_call_id), due_at)
        if trace_context is None:
            trace_context = current_trace_context()
        return self._envelope(payload, correlation_id, causation_id, trace_context)

    def cancel_envelope(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> MessageEnvelope[CancelTimer]:
        """The ``CancelTimer`` envelope :meth:`cancel` would send (validated)."""
        payload = CancelTimer(TenantId(tenant_id), ServiceCallId(service_call_id))
        return self._envelope(payload, correlation_id, causation_id)

    def _envelope(
        self,
        payload: _C,
        correlation_id: str | None,
        causation_id: str | None,
        trace_context: TraceContext | None = None,
    ) -> MessageEnvelope[_C]:
        return command_envelope(
            payload,
            self._ids.new_id(),
            self._clock.now(),
            correlation_id=correlation_id,
            causation_id=causation_id,
            trace_context=trace_context,
        )

    async def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_context: TraceContext | None = None,
    ) -> EnvelopeId:
        """Ask for ``DueTimeReached`` at ``due_at`` (aware datetime); a later call reschedules."""
        envelope = self.schedule_envelope(
            tenant_id,
            service_call_id,
            due_at,
            correlation_id=correlation_id,
            causation_id=causation_id,
            trace_context=trace_context,
        )
        return await self.send(envelope)

    async def cancel(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> EnvelopeId:
        """Cancel the timer if it has not fired yet (a no-op otherwise)."""
        envelope = self.cancel_envelope(
            tenant_id, service_call_id, correlation_id=correlation_id, causation_id=causation_id
        )
        return await self.send(envelope)

    async def send(self, envelope: CommandEnvelope) -> EnvelopeId:
        """Publish a prepared command envelope and wait for its ack; returns its id."""
        await self._publisher.publish(self._outgoing(envelope))
        return envelope.id

    async def send_many(self, envelopes: Sequence[CommandEnvelope]) -> list[PublishError | None]:
        """Publish many commands with several acks in flight; one result per envelope.

        Commands for the same timer keep their order only if they are in one call (or sent
        one after the other): they are published in sequence on one connection.
        """
        return await self._publisher.publish_many([self._outgoing(e) for e in envelopes])

    def _outgoing(self, envelope: CommandEnvelope) -> Outgoing:
        trace_context = envelope.trace_context
        # No Nats-Msg-Id: the commands stream deduplicates across every tenant's subject, so
        # an id another tenant published first would make JetStream drop this command (with
        # a PubAck that says duplicate). A command is idempotent by its timer's key, so a
        # retried send stored twice applies the same change twice (docs/design.md).
        return Outgoing(
            subject=self.subjects.commands(envelope.tenant_id),
            data=encode_envelope(envelope),
            msg_id=str(envelope.id),
            headers={} if trace_context is None else trace_context.headers(),
            deduplicate=False,
        )
