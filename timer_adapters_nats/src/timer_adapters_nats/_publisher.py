"""Events out: ``DueTimeReached`` published to JetStream, deduplicated on the envelope id."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from timer_adapters_nats._acked import MSG_ID, AckedPublisher, Frame
from timer_adapters_nats._connection import NatsConnection
from timer_core import DueTimeReached, EventPublisher, MessageEnvelope, PublishError
from timer_core.codec import encode_envelope

__all__ = ["NatsEventPublisher"]

log = logging.getLogger(__name__)


class NatsEventPublisher(EventPublisher):
    """Publishes ``DueTimeReached`` to ``<prefix>.events.<tenantId>.<serviceCallId>``.

    The body is the contract's JSON, the ``Nats-Msg-Id`` header the envelope id, so a
    re-publish of the same firing within the stream's duplicate window is stored once. An
    envelope's ``trace_context`` goes out as ``traceparent``/``tracestate`` headers. Uses
    the :class:`NatsConnection` it is given (a :class:`NatsBroker` is one); :meth:`start` and
    :meth:`aclose` are no-ops. Each envelope's result is known as its own acknowledgement
    comes back (:meth:`publish_each`); a publish the server refuses (a permissions violation
    on its subject) fails with the server's words as soon as the server says so.
    """

    def __init__(self, connection: NatsConnection) -> None:
        self._connection = connection
        self._subjects = connection.settings.subjects
        self._acked: AckedPublisher | None = None
        connection.on_server_error(self._server_error)

    def _server_error(self, error: Exception) -> None:
        acked = self._acked
        if acked is not None:
            acked.refused(error)

    @property
    def keeps_call_order(self) -> bool:
        """True: one connection, and each call's messages leave before the next call's."""
        return True

    def _publisher(self) -> AckedPublisher:
        nc = self._connection.client
        if self._acked is None or self._acked.client is not nc:  # first use, or a new start()
            settings = self._connection.settings
            self._acked = AckedPublisher(
                nc, window=settings.publish_window, ack_timeout_s=settings.ack_timeout_s
            )
        return self._acked

    def _frame(self, envelope: MessageEnvelope[DueTimeReached]) -> Frame:
        payload = envelope.payload
        trace_context = envelope.trace_context
        msg_id = str(envelope.id)
        headers = {MSG_ID: msg_id}
        if trace_context is not None:
            headers = {**trace_context.headers(), MSG_ID: msg_id}
        return (
            self._subjects.events(payload.tenant_id, payload.service_call_id),
            encode_envelope(envelope),
            msg_id,
            headers,
        )

    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        results: list[PublishError | None] = [None] * len(envelopes)

        def told(index: int, error: PublishError | None) -> None:
            results[index] = error

        await self.publish_each(envelopes, told)
        failed = sum(result is not None for result in results)
        if failed:
            log.debug("%d of %d events not acknowledged", failed, len(envelopes))
        return results

    async def publish_each(
        self,
        envelopes: Sequence[MessageEnvelope[DueTimeReached]],
        done: Callable[[int, PublishError | None], None],
    ) -> None:
        """Tells each envelope's result as its own acknowledgement comes back (or its ack
        timeout passes, or the server refuses it): one missing ack holds back no other."""
        if not envelopes:
            return
        try:
            publisher = self._publisher()
        except Exception as exc:  # not started, or closed: every envelope failed
            for index, envelope in enumerate(envelopes):
                done(index, PublishError(f"{envelope.id}: {exc}"))
            return
        await publisher.publish_frames_each(envelopes, self._frame, done)
