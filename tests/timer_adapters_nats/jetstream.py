"""Reading what a test's JetStream streams hold, and waiting for a condition without sleeps."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
from nats.js.client import JetStreamContext

if TYPE_CHECKING:
    from timer_adapters_nats import NatsBroker


@attrs.frozen
class StoredMessage:
    """One message as a stream stores it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.data)


async def read_stream(js: JetStreamContext, stream: str) -> list[StoredMessage]:
    """Every message the stream holds, in stream order."""
    info = await js.stream_info(stream)
    state = info.state
    if state.messages == 0:
        return []
    held = []
    for seq in range(state.first_seq, state.last_seq + 1):
        raw = await js.get_msg(stream, seq)
        assert raw.seq is not None and raw.subject is not None
        held.append(
            StoredMessage(
                seq=raw.seq,
                subject=raw.subject,
                data=raw.data or b"",
                headers=dict(raw.headers or {}),
            )
        )
    return held


async def wait_until(
    condition: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    within: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> None:
    """Poll ``condition`` (sync or async) until it is true; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)


#: How long JetStream may take, after a (re)start, to recover its streams and consumers on a
#: busy machine: the server accepts clients (and they reconnect) before that is done.
RECOVERY_S = 20.0

#: A long poll that outlasts any test step: a stop that waited it out would show.
LONG_POLL_S = 30.0
#: How long a stop with a long poll open may take: it withdraws the poll (a round trip or two
#: to a local server), it never waits for its expiry (LONG_POLL_S). A sixth of that, so it
#: still tells the two apart, with room for a machine whose cores other work shares.
PROMPT_STOP_S = LONG_POLL_S / 6


async def jetstream_back(js: JetStreamContext, stream: str, consumer: str | None = None) -> bool:
    """Whether JetStream answers for ``stream`` (and its ``consumer``) again."""
    try:
        await js.stream_info(stream)
        if consumer is not None:
            await js.consumer_info(stream, consumer)
    except Exception:
        return False
    return True


async def acked_up_to(js: JetStreamContext, stream: str, consumer: str, seq: int) -> bool:
    """Whether the consumer's ack floor reached stream sequence ``seq``: the server has
    applied every ack up to it (acks are fire-and-forget; until then they may be lost)."""
    info = await js.consumer_info(stream, consumer)
    return info.ack_floor is not None and info.ack_floor.stream_seq >= seq


async def polling(broker: NatsBroker, consumer: str | None = None) -> bool:
    """Whether a long poll is waiting at the server (num_waiting) on the commands consumer,
    or on the events consumer ``consumer``."""
    settings = broker.settings
    if consumer is None:
        info = await broker.jetstream.consumer_info(
            settings.commands_stream, settings.consumer_name
        )
    else:
        info = await broker.jetstream.consumer_info(settings.events_stream, consumer)
    return bool(info.num_waiting)
