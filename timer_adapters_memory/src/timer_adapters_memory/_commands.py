"""A command source fed by the test: raw messages in, decoded batches to the handler, acks out."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Awaitable

from timer_adapters_memory._waits import DEFAULT_TIMEOUT_S, within
from timer_core import (
    Clock,
    Command,
    CommandBatchHandler,
    CommandSource,
    DecodeError,
    Instrumentation,
    MessageEnvelope,
    SystemClock,
    rejection_reason,
)
from timer_core.codec import decode_command, encode_envelope
from timer_core.instrumentation import NO_INSTRUMENTATION

__all__ = ["MemoryCommandSource"]

log = logging.getLogger(__name__)


class MemoryCommandSource(CommandSource):
    """An in-memory :class:`~timer_core.ports.CommandSource` with a broker's delivery rules.

    :meth:`send` queues a raw message (bytes, text or an envelope, which is encoded).
    :meth:`run` decodes each with :func:`timer_core.codec.decode_command`: an undecodable one
    lands in :attr:`dead_letters` as ``(raw, reason)`` and never reaches the handler; valid
    ones are handed over in batches, in arrival order, and recorded in :attr:`acked` once
    the handler returned (those it refused, ``OVER_QUOTA``, go to :attr:`dead_letters`
    with :func:`timer_core.rejection_reason` instead). If the handler raises, the same
    batch is redelivered after ``redelivery_delay`` seconds on ``clock``, before anything
    sent later.
    """

    def __init__(
        self,
        *,
        batch_size: int = 100,
        redelivery_delay: float = 0.05,
        clock: Clock | None = None,
        subject_prefix: str = "timer",
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._batch_size = batch_size
        self._redelivery_delay = redelivery_delay
        self._clock = clock or SystemClock()
        self._prefix = subject_prefix
        self._instrumentation = instrumentation
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[bytes, str]] = collections.deque()
        self._retry: list[MessageEnvelope[Command]] = []
        self._in_flight = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._stop = asyncio.Event()
        self.acked: list[MessageEnvelope[Command]] = []
        """Commands whose batch the handler completed, in the order they were acked."""
        self.dead_letters: list[tuple[bytes, str]] = []
        """Messages that failed to decode, with the one-line reason."""
        self.deliveries = 0
        """How many batches were handed to the handler, redeliveries included."""

    def send(
        self, data: bytes | str | MessageEnvelope[Command], subject: str | None = None
    ) -> None:
        """Queue one raw message, as if a producer published it on ``subject``.

        ``subject`` defaults to ``<prefix>.commands.<tenantId>`` for an envelope, else
        ``<prefix>.commands._``. Safe to call from any thread.
        """
        if isinstance(data, MessageEnvelope):
            subject = subject or f"{self._prefix}.commands.{data.tenant_id}"
            raw = encode_envelope(data)
        else:
            raw = data.encode() if isinstance(data, str) else bytes(data)
        subject = subject or f"{self._prefix}.commands._"
        with self._lock:
            self._queue.append((raw, subject))
            loop = self._loop
        try:
            on_loop = loop is None or asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or loop is None:
            self._on_arrival()
        else:
            loop.call_soon_threadsafe(self._on_arrival)

    def _on_arrival(self) -> None:
        self._drained.clear()
        self._arrived.set()

    @property
    def pending(self) -> int:
        """Messages not yet acked or dead-lettered (queued or awaiting redelivery)."""
        with self._lock:
            return len(self._queue) + len(self._retry)

    async def wait_until_drained(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        """Return once every message sent so far is acked or dead-lettered.

        Raises :class:`~timer_core.errors.WaitTimedOut` after ``timeout`` real seconds (None:
        wait forever), saying how many are pending: is the source running (a started Timer)?
        """
        await within(
            self._drained.wait(),
            timeout,
            lambda: (
                f"waited for the command source to drain; {self.pending} command(s) pending, "
                f"{self.deliveries} batch deliveries so far, running: {self._loop is not None}"
            ),
        )

    async def stop(self) -> None:
        """Make :meth:`run` return after the batch in flight; it cannot be restarted."""
        self._stop.set()

    async def run(self, handler: CommandBatchHandler) -> None:
        if self._loop is not None:
            raise RuntimeError("this command source is already running")
        self._loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set():
                batch = self._retry or self._take_batch()
                if not batch:
                    with self._lock:
                        idle = not self._queue
                    if idle:
                        self._drained.set()
                        self._arrived.clear()
                        await _first(self._arrived.wait(), self._stop.wait())
                    continue
                await self._deliver(handler, batch)
        finally:
            self._loop = None

    def _take_batch(self) -> list[MessageEnvelope[Command]]:
        """Decode up to a batch of queued messages; dead-letter the undecodable ones."""
        with self._lock:
            raws = [self._queue.popleft() for _ in range(min(self._batch_size, len(self._queue)))]
        batch: list[MessageEnvelope[Command]] = []
        for raw, subject in raws:
            try:
                batch.append(decode_command(raw))
            except DecodeError as exc:
                log.warning("dead-lettered a command on %s: %s", subject, exc)
                self.dead_letters.append((raw, str(exc)))
                self._instrumentation.command_rejected(subject, str(exc))
        return batch

    async def _deliver(
        self, handler: CommandBatchHandler, batch: list[MessageEnvelope[Command]]
    ) -> None:
        self.deliveries += 1
        try:
            outcomes = await handler(batch)
        except Exception as exc:
            # Not acked: the broker would redeliver it after its ack wait.
            log.warning("command batch of %d not acked (%s); redelivering", len(batch), exc)
            self._retry = batch
            await _first(self._clock.sleep(self._redelivery_delay), self._stop.wait())
            return
        self._retry = []
        for envelope, outcome in zip(batch, outcomes, strict=True):
            reason = rejection_reason(envelope, outcome)
            if reason is None:
                self.acked.append(envelope)
            else:  # refused by the handler (over a quota): dead-lettered, not acked
                log.warning("dead-lettered a command of %s: %s", envelope.tenant_id, reason)
                self.dead_letters.append((encode_envelope(envelope), reason))


async def _first(*waits: Awaitable[object]) -> None:
    """Wait for the first of several awaitables, cancelling the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
