"""``TimerClient`` for synchronous hosts (Django and Flask views, scripts, workers): the same
calls, blocking, over a connection whose event loop runs in a thread of the client's own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from timer_adapters_nats._client import CommandEnvelope, TimerClient
from timer_core import (
    CancelTimer,
    Clock,
    EnvelopeId,
    EnvelopeIdGenerator,
    MessageEnvelope,
    NotRunning,
    PublishError,
    ScheduleTimer,
    TraceContext,
)

__all__ = ["SyncTimerClient"]

_T = TypeVar("_T")


class SyncTimerClient:
    """Schedules and cancels timers from synchronous code, as :class:`TimerClient` does.

    ``SyncTimerClient.connect(url)`` connects (raising
    :class:`~timer_adapters_nats.BrokerUnavailable` as ``TimerClient.connect`` does) and
    returns a client to keep for the process's life (``close()`` at exit) or to use as
    ``with SyncTimerClient.connect(url) as timers:``. Its calls are ``TimerClient``'s, with
    the same arguments and results, each blocking until JetStream acked the command (or
    raising :class:`~timer_core.errors.PublishError`). The envelope is built in the calling
    thread, so the caller's OpenTelemetry span is the one sent along; the connection and its
    event loop live in a daemon thread of the client's own. Any number of threads may call
    one client at once.
    """

    def __init__(
        self,
        client: TimerClient,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        exit_stack: contextlib.AsyncExitStack,
    ) -> None:
        self._client = client
        self._loop = loop
        self._thread = thread
        self._exit_stack = exit_stack
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def connect(
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
    ) -> SyncTimerClient:
        """Connect to ``url`` and return a client; the arguments are ``TimerClient.connect``'s."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="timer-client", daemon=True)
        thread.start()
        exit_stack = contextlib.AsyncExitStack()
        connecting = TimerClient.connect(
            url,
            subject_prefix=subject_prefix,
            connect_timeout_s=connect_timeout_s,
            ack_timeout_s=ack_timeout_s,
            publish_window=publish_window,
            clock=clock,
            ids=ids,
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
            client = asyncio.run_coroutine_threadsafe(
                exit_stack.enter_async_context(connecting), loop
            ).result()
        except BaseException:
            _stop_loop(loop, thread)
            raise
        return cls(client, loop, thread, exit_stack)

    # -- TimerClient's calls, blocking -------------------------------------------------

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
        """The ``ScheduleTimer`` envelope :meth:`schedule` would send (validated)."""
        return self._client.schedule_envelope(
            tenant_id,
            service_call_id,
            due_at,
            correlation_id=correlation_id,
            causation_id=causation_id,
            trace_context=trace_context,
        )

    def cancel_envelope(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> MessageEnvelope[CancelTimer]:
        """The ``CancelTimer`` envelope :meth:`cancel` would send (validated)."""
        return self._client.cancel_envelope(
            tenant_id, service_call_id, correlation_id=correlation_id, causation_id=causation_id
        )

    def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_context: TraceContext | None = None,
    ) -> EnvelopeId:
        """Ask for ``DueTimeReached`` at ``due_at`` (aware datetime); a later call reschedules.
        Returns the envelope id once JetStream acked the command."""
        envelope = self.schedule_envelope(
            tenant_id,
            service_call_id,
            due_at,
            correlation_id=correlation_id,
            causation_id=causation_id,
            trace_context=trace_context,
        )
        return self.send(envelope)

    def cancel(
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
        return self.send(envelope)

    def send(self, envelope: CommandEnvelope) -> EnvelopeId:
        """Publish a prepared command envelope and wait for its ack; returns its id."""
        return self._run(self._client.send(envelope))

    def send_many(self, envelopes: Sequence[CommandEnvelope]) -> list[PublishError | None]:
        """Publish many commands with several acks in flight; one result per envelope."""
        return self._run(self._client.send_many(envelopes))

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the connection, then stop the client's thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._exit_stack.aclose(), self._loop).result()
        finally:
            _stop_loop(self._loop, self._thread)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, call: Coroutine[Any, Any, _T]) -> _T:
        if self._closed:
            call.close()
            raise NotRunning("this SyncTimerClient is closed: connect a new one")
        if threading.current_thread() is self._thread:
            call.close()
            raise NotRunning("a SyncTimerClient cannot be called from its own thread")
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
