"""The hook through which Timer reports what a host turns into metrics; no-op by default."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from timer_core._entry import TimerEntry
from timer_core._messages import Command, DueTimeReached, MessageEnvelope
from timer_core.errors import PublishError

__all__ = ["NO_BATCH_OBSERVER", "NO_INSTRUMENTATION", "BatchObserver", "Instrumentation"]


class BatchObserver:
    """One batch followed from start to end (a tracer's span around it); does nothing here.

    :meth:`Instrumentation.commands_started` and :meth:`Instrumentation.firing_started`
    return one per batch; the workflows call :meth:`finished` exactly once when the batch is
    done, unless the task running it is cancelled first.
    """

    def published(self, results: Sequence[PublishError | None]) -> None:
        """A firing batch's publish returned: ``results[i]`` for the i-th envelope (None:
        acknowledged). Not called for command batches."""

    def finished(self, error: BaseException | None = None) -> None:
        """The batch is done (commands stored; timers published and marked), or failed with
        ``error``."""


NO_BATCH_OBSERVER = BatchObserver()


class Instrumentation:
    """Override the methods you care about; each is called on the event loop and must be cheap.

    The base class does nothing, so libraries can call it unconditionally.
    """

    def commands_started(self, envelopes: Sequence[MessageEnvelope[Command]]) -> BatchObserver:
        """A batch of valid commands is about to be stored; the observer sees it finish."""
        return NO_BATCH_OBSERVER

    def firing_started(self, envelopes: list[MessageEnvelope[DueTimeReached]]) -> BatchObserver:
        """These ``DueTimeReached`` are about to be published; the observer sees the publish
        results and the mark.

        It may replace an envelope of the list with the same envelope carrying another
        ``trace_context`` (e.g. of a span it started for that firing): the list's envelopes
        are what is published. Nothing else may change.
        """
        return NO_BATCH_OBSERVER

    def command_handled(self, envelope: MessageEnvelope[Command], outcome: str) -> None:
        """A valid command was applied; ``outcome`` is a :class:`CommandOutcome` value."""

    def commands_handled(
        self, envelopes: Sequence[MessageEnvelope[Command]], outcomes: Sequence[str]
    ) -> None:
        """A batch of commands was applied, ``outcomes[i]`` for ``envelopes[i]``.

        What the workflows call, once per batch; by default :meth:`command_handled` per
        command. Override this instead to count a batch at once.
        """
        for envelope, outcome in zip(envelopes, outcomes, strict=True):
            self.command_handled(envelope, outcome)

    def command_rejected(self, subject: str, reason: str) -> None:
        """A command could not be decoded and was dead-lettered with ``reason``."""

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        """These timers were published and marked ``Reached`` (lateness = reached - due)."""

    def publish_failed(self, entry: TimerEntry, error: PublishError) -> None:
        """Publishing this timer's event failed; it stays ``Scheduled`` for a later pass."""

    def timer_quarantined(self, entry: TimerEntry, error: PublishError, failures: int) -> None:
        """This timer's publish failed ``failures`` times while others were published: the
        worker leaves it out until it is retried (:meth:`TimerWorker.retry_quarantined`)."""

    def quarantine_size(self, count: int) -> None:
        """How many timers are quarantined now (after each change)."""

    def quarantine_oldest(self, since: datetime | None) -> None:
        """When the longest-held of the quarantined timers was quarantined (the worker's
        clock), after each change; None when none is. A gauge of its age reads the clock
        when it is read, so the age grows between changes."""

    def poll_completed(self, duration_s: float, fired: int) -> None:
        """One pass of the worker (find, publish, mark) finished."""

    def worker_error(self, error: BaseException) -> None:
        """A worker pass failed as a whole (store down); the worker backs off and retries."""

    def timers_purged(self, count: int) -> None:
        """Retention deleted ``count`` expired fired timers (and cancel tombstones)."""


NO_INSTRUMENTATION = Instrumentation()
