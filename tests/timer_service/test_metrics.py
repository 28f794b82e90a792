"""The Prometheus instrumentation counts what the core reports, in batches or one by one."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry, Histogram

from timer_core import (
    CancelTimer,
    Command,
    CommandOutcome,
    EnvelopeId,
    MessageEnvelope,
    PublishError,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    TimerEntry,
)
from timer_service.metrics import LATENESS_BUCKETS, PrometheusInstrumentation, observe_all


def command(i: int) -> MessageEnvelope[Command]:
    payload: Command
    if i % 2:
        payload = CancelTimer(TenantId("t"), ServiceCallId(f"c{i}"))
    else:
        payload = ScheduleTimer(
            TenantId("t"), ServiceCallId(f"c{i}"), datetime(2030, 1, 1, tzinfo=UTC)
        )
    return MessageEnvelope(id=EnvelopeId.generate(), payload=payload, timestamp_ms=0)


def counted(metrics: PrometheusInstrumentation) -> dict[str, float]:
    return {
        outcome: metrics.registry.get_sample_value(
            "timer_commands_received_total", {"outcome": outcome}
        )
        or 0.0
        for outcome in ("stored", "ignored", "stale", "rejected")
    }


OUTCOMES = [
    CommandOutcome.SCHEDULED,
    CommandOutcome.CANCELLED,
    CommandOutcome.IGNORED_REACHED,
    CommandOutcome.CANCEL_NOOP,
    CommandOutcome.SCHEDULED,
]


class TestCommandCounts:
    def test_a_batch_counts_each_outcome(self) -> None:
        """A batch adds one to its bucket per command: stored when the store changed."""
        metrics = PrometheusInstrumentation()
        metrics.commands_handled([command(i) for i in range(5)], OUTCOMES)
        metrics.command_rejected("timer.commands.t", "bad")
        assert counted(metrics) == {"stored": 3.0, "ignored": 2.0, "stale": 0.0, "rejected": 1.0}

    @pytest.mark.parametrize("outcome", list(CommandOutcome))
    def test_every_outcome_is_counted_under_a_label(self, outcome: CommandOutcome) -> None:
        """Each outcome the store can report adds one to exactly one outcome label."""
        metrics = PrometheusInstrumentation()
        metrics.commands_handled([command(0)], [outcome])
        assert sum(counted(metrics).values()) == 1.0

    def test_commands_that_changed_nothing_count_as_ignored(self) -> None:
        """A schedule of a Reached timer and a cancel of one count as ignored, not stored."""
        metrics = PrometheusInstrumentation()
        outcomes = [CommandOutcome.IGNORED_REACHED, CommandOutcome.CANCEL_NOOP]
        metrics.commands_handled([command(0), command(1)], outcomes)
        assert counted(metrics) == {"stored": 0.0, "ignored": 2.0, "stale": 0.0, "rejected": 0.0}

    @pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
    def test_batches_and_single_commands_count_alike(
        self, level: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Counting a batch at once gives what counting its commands one by one gives."""
        caplog.set_level(level, logger="timer_service.events")
        batched, single = PrometheusInstrumentation(), PrometheusInstrumentation()
        envelopes = [command(i) for i in range(5)]
        batched.commands_handled(envelopes, OUTCOMES)
        for envelope, outcome in zip(envelopes, OUTCOMES, strict=True):
            single.command_handled(envelope, outcome)
        assert counted(batched) == counted(single)


class TestQuarantine:
    def test_a_quarantined_timer_is_counted_and_shown(self) -> None:
        """timer_quarantined_total counts quarantines; timer_timers_quarantined is the size."""
        metrics = PrometheusInstrumentation()
        entry = TimerEntry(
            tenant_id="t",
            service_call_id="poison",
            due_at=datetime(2030, 1, 1, tzinfo=UTC),
            registered_at=datetime(2029, 1, 1, tzinfo=UTC),
        )
        metrics.timer_quarantined(entry, PublishError("refused"), 10)
        metrics.quarantine_size(1)
        sample = metrics.registry.get_sample_value
        assert sample("timer_quarantined_total") == 1.0
        assert sample("timer_timers_quarantined") == 1.0
        metrics.quarantine_size(0)
        assert sample("timer_timers_quarantined") == 0.0

    def test_the_oldest_quarantines_age_grows_until_none_is_left(self) -> None:
        """timer_oldest_quarantined_seconds is the age of the oldest quarantine as of the
        scrape (it grows between the worker's reports), 0 once none is left."""
        metrics = PrometheusInstrumentation()
        sample = metrics.registry.get_sample_value
        assert sample("timer_oldest_quarantined_seconds") == 0.0
        metrics.quarantine_oldest(datetime.now(UTC) - timedelta(seconds=90))
        first = sample("timer_oldest_quarantined_seconds")
        assert first is not None and 90.0 <= first < 3600.0
        assert (sample("timer_oldest_quarantined_seconds") or 0.0) >= first
        metrics.quarantine_oldest(None)
        assert sample("timer_oldest_quarantined_seconds") == 0.0


class TestLateness:
    @pytest.mark.parametrize("count", [0, 1, 100])
    def test_a_batch_is_observed_as_each_timer_alone(self, count: int) -> None:
        """observe_all leaves the histogram as one observe per amount would (bucket edges too)."""
        edges = [0.0, *LATENESS_BUCKETS, 7200.0, -1.0]
        amounts = [edges[i % len(edges)] + (i % 3) * 1e-4 for i in range(count)]
        batched, alone = CollectorRegistry(), CollectorRegistry()
        histogram = Histogram("lateness", "-", buckets=LATENESS_BUCKETS, registry=batched)
        reference = Histogram("lateness", "-", buckets=LATENESS_BUCKETS, registry=alone)
        observe_all(histogram, amounts)
        for amount in amounts:
            reference.observe(amount)
        for bound in [*map(str, LATENESS_BUCKETS), "+Inf"]:
            labels = {"le": bound}
            assert batched.get_sample_value("lateness_bucket", labels) == alone.get_sample_value(
                "lateness_bucket", labels
            )
        assert batched.get_sample_value("lateness_count") == count
        assert batched.get_sample_value("lateness_sum") == pytest.approx(
            alone.get_sample_value("lateness_sum")
        )

    def test_fired_timers_are_observed_by_their_lateness(self) -> None:
        """timers_fired puts each timer's reachedAt - dueAt in the lateness histogram."""
        metrics = PrometheusInstrumentation()
        due = datetime(2030, 1, 1, tzinfo=UTC)
        entries = [
            TimerEntry(
                tenant_id="t",
                service_call_id=f"c{ms}",
                due_at=due,
                registered_at=datetime(2029, 1, 1, tzinfo=UTC),
            ).reach(due + timedelta(milliseconds=ms))
            for ms in (0, 3, 3, 2000)
        ]
        metrics.timers_fired(entries)
        sample = metrics.registry.get_sample_value
        assert sample("timer_firing_lateness_seconds_bucket", {"le": "0.001"}) == 1.0
        assert sample("timer_firing_lateness_seconds_bucket", {"le": "0.005"}) == 3.0
        assert sample("timer_firing_lateness_seconds_bucket", {"le": "2.5"}) == 4.0
        assert sample("timer_firing_lateness_seconds_sum") == pytest.approx(2.006)
