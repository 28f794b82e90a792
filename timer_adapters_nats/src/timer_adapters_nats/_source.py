"""Commands in: the durable pull consumer on ``TIMER_COMMANDS``, with dead-lettering of bad ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import attrs
import nats.errors
from nats.aio.msg import Msg

from timer_adapters_nats._acked import AckedPublisher
from timer_adapters_nats._connection import NatsConnection
from timer_adapters_nats._dead_letters import ERROR_HEADER, dead_letter_message
from timer_adapters_nats._pull import PullBatches, Settlement, settle, stream_sequence
from timer_core import (
    Command,
    CommandBatchHandler,
    CommandOutcome,
    CommandSource,
    DecodeError,
    Instrumentation,
    MessageEnvelope,
    TraceContext,
    rejection_reason,
)
from timer_core.codec import decode_command
from timer_core.instrumentation import NO_INSTRUMENTATION
from timer_core.trace import TRACEPARENT_HEADER

__all__ = ["NatsCommandSource"]

log = logging.getLogger(__name__)

# How long a read-ahead waits for the server's answer (a local one answers in a millisecond).
_READ_AHEAD_WAIT_S = 0.05
# The longest later commands are held back for unsettled earlier ones (at least 3 ack waits).
_BARRIER_GIVE_UP_S = 30.0


@attrs.define
class _Batch:
    """Fetched commands that decoded, with their messages (to ack or nak), in stream order."""

    messages: list[Msg] = attrs.field(factory=list)
    envelopes: list[MessageEnvelope[Command]] = attrs.field(factory=list)


class NatsCommandSource(CommandSource):
    """Reads the durable pull consumer and hands valid commands to the handler, in batches.

    - A ``traceparent`` (and ``tracestate``) header is kept as the command's
      ``trace_context``; an invalid one is ignored, the command still handled.
    - A message is rejected when it does not decode or when its subject's tenant differs from
      the envelope's (a producer on tenant A's subject never touches tenant B). It is
      republished unchanged to ``<prefix>.dlq.<subject tenant>`` (``_`` when the subject's
      tenant token is not a valid id) with a ``Timer-Error`` header, and terminated once
      that publish is acked; if the publish fails it is nak'd, so nothing is lost. A body too
      large to go out beside the headers is cut to fit and marked ``Timer-Truncated``.
    - Valid commands of one fetch go to the handler as one batch in stream order, each with
      its stream sequence as :attr:`~timer_core.MessageEnvelope.position`, and are
      acked when it returns. Every command in hand, from its delivery to its ack (decoded,
      stored, read ahead, or waiting in the pull subscription), is kept from redelivery by
      an in-progress ack at most a third of the ack wait after its delivery and after each
      in-progress ack (those settled sooner need none), so a short ack wait only costs the
      commands a dead instance held: they come back that long after its death.
    - When the handler raises, each is nak'd with a delay that doubles per delivery, and
      fetching pauses that long so later commands do not overtake them. On its last
      allowed delivery (``max_deliver``) a command is dead-lettered instead of dropped.
    - Commands another instance fetched and never settled (it crashed with them in hand)
      come back only after the ack wait, while later ones are delivered at once. So when
      the consumer has unsettled commands at start, later commands are held back (in hand,
      kept alive) until every command delivered before the start is settled, then applied
      in order: a CancelTimer is never overtaken by the ScheduleTimer it cancels, and
      nothing waits longer than the dead instance's commands take to come back.
    - Fetch errors and disconnects are logged and retried with backoff; :meth:`run` only
      returns after :meth:`stop`. A stopped source stays stopped.
    """

    def __init__(
        self,
        connection: NatsConnection,
        *,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        consumer: str | None = None,
    ) -> None:
        self._connection = connection
        self._settings = connection.settings
        # The durable consumer read: the shared one, or one tenant's lane (see _lanes.py).
        self._consumer = connection.settings.consumer_name if consumer is None else consumer
        self._subjects = connection.settings.subjects
        self._instrumentation = instrumentation
        self._stop = asyncio.Event()
        self._done = asyncio.Event()
        self._done.set()
        self._run_task: asyncio.Task[None] | None = None
        self._dlq: AckedPublisher | None = None
        # (last stream sequence delivered before this source started, loop time to give up
        # waiting for it), while any of those is unsettled; and the later commands held back
        # (in hand, kept alive) until then.
        self._barrier: tuple[int, float] | None = None
        self._held_back: list[Msg] = []
        # Whether the last batch handed over was stored: only then is the next read ahead.
        self._stored_last = True
        # Messages fetched and not settled yet, by id(): kept alive by in-progress acks.
        self._in_hand: dict[int, Msg] = {}
        self._puller: PullBatches | None = None
        # The consumer's ack wait as the server has it (provisioning may be off).
        self._ack_wait = connection.settings.ack_wait_s
        # Where a recreated consumer must start (resume_from): the highest stream sequence
        # acked or terminated (or the ack floor found at start), and the sequences handed
        # back with a nak and not settled since.
        self._settled_through: int | None = None
        self._handed_back: set[int] = set()
        # Set by retry_now(): a fetch backoff in progress ends at once.
        self._retry = asyncio.Event()

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is in progress."""
        return self._run_task is not None

    @property
    def resume_from(self) -> int | None:
        """The first stream sequence this source has not settled for good: the lowest of
        the commands in hand or handed back with a nak, else the one after the last acked
        or terminated. None before it has read the consumer at all. Where a consumer
        recreated after it was deleted starts, so nothing sent meanwhile is skipped.
        """
        open_ = set(self._handed_back)
        waiting = [] if self._puller is None else self._puller.held_messages()
        for message in [*self._in_hand.values(), *self._held_back, *waiting]:
            open_.add(stream_sequence(message))
        if open_:
            return min(open_)
        return None if self._settled_through is None else self._settled_through + 1

    @property
    def settled_through(self) -> int | None:
        """The highest stream sequence this source acked or terminated (or the consumer's
        ack floor found at start); None before it read the consumer."""
        return self._settled_through

    def retry_now(self) -> None:
        """End a fetch backoff in progress: what failed (a consumer that was missing) is
        fixed. Fetching resumes at once."""
        self._retry.set()

    async def run(self, handler: CommandBatchHandler) -> None:
        if self._run_task is not None:
            raise RuntimeError("this command source is already running")
        self._connection.jetstream  # noqa: B018 - raises now if it was never started
        self._run_task = asyncio.current_task()
        self._done.clear()
        try:
            await self._loop(handler)
        finally:
            self._run_task = None
            self._done.set()

    async def stop(self) -> None:
        """Stop fetching and wait until :meth:`run` has finished and acked its batch.

        An idle source stops at once: its long poll is abandoned, not waited out (commands
        the server delivers to it meanwhile are handed back with a nak)."""
        self._stop.set()
        if self._puller is not None:
            self._puller.interrupt()
        if self._run_task is not None and self._run_task is not asyncio.current_task():
            await self._done.wait()

    async def _loop(self, handler: CommandBatchHandler) -> None:
        settings = self._settings
        failures = 0
        puller: PullBatches | None = None
        keep_alive = asyncio.create_task(self._keep_alive())
        try:
            while not self._stop.is_set():
                try:
                    if puller is None:
                        self._barrier = await self._unsettled_at_start()
                        puller = PullBatches(
                            self._connection.client,
                            stream=settings.commands_stream,
                            consumer=self._consumer,
                        )
                        await puller.start()
                        self._puller = puller
                        if self._stop.is_set():  # stop() came while this was started
                            continue
                    messages = self._hold(
                        await puller.fetch(settings.fetch_batch, settings.fetch_timeout_s)
                    )
                except Exception as exc:  # a disconnect or a server error: back off, go on
                    failures += 1
                    delay = min(10.0, 0.1 * 2 ** min(failures - 1, 10))
                    log.warning(
                        "fetching commands from %s/%s failed (%s); retrying in %.1fs",
                        settings.commands_stream,
                        self._consumer,
                        exc or type(exc).__name__,
                        delay,
                    )
                    await self._backoff(delay)
                    continue
                failures = 0
                if not messages and not self._held_back:
                    continue
                if self._stop.is_set():
                    # Fetched after stop: hand them straight back for another consumer.
                    for message in messages:
                        await self._settle(message, "nak")
                    break
                try:
                    if self._barrier is not None:
                        messages = await self._behind_barrier(messages, handler)
                        for start in range(0, len(messages), settings.fetch_batch):
                            chunk = messages[start : start + settings.fetch_batch]
                            await self._process(chunk, handler)
                        continue
                    batch: _Batch | None = await self._prepare(messages)
                    stored: Sequence[Msg] = ()
                    try:
                        while batch is not None:
                            # Stored one after the other; each next one is fetched and
                            # decoded while the store writes this one, and a stored batch is
                            # acked once the next one is on its way to the store.
                            previous, stored = stored, ()
                            batch, stored = await self._handle(batch, handler, puller, previous)
                    finally:
                        await self._ack(stored)
                except Exception:  # a bug must not stop the consumer: they come back later
                    log.exception(
                        "unexpected error on %d commands; they will be redelivered", len(messages)
                    )
                    # No longer kept alive: they come back after the ack wait.
                    self._handed_back.update(stream_sequence(m) for m in self._in_hand.values())
                    self._in_hand.clear()
                    self._held_back.clear()
                    await self._pause(1.0)
        finally:
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive
            await self._finish(puller)
            self._in_hand.clear()
            self._puller = None

    async def _unsettled_at_start(self) -> tuple[int, float] | None:
        """The barrier for commands a predecessor may have left in hand, or None."""
        settings = self._settings
        info = await self._connection.jetstream.consumer_info(
            settings.commands_stream, self._consumer
        )
        ack_wait = self._ack_wait = info.config.ack_wait or settings.ack_wait_s
        if info.ack_floor is not None and self._settled_through is None:
            self._settled_through = info.ack_floor.stream_seq
        if not info.num_ack_pending or info.delivered is None:
            return None
        give_up = max(3 * ack_wait, _BARRIER_GIVE_UP_S)
        log.warning(
            "%d commands up to seq %d were delivered before this start and are unsettled; "
            "later commands wait for them (the ack wait is %.1fs, at most %.0fs)",
            info.num_ack_pending,
            info.delivered.stream_seq,
            ack_wait,
            give_up,
        )
        return info.delivered.stream_seq, asyncio.get_running_loop().time() + give_up

    async def _behind_barrier(
        self, messages: Sequence[Msg], handler: CommandBatchHandler
    ) -> list[Msg]:
        """Handle those from before the start; hold the later ones back (in hand, kept alive)
        and hand them out, in order, once every earlier one is settled.

        A dead predecessor's commands come back after the ack wait, redelivered ahead of new
        ones and in stream order; holding the later ones (rather than handing them back)
        lets them be applied the moment the earlier ones are, not after a guessed delay.
        The server redelivers expired commands even when the consumer is at its
        max_ack_pending, so the held ones never stall it.
        """
        assert self._barrier is not None
        last, give_up_at = self._barrier
        earlier = [m for m in messages if stream_sequence(m) <= last]
        self._held_back += [m for m in messages if stream_sequence(m) > last]
        if earlier:
            await self._process(earlier, handler)
        if not self._held_back:
            return []
        if await self._settled_up_to(last, tries=5 if earlier else 1):
            log.info("commands delivered before this start are settled; going on")
        elif asyncio.get_running_loop().time() > give_up_at:
            log.warning(
                "commands up to seq %d are still unsettled; not holding later ones any longer",
                last,
            )
        else:
            return []
        self._barrier = None
        held_back, self._held_back = self._held_back, []
        return held_back

    async def _settled_up_to(self, seq: int, *, tries: int) -> bool:
        """Whether every command up to stream sequence ``seq`` is acked or terminated; asks
        up to ``tries`` times, as acks just sent take a moment to show in the ack floor."""
        settings = self._settings
        await self._connection.client.flush()
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(0.1)
            info = await self._connection.jetstream.consumer_info(
                settings.commands_stream, self._consumer
            )
            if info.ack_floor is not None and info.ack_floor.stream_seq >= seq:
                return True
        return False

    async def _finish(self, puller: PullBatches | None) -> None:
        """Hand back what was delivered but not fetched, send the last acks out, unsubscribe."""
        held_back, self._held_back = self._held_back, []
        for message in held_back:
            await self._settle(message, "nak")
        timeout = max(1, int(self._settings.ack_timeout_s))
        if puller is not None:
            for message in await puller.finish(timeout):
                await self._settle(message, "nak")
        with contextlib.suppress(Exception):
            if self._connection.is_connected:
                await self._connection.client.flush(timeout=timeout)
        if puller is not None:
            await puller.aclose()

    async def _process(self, messages: Sequence[Msg], handler: CommandBatchHandler) -> None:
        _, stored = await self._handle(await self._prepare(messages), handler, None)
        await self._ack(stored)

    async def _ack(self, messages: Sequence[Msg]) -> None:
        for message in messages:
            await self._settle(message, "ack")

    async def _prepare(self, messages: Sequence[Msg]) -> _Batch:
        """Decode a fetched batch; the rejected commands are dead-lettered on the way."""
        batch = _Batch()
        for message in messages:
            try:
                envelope = self._check(message)
            except DecodeError as exc:
                await self._dead_letter(message, str(exc))
                continue
            batch.messages.append(message)
            batch.envelopes.append(envelope)
        return batch

    async def _handle(
        self,
        batch: _Batch,
        handler: CommandBatchHandler,
        puller: PullBatches | None,
        stored: Sequence[Msg] = (),
    ) -> tuple[_Batch | None, Sequence[Msg]]:
        """Hand ``batch`` over; meanwhile, with a ``puller``, fetch and decode the next batch.

        Returns the next batch (None: fetch anew) and this batch's messages once it is
        stored, to be acked by the caller. ``stored`` (the batch stored before) is acked
        here once this batch has been handed over, so the store starts on this one first;
        it is acked before this returns or raises in any case.

        The next batch is read ahead only after a batch was stored, so a store outage does
        not spend deliveries of commands that never reached the handler; if this batch
        fails, the one read ahead is handed back with the same delay, behind it.
        """
        try:
            if not batch.envelopes:
                return None, ()
            handling = asyncio.ensure_future(handler(batch.envelopes))
            if stored:
                await asyncio.sleep(0)  # the handler builds and queues its write first
        finally:
            await self._ack(stored)
        ahead: _Batch | None = None
        try:
            if puller is not None and self._stored_last and not self._stop.is_set():
                ahead = await self._read_ahead(puller)
            try:
                await handling
            except Exception as exc:  # StoreError and the like: redeliver later, keep running
                self._stored_last = False
                await self._retry_later(batch.messages, exc, behind=ahead.messages if ahead else ())
                return None, ()
        finally:
            if not handling.done():  # the read-ahead failed: the batch in hand still finishes
                with contextlib.suppress(Exception):
                    await handling
        self._stored_last = True
        stored_now = await self._dead_letter_refused(batch, handling.result())
        if ahead is not None and self._stop.is_set():
            # Read ahead before stop: hand them straight back for another consumer.
            for message in ahead.messages:
                await self._settle(message, "nak")
            return None, stored_now
        return (ahead if ahead is not None and ahead.envelopes else None), stored_now

    async def _dead_letter_refused(
        self, batch: _Batch, outcomes: Sequence[CommandOutcome]
    ) -> Sequence[Msg]:
        """Dead-letter the commands the handler refused (over a quota); the rest, to ack."""
        if all(outcome is not CommandOutcome.OVER_QUOTA for outcome in outcomes):
            return batch.messages
        stored: list[Msg] = []
        refused: list[tuple[Msg, str]] = []
        for message, envelope, outcome in zip(
            batch.messages, batch.envelopes, outcomes, strict=True
        ):
            reason = rejection_reason(envelope, outcome)
            if reason is None:
                stored.append(message)
            else:
                refused.append((message, reason))
        # The handler counted them already.
        await self._dead_letter_many(refused, counted=True)
        return stored

    async def _read_ahead(self, puller: PullBatches) -> _Batch:
        """The next batch, decoded; empty when there is none right now (or fetching failed)."""
        settings = self._settings
        try:
            # Only what is there now, and not waiting long for it: the batch in hand is acked
            # after this. A late answer still lands in the puller for the next fetch.
            messages = self._hold(
                await puller.fetch_now(
                    settings.fetch_batch, min(settings.fetch_timeout_s, _READ_AHEAD_WAIT_S)
                )
            )
        except Exception as exc:  # the loop's next fetch reports and backs off
            log.debug("reading the next commands ahead failed: %s", exc)
            return _Batch()
        return await self._prepare(messages)

    def _check(self, message: Msg) -> MessageEnvelope[Command]:
        """Decode a command and hold it to the tenant of the subject it came on."""
        subject_tenant = self._subjects.tenant_of_command(message.subject)
        if subject_tenant is None:
            raise DecodeError(
                "subject",
                f"{message.subject!r} is not {self._subjects.prefix}.commands.<tenantId>",
            )
        # The stream sequence orders the commands of one timer: an older one redelivered
        # after a newer one was applied (a broker that lost acks) is stale, not re-applied.
        envelope = decode_command(message.data, position=stream_sequence(message))
        headers = message.headers
        if headers and TRACEPARENT_HEADER in headers:
            trace_context = TraceContext.from_headers(headers)
            if trace_context is not None:
                envelope = envelope.with_trace_context(trace_context)
        if envelope.tenant_id != subject_tenant:
            raise DecodeError(
                "tenantId",
                f"envelope tenant {str(envelope.tenant_id)!r} does not match the subject's "
                f"tenant {str(subject_tenant)!r}",
            )
        return envelope

    async def dead_letter(self, rejected: Sequence[tuple[Msg, str]]) -> None:
        """Dead-letter these deliveries (of any consumer on the commands stream) with their
        reasons, as this source does its own rejected commands."""
        await self._dead_letter_many(rejected)

    async def _dead_letter(self, message: Msg, reason: str, *, counted: bool = False) -> None:
        """Republish unchanged to the DLQ with the reason; terminate once that is acked.

        ``counted``: the rejection was already reported to the instrumentation."""
        await self._dead_letter_many([(message, reason)], counted=counted)

    async def _dead_letter_many(
        self, rejected: Sequence[tuple[Msg, str]], *, counted: bool = False
    ) -> None:
        """:meth:`_dead_letter` for many at once: their publishes are in flight together, so
        refusing a flood over the quota goes as fast as storing it (one ack wait each made
        a tenant's refusals 2,000/s where its stores were 6,000-10,000/s: issue 43)."""
        if not rejected:
            return
        max_payload = self._connection.client.max_payload
        outgoing = [
            dead_letter_message(message, reason, self._subjects, max_payload=max_payload)
            for message, reason in rejected
        ]
        if self._dlq is None:
            self._dlq = AckedPublisher(
                self._connection.client,
                window=self._settings.fetch_batch,
                ack_timeout_s=self._settings.ack_timeout_s,
            )
        errors = await self._dlq.publish_many(outgoing)
        for (message, _), letter, error in zip(rejected, outgoing, errors, strict=True):
            metadata = message.metadata
            if error is not None:
                delay = self._settings.nak_delay(metadata.num_delivered)
                log.warning(
                    "could not dead-letter command seq %s from %s (%s); redelivery in %.1fs",
                    metadata.sequence.stream,
                    message.subject,
                    error,
                    delay,
                )
                await self._settle(message, "nak", delay=delay)
                continue
            await self._settle(message, "term")
            reason = letter.headers[ERROR_HEADER]
            if not counted:
                self._instrumentation.command_rejected(message.subject, reason)
            if len(rejected) == 1:
                log.warning(
                    "rejected command seq %s on %s, dead-lettered to %s: %s",
                    metadata.sequence.stream,
                    message.subject,
                    letter.subject,
                    reason,
                )
        if len(rejected) > 1:  # one line a batch: a flood of them must not flood the log
            log.warning(
                "rejected %d commands (seq %s to %s), dead-lettered to %s: %s",
                len(rejected),
                stream_sequence(rejected[0][0]),
                stream_sequence(rejected[-1][0]),
                outgoing[0].subject,
                outgoing[0].headers[ERROR_HEADER],
            )

    async def _retry_later(
        self, messages: Sequence[Msg], error: Exception, *, behind: Sequence[Msg] = ()
    ) -> None:
        """Nak ``messages`` with the growing delay (dead-letter those out of deliveries),
        then ``behind`` (fetched after them, not handled) with the longest of those delays."""
        settings = self._settings
        longest = 0.0
        for message in messages:
            delivered = message.metadata.num_delivered
            if settings.max_deliver != -1 and delivered >= settings.max_deliver:
                await self._dead_letter(
                    message,
                    f"not stored after {delivered} deliveries: {type(error).__name__}: {error}",
                )
                continue
            delay = settings.nak_delay(delivered)
            longest = max(longest, delay)
            await self._settle(message, "nak", delay=delay)
        for message in behind:
            delivered = message.metadata.num_delivered
            if settings.max_deliver != -1 and delivered >= settings.max_deliver:
                await self._dead_letter(
                    message, f"not stored after {delivered} deliveries: held behind a failure"
                )
                continue
            await self._settle(message, "nak", delay=longest or settings.nak_delay(1))
        log.warning(
            "handling %d commands failed (%s: %s); redelivery in %.1fs",
            len(messages),
            type(error).__name__,
            error,
            longest,
        )
        # Later commands must not overtake these: fetch again only once they are back.
        await self._pause(longest * 1.1 + 0.05 if longest else 0.0)

    async def _keep_alive(self) -> None:
        """Every message in hand (fetched, decoded, being stored, read ahead, or delivered to
        an open pull request and not fetched yet) gets an in-progress ack at most a third of
        the ack wait after its delivery and after each in-progress ack, so the server
        redelivers only what a dead instance held.

        The check runs every sixth of the ack wait; a message is refreshed on the second
        check that finds it in hand (it came at most two checks ago) and on every second one
        after that. Commands settled within a sixth of the ack wait, the usual case, never
        need one, so the in-progress acks do not grow with how much several instances hold.
        """
        # id(message) -> the check it was last refreshed on (for a message not refreshed
        # yet: the check before the first that found it). An id reused by a new message
        # only makes its first refresh come early.
        refreshed: dict[int, int] = {}
        check = 0
        while True:
            await asyncio.sleep(self._progress_interval())
            check += 1
            in_hand = list(self._in_hand.values())
            waiting = [] if self._puller is None else self._puller.held_messages()
            seen: dict[int, int] = {}
            for message in in_hand:
                if id(message) in self._in_hand:  # not settled meanwhile
                    seen[id(message)] = await self._refresh(message, check, refreshed)
            for message in waiting:
                if not message.is_acked:
                    seen[id(message)] = await self._refresh(message, check, refreshed)
            refreshed = seen

    async def _refresh(self, message: Msg, check: int, refreshed: dict[int, int]) -> int:
        """An in-progress ack for ``message`` if its last one (or its delivery) may be two
        checks old; returns the check it counts as refreshed on."""
        last = refreshed.get(id(message), check - 1)
        if check - last < 2:
            return last
        await self._progress(message)
        return check

    @staticmethod
    async def _progress(message: Msg) -> None:
        with contextlib.suppress(nats.errors.Error, OSError):
            await message.in_progress()

    def _progress_interval(self) -> float:
        return max(0.025, self._ack_wait / 6)

    def _hold(self, messages: Sequence[Msg]) -> list[Msg]:
        """Note ``messages`` as in hand (kept alive until settled); returns them."""
        for message in messages:
            self._in_hand[id(message)] = message
        return list(messages)

    async def _settle(self, message: Msg, how: Settlement, *, delay: float | None = None) -> None:
        """Ack, nak or term; a failure only means the server redelivers it later."""
        self._in_hand.pop(id(message), None)
        seq = stream_sequence(message)
        if how == "nak":
            self._handed_back.add(seq)
        else:
            self._handed_back.discard(seq)
            self._settled_through = max(self._settled_through or 0, seq)
        await settle(message, how, delay=delay, what="command")

    async def _pause(self, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), seconds)

    async def _backoff(self, seconds: float) -> None:
        """:meth:`_pause`, ended early by :meth:`retry_now`."""
        await wait_for_either(self._stop, self._retry, seconds)


async def wait_for_either(stop: asyncio.Event, retry: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or until ``stop`` or ``retry`` is set (``retry`` cleared first)."""
    retry.clear()
    stopping = asyncio.ensure_future(stop.wait())
    retrying = asyncio.ensure_future(retry.wait())
    try:
        await asyncio.wait(
            {stopping, retrying}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        stopping.cancel()
        retrying.cancel()
