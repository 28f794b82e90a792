"""How the firing pipeline hands due timers out: a :class:`Delivery` plug-in, told each timer's
outcome as it completes. :class:`PublishedEvents` publishes them to a broker; the host's
handlers (:mod:`timer_core.handlers`) are the other deliveries."""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core.errors import PublishError
from timer_core.instrumentation import NO_INSTRUMENTATION, Instrumentation
from timer_core.ports import EventPublisher

__all__ = ["Delivery", "Outcome", "PublishedEvents"]

log = logging.getLogger(__name__)


class Outcome(Protocol):
    """How a delivery tells the pipeline each envelope's outcome (the ``done`` of
    :meth:`Delivery.start`). The first telling of an envelope counts; a later one is
    ignored."""

    def __call__(self, index: int, error: PublishError | None) -> None:
        """The envelope at ``index`` of the call: None (delivered) or why it was not."""

    def delivered(self, indices: Sequence[int]) -> None:
        """The envelopes at ``indices`` were delivered (outcomes that came in together:
        :func:`~timer_core.ports.tell_delivered`)."""

    def fail_untold(self, error: PublishError) -> None:
        """Every envelope not told yet failed with ``error``."""


#: Timers a publishing pipeline has in flight at once: a slow acknowledgement holds one of
#: them, not the next finds.
PUBLISH_WINDOW = 1000


class Delivery(abc.ABC):
    """A way out for due timers, plugged into the firing pipeline.

    The pipeline builds each due timer's ``DueTimeReached`` envelope and hands a batch of
    them to :meth:`start`, which returns at once; the delivery then reports each envelope's
    outcome through ``done`` as it completes, in any order, exactly once (an outcome known at
    once, a handler call that returned without waiting, may be told before :meth:`start`
    returns). The pipeline marks
    the delivered timers ``Reached`` (together) and retries the others; it never hands out a
    timer again while its delivery runs, and never more than :attr:`places` at once.
    """

    places: int = PUBLISH_WINDOW
    """Most timers in flight at once."""

    @abc.abstractmethod
    def start(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]], done: Outcome
    ) -> asyncio.Future[None] | None:
        """Begin delivering ``envelopes``; report each one's outcome to ``done``. A delivery
        that can be cut off (a publish, at the end of a claim's lease) returns the future
        whose cancellation does so: every envelope not yet told then fails."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop: what is under way ends (or is cut off) before this returns; an envelope
        cut off reports a failure."""


class PublishedEvents(Delivery):
    """Each due timer's ``DueTimeReached`` published to ``publisher``
    (:meth:`EventPublisher.publish_each`: one outcome per envelope as its acknowledgement
    comes back)."""

    def __init__(
        self,
        publisher: EventPublisher,
        *,
        places: int = PUBLISH_WINDOW,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
    ) -> None:
        self.publisher = publisher
        self.instrumentation = instrumentation
        self.places = places
        self._calls: set[asyncio.Task[None]] = set()
        self._last: asyncio.Future[None] | None = None

    def start(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]], done: Outcome
    ) -> asyncio.Future[None]:
        before = None if self.publisher.keeps_call_order else self._last
        call = asyncio.ensure_future(self._publish(envelopes, done, after=before))
        self._last = call
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    async def _publish(
        self,
        envelopes: Sequence[MessageEnvelope[DueTimeReached]],
        done: Outcome,
        *,
        after: asyncio.Future[None] | None,
    ) -> None:
        if after is not None and not after.done():
            # A publisher that does not keep the order of concurrent calls gets one at a
            # time, so events still reach the broker in due order.
            await asyncio.wait((after,))
        try:
            await self.publisher.publish_each(envelopes, done)
        except asyncio.CancelledError as exc:
            # Cut off (the claim's lease ran out, or the shutdown): not acknowledged.
            why = str(exc.args[0]) if exc.args else "cut off before it was acknowledged"
            done.fail_untold(PublishError(why))
        except Exception as exc:
            # A publisher that raised (a bug: it should not): every envelope not yet told
            # failed, and the error is the worker's, as a failed pass's is.
            log.error("publishing %d due timers failed: %r", len(envelopes), exc, exc_info=exc)
            self.instrumentation.worker_error(exc)
            error = (
                exc if isinstance(exc, PublishError) else PublishError(f"publish failed: {exc!r}")
            )
            done.fail_untold(error)
        else:
            done.fail_untold(PublishError("the publisher reported no outcome for this envelope"))

    async def aclose(self) -> None:
        # The acknowledgements under way are awaited: each is bounded by the publisher's
        # own ack timeout.
        while self._calls:
            await asyncio.wait(set(self._calls))
