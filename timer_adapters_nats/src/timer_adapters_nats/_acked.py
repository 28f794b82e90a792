"""Acked JetStream publishing, many in flight at once: what every publisher of the adapter uses."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
from nats.aio.client import Client
from nats.aio.msg import Msg

from timer_core import PublishError, tell_delivered

__all__ = ["MSG_ID", "AckedPublisher", "Frame", "Outgoing", "Told"]

MSG_ID = "Nats-Msg-Id"
_NO_RESPONDERS = "503"
_PERMISSIONS_VIOLATION = "Permissions Violation"
#: How nats-py hands over the server's refusal of a publish (the ``-ERR`` line, lower-cased).
_REFUSED_PUBLISH = re.compile(r'permissions violation for publish to "([^"]*)"')
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


class _Refused(Exception):
    """JetStream answered the publish with an error instead of an ack."""


Told = Callable[[int, PublishError | None], None]
"""Told once per message of a :meth:`AckedPublisher.publish_frames_each` call: its index in
the call and None (acknowledged) or its :class:`PublishError`."""

# A message whose ack is awaited, by its reply token: (its call, index in the call, subject,
# msg id). The dict keeps the order they were sent in.
_Waiting = tuple["_Call", int, str, str]


class _Call:
    """One call's messages on the wire: how many are untold, when each one's ack is due."""

    __slots__ = ("acked", "done", "left", "loop", "sent", "wake", "wake_at")

    def __init__(self, done: Told, loop: asyncio.AbstractEventLoop) -> None:
        self.done = done
        self.loop = loop
        self.left = 0
        """Messages sent whose result is not told yet."""
        self.sent: deque[tuple[float, str]] = deque()
        """(ack deadline, reply token) of each message sent, in order: the deadlines grow."""
        self.wake: asyncio.Future[None] | None = None
        self.wake_at = 0
        """Wake the call up once :attr:`left` is down to this."""
        self.acked: list[int] = []
        """Acknowledged, not told yet: the acks that came in together are told together."""

    def tell(self, index: int, error: PublishError | None) -> None:
        self.left -= 1
        wake = self.wake
        if wake is not None and self.left <= self.wake_at and not wake.done():
            wake.set_result(None)
        if error is not None:
            self.done(index, error)
            return
        # Acks arrive in bursts, one callback each: they are told once the burst is read
        # (on the loop's next turn), in one step (tell_delivered).
        if not self.acked:
            self.loop.call_soon(self.flush)
        self.acked.append(index)

    def flush(self) -> None:
        """Tell the acknowledged messages not told yet."""
        acked, self.acked = self.acked, []
        if acked:
            tell_delivered(self.done, acked)


class AckedPublisher:
    """Publishes to JetStream with up to ``window`` acks outstanding; each ack is checked.

    All acks come back on one wildcard inbox subscription, matched to their message by a
    token (nats-py's own ``publish_async`` turns a refusal into a timeout, so it is not used).
    Each message's result is known as its own ack comes back (or its ack timeout passes), so
    one that is never acknowledged holds back no other; a full window waits for any acks, not
    the oldest's. A message counts as published only on a positive ack; a refusal, a timeout,
    a disconnect or a refusal the server reports on the connection (:meth:`refused`: a
    permissions violation) is a :class:`PublishError` for it alone.
    """

    def __init__(self, nc: Client, *, window: int, ack_timeout_s: float) -> None:
        self._nc = nc
        self._window = window
        self._refill = max(1, window // 4)
        self._ack_timeout_s = ack_timeout_s
        self._inbox: str | None = None
        self._waiting: dict[str, _Waiting] = {}
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
        (its headers already holding ``Nats-Msg-Id``): no :class:`Outgoing` per message."""
        results: list[PublishError | None] = [None] * len(items)

        def told(index: int, error: PublishError | None) -> None:
            if error is not None:
                results[index] = error

        await self.publish_frames_each(items, frame, told)
        return results

    async def publish_frames_each(
        self, items: Sequence[_T], frame: Callable[[_T], Frame], done: Told
    ) -> None:
        """Like :meth:`publish_frames`, telling ``done(index, result)`` each message's result
        as soon as it is known, exactly once each (the fire path: one timer's missing ack
        holds back only its own mark); returns once every one is told. Cancelled, it tells
        no more: the caller counts the untold as failed."""
        loop = asyncio.get_running_loop()
        nc = self._nc
        waiting = self._waiting
        tokens = self._tokens
        window = self._window
        timeout = self._ack_timeout_s
        call = _Call(done, loop)
        sent = call.sent
        unflushed = 0
        try:
            async with self._sending:
                inbox = self._inbox or await self._subscribe()
                for index, item in enumerate(items):
                    if call.left >= window:
                        # Wait until a quarter of the window is acked, not for one ack per
                        # wake-up: that many places then refill in one go.
                        await self._until_left(call, window - self._refill)
                    try:
                        subject, data, msg_id, headers = frame(item)
                    except Exception as exc:  # cannot even be encoded: that one fails
                        done(index, PublishError(f"message {index} of the batch: {exc}"))
                        continue
                    if not nc.is_connected:
                        # Reconnecting: fail now rather than buffer and time out one by one.
                        done(index, PublishError(f"{msg_id} to {subject}: not connected to NATS"))
                        continue
                    token = str(next(tokens))
                    waiting[token] = (call, index, subject, msg_id)
                    call.left += 1
                    try:
                        await nc.publish(subject, data, reply=inbox + token, headers=headers)
                    except BaseException as exc:
                        if waiting.pop(token, None) is None or not isinstance(exc, Exception):
                            raise
                        # One message's failure never fails the others.
                        call.tell(index, _publish_error(msg_id, subject, exc))
                        continue
                    sent.append((loop.time() + timeout, token))
                    unflushed += 1
                    if unflushed >= _CHUNK:
                        unflushed = 0
                        await asyncio.sleep(0)  # the connection's flusher writes this chunk now
            await self._until_left(call, 0)
        except BaseException:
            for _, token in sent:  # cut off: a late ack tells nobody
                waiting.pop(token, None)
            raise
        finally:
            call.flush()  # what was acknowledged is told before this returns

    async def _until_left(self, call: _Call, most: int) -> None:
        """Wait until at most ``most`` of ``call``'s messages are untold; a message whose ack
        deadline passes meanwhile fails (no ack from JetStream in time)."""
        loop = asyncio.get_running_loop()
        waiting = self._waiting
        sent = call.sent
        while call.left > most:
            while sent and sent[0][1] not in waiting:
                sent.popleft()  # told already
            if not sent:
                return  # a message being published is all that is left (cannot happen here)
            now = loop.time()
            deadline = sent[0][0]
            if deadline <= now:
                while sent and sent[0][0] <= now:
                    _, token = sent.popleft()
                    pending = waiting.pop(token, None)
                    if pending is not None:
                        _, index, subject, msg_id = pending
                        call.tell(index, _publish_error(msg_id, subject, TimeoutError()))
                continue
            call.wake = wake = loop.create_future()
            call.wake_at = most
            try:
                await asyncio.wait((wake,), timeout=deadline - now)
            finally:
                call.wake = None

    def refused(self, error: BaseException) -> bool:
        """The server refused a message on the connection (nats-py hands the ``-ERR`` to the
        connection's error callback, not to the publish): if ``error`` is a permissions
        violation for a subject with a message in flight here, the oldest such message fails
        now with the server's words (rather than with no ack after its timeout). Returns
        whether it was one of this publisher's.

        The server sends one ``-ERR`` per refused publish, in the order they came; nats-py
        lower-cases it, so the subject is matched without regard to case."""
        subject = _refused_subject(str(error))
        if subject is None:
            return False
        for token, (call, index, sent_to, msg_id) in self._waiting.items():
            if sent_to.lower() == subject:
                del self._waiting[token]
                reason = f'{_PERMISSIONS_VIOLATION} for Publish to "{sent_to}" (the NATS server)'
                call.tell(index, PublishError(f"{msg_id} to {sent_to}: {reason}"))
                return True
        return False

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
        pending = self._waiting.pop(msg.subject[len(self._inbox) :], None)
        if pending is None:
            return  # answered after its timeout
        call, index, subject, msg_id = pending
        data = msg.data
        if b'"seq"' in data and b'"error"' not in data:
            call.tell(index, None)  # the common case, without a JSON parse per ack
            return
        why: str | None
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            why = "no stream is bound to this subject"
        else:
            try:
                answer = json.loads(data)
                error = answer.get("error")
                if error is not None:
                    why = f"{error.get('description')} (error {error.get('err_code')})"
                elif "stream" in answer and "seq" in answer:
                    why = None
                else:
                    raise ValueError("no stream and seq")
            except (ValueError, TypeError, AttributeError) as exc:
                why = f"unreadable ack {msg.data[:100]!r}: {exc}"
        call.tell(index, None if why is None else _publish_error(msg_id, subject, _Refused(why)))


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


def _refused_subject(text: str) -> str | None:
    """The subject (lower-cased) of a permissions violation for a publish, else None."""
    found = _REFUSED_PUBLISH.search(text.lower())
    return None if found is None else found.group(1)


def _publish_error(msg_id: str, subject: str, exc: BaseException) -> PublishError:
    if isinstance(exc, TimeoutError):
        reason = "no ack from JetStream in time"
    else:
        reason = str(exc) or type(exc).__name__
    error = PublishError(f"{msg_id} to {subject}: {reason}")
    error.__cause__ = exc
    return error
