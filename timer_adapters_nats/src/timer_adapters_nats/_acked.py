"""Acked JetStream publishing, many in flight at once: what every publisher of the adapter uses."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
from nats.aio.client import Client
from nats.aio.msg import Msg

from timer_core import PublishError

__all__ = ["MSG_ID", "AckedPublisher", "Frame", "Outgoing"]

MSG_ID = "Nats-Msg-Id"
_NO_RESPONDERS = "503"
_CHUNK = 128  # publishes written to the socket at once while the next ones are encoded
_T = TypeVar("_T")


@attrs.frozen
class Outgoing:
    """One message to publish to JetStream, deduplicated on ``msg_id`` (sent as
    ``Nats-Msg-Id``) unless ``deduplicate`` is False (``msg_id`` then only names it in
    errors)."""

    subject: str
    data: bytes
    msg_id: str
    headers: dict[str, str] = attrs.field(factory=dict)
    deduplicate: bool = True


Frame = tuple[str, bytes, str, dict[str, str]]
"""A message as :meth:`AckedPublisher.publish_frames` sends it: subject, data, its
``Nats-Msg-Id``, and its headers including that one."""

# (index in the call, subject, msg id, reply token, ack future, ack deadline)
_InFlight = tuple[int, str, str, str, asyncio.Future[None], float]


class _Refused(Exception):
    """JetStream answered the publish with an error instead of an ack."""


class AckedPublisher:
    """Publishes to JetStream with up to ``window`` acks outstanding; each ack is checked.

    All acks come back on one wildcard inbox subscription, matched to their message by a
    token (nats-py's own ``publish_async`` turns a refusal into a timeout, so it is not used).
    The oldest outstanding ack is awaited when the window is full; a stream acks in order, so
    this rarely waits longer than needed. A message counts as published only on a positive
    ack; a refusal, a timeout or a disconnect is a :class:`PublishError` for it alone.
    """

    def __init__(self, nc: Client, *, window: int, ack_timeout_s: float) -> None:
        self._nc = nc
        self._window = window
        self._refill = max(1, window // 4)
        self._ack_timeout_s = ack_timeout_s
        self._inbox: str | None = None
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._tokens = itertools.count()
        self._subscribing = asyncio.Lock()
        # One call's messages all leave before the next call's: concurrent calls (a drain
        # sends the next batch while this one's acks come back) keep their order on the wire.
        self._sending = asyncio.Lock()

    @property
    def client(self) -> Client:
        """The connection it publishes on."""
        return self._nc

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[PublishError | None]:
        """Publish all, ``window`` at a time; one result per message, in order, never raises."""
        return await self.publish_each(messages, _itself)

    async def publish_each(
        self, items: Sequence[_T], build: Callable[[_T], Outgoing]
    ) -> list[PublishError | None]:
        """Like :meth:`publish_many`, building each message (encoding it) just before it goes.

        Messages leave in chunks while the next ones are built, so the server stores and
        acks the first while the client still encodes the rest.
        """
        return await self.publish_frames(items, lambda item: _frame(build(item)))

    async def publish_frames(
        self, items: Sequence[_T], frame: Callable[[_T], Frame]
    ) -> list[PublishError | None]:
        """Like :meth:`publish_each`, with ``frame`` making each message as a :data:`Frame`
        (its headers already holding ``Nats-Msg-Id``): no :class:`Outgoing` per message, for
        the publishers of many small messages (the fire path)."""
        results: list[PublishError | None] = [None] * len(items)
        in_flight: deque[_InFlight] = deque()
        loop = asyncio.get_running_loop()
        nc = self._nc
        waiting = self._waiting
        tokens = self._tokens
        window = self._window
        timeout = self._ack_timeout_s
        unflushed = 0
        async with self._sending:
            inbox = self._inbox or await self._subscribe()
            for index, item in enumerate(items):
                if len(in_flight) >= window:
                    # Wait until a quarter of the window is acked, not for one ack per wake-up:
                    # the stream acks in order, so that many slots then refill in one go.
                    await self._await_ack(in_flight, min(len(in_flight), self._refill))
                    while in_flight and (in_flight[0][4].done() or len(in_flight) >= window):
                        oldest = in_flight.popleft()
                        results[oldest[0]] = await self._settle(oldest)
                try:
                    subject, data, msg_id, headers = frame(item)
                except Exception as exc:  # cannot even be encoded: that one fails
                    results[index] = PublishError(f"message {index} of the batch: {exc}")
                    continue
                if not nc.is_connected:
                    # Reconnecting: fail now rather than buffer and time out one by one.
                    results[index] = PublishError(f"{msg_id} to {subject}: not connected to NATS")
                    continue
                token = str(next(tokens))
                future: asyncio.Future[None] = loop.create_future()
                waiting[token] = future
                try:
                    await nc.publish(subject, data, reply=inbox + token, headers=headers)
                except BaseException as exc:
                    del waiting[token]
                    if not isinstance(exc, Exception):
                        raise
                    # One message's failure never fails the others.
                    results[index] = _publish_error(msg_id, subject, exc)
                    continue
                in_flight.append((index, subject, msg_id, token, future, loop.time() + timeout))
                unflushed += 1
                if unflushed >= _CHUNK:
                    unflushed = 0
                    await asyncio.sleep(0)  # the connection's flusher writes this chunk now
        # One wait for the last ack rather than one per message still in flight.
        await self._await_ack(in_flight, len(in_flight))
        while in_flight:
            oldest = in_flight.popleft()
            future = oldest[4]
            if future.done() and not future.cancelled() and future.exception() is None:
                continue  # acked: the common case, without a wait
            results[oldest[0]] = await self._settle(oldest)
        return results

    @staticmethod
    async def _await_ack(in_flight: deque[_InFlight], count: int) -> None:
        """Wait until the ``count``-th oldest message is acked, at most until the oldest's
        deadline. Never cancels the ack it waits for (``asyncio.wait``, not ``wait_for``)."""
        if count < 1:
            return
        future = in_flight[count - 1][4]
        if not future.done():
            timeout = in_flight[0][5] - asyncio.get_running_loop().time()
            await asyncio.wait((future,), timeout=max(0.0, timeout))

    async def publish(self, message: Outgoing) -> None:
        """Publish one and wait for its ack; raises :class:`PublishError` unless acked."""
        (error,) = await self.publish_many([message])
        if error is not None:
            raise error

    async def _subscribe(self) -> str:
        async with self._subscribing:
            if self._inbox is None:
                inbox = self._nc.new_inbox() + "."
                await self._nc.subscribe(inbox + "*", cb=self._on_ack)
                self._inbox = inbox
        return self._inbox

    async def _on_ack(self, msg: Msg) -> None:
        assert self._inbox is not None
        future = self._waiting.pop(msg.subject[len(self._inbox) :], None)
        if future is None or future.done():
            return  # answered after its timeout
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            future.set_exception(_Refused("no stream is bound to this subject"))
            return
        data = msg.data
        if b'"seq"' in data and b'"error"' not in data:
            future.set_result(None)  # the common case, without a JSON parse per ack
            return
        try:
            answer = json.loads(data)
            error = answer.get("error")
            if error is not None:
                future.set_exception(
                    _Refused(f"{error.get('description')} (error {error.get('err_code')})")
                )
            elif "stream" in answer and "seq" in answer:
                future.set_result(None)
            else:
                raise ValueError("no stream and seq")
        except (ValueError, TypeError, AttributeError) as exc:
            future.set_exception(_Refused(f"unreadable ack {msg.data[:100]!r}: {exc}"))

    async def _settle(self, pending: _InFlight) -> PublishError | None:
        _, subject, msg_id, token, future, deadline = pending
        try:
            if not future.done():  # wait_for would yield even for a done future
                remaining = deadline - asyncio.get_running_loop().time()
                await asyncio.wait_for(future, timeout=max(0.0, remaining))
            future.result()
        except Exception as exc:
            self._waiting.pop(token, None)
            return _publish_error(msg_id, subject, exc)
        return None


def _itself(message: Outgoing) -> Outgoing:
    return message


def _frame(message: Outgoing) -> Frame:
    headers = message.headers
    msg_id = message.msg_id
    if not message.deduplicate:
        return (message.subject, message.data, msg_id, headers)
    return (
        message.subject,
        message.data,
        msg_id,
        {**headers, MSG_ID: msg_id} if headers else {MSG_ID: msg_id},
    )


def _publish_error(msg_id: str, subject: str, exc: BaseException) -> PublishError:
    if isinstance(exc, TimeoutError):
        reason = "no ack from JetStream in time"
    else:
        reason = str(exc) or type(exc).__name__
    error = PublishError(f"{msg_id} to {subject}: {reason}")
    error.__cause__ = exc
    return error
