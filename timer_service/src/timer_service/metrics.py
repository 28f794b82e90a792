"""Prometheus metrics for the service: the core's instrumentation hook turned into series."""

from __future__ import annotations

import bisect
import collections
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from timer_core import (
    Command,
    CommandOutcome,
    Instrumentation,
    MessageEnvelope,
    PublishError,
    TimerEntry,
)
from timer_service.census import BUCKETS, Census

__all__ = [
    "COUNTED_AS",
    "LATENESS_BUCKETS",
    "POLL_BUCKETS",
    "PrometheusInstrumentation",
    "WorstTenants",
    "firing_lateness",
    "quarantine_age",
    "observe_all",
]

log = logging.getLogger("timer_service.events")

#: The ``outcome`` label of ``timer_commands_received_total`` for each command outcome:
#: ``stored`` when the store changed, ``stale`` for a command older than one already applied
#: to its timer, ``rejected`` for one refused (over quota), else ``ignored``.
COUNTED_AS: dict[str, str] = {
    CommandOutcome.SCHEDULED: "stored",
    CommandOutcome.CANCELLED: "stored",
    CommandOutcome.IGNORED_REACHED: "ignored",
    CommandOutcome.CANCEL_NOOP: "ignored",
    CommandOutcome.STALE: "stale",
    CommandOutcome.OVER_QUOTA: "rejected",  # dead-lettered by the source, counted here once
}

#: Buckets of the firing-lateness histogram, in seconds (OpenTelemetry's uses them too).
LATENESS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    3600.0,
)
#: Buckets of the worker-pass duration histogram, in seconds.
POLL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


def quarantine_age(since: datetime | None) -> float:
    """Seconds since ``since`` on the system clock (the oldest quarantine's); 0 for None."""
    if since is None:
        return 0.0
    return max(0.0, (datetime.now(UTC) - since).total_seconds())


def firing_lateness(entries: Sequence[TimerEntry]) -> list[float]:
    """Each fired timer's lateness in seconds: ``reachedAt`` minus when it could first have
    fired, its ``dueAt`` or, when it was stored after that, its ``registeredAt``.

    A timer scheduled in the past fires as soon as it is stored: it is not late by however
    far back its due time was (a ``dueAt`` of year 1 added 6.4e10 s to the histogram's sum,
    which every tenant shares: issue 43).
    """
    # One comprehension, no call per timer: this runs once per fired timer.
    return [
        (
            entry.reached_at  # type: ignore[operator]  # a fired timer's is set
            - (entry.due_at if entry.due_at >= entry.registered_at else entry.registered_at)
        ).total_seconds()
        for entry in entries
    ]


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe`` of each amount, with one locked increment per bucket the batch
    touches instead of two per amount (once per fired timer, measured at ~2 us each).

    Reads the unlabelled histogram's own bucket bounds and values (prometheus_client's
    attributes, stable for years); any other shape falls back to ``observe``, as does an
    empty batch. A test holds the two ways equal.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if (
        not amounts
        or not isinstance(bounds, list)
        or not isinstance(buckets, list)
        or total is None
        or len(bounds) != len(buckets)
        or bounds[-1] != math.inf
    ):
        for amount in amounts:
            histogram.observe(amount)
        return
    counts = collections.Counter(bisect.bisect_left(bounds, amount) for amount in amounts)
    total.inc(sum(amounts))
    for index, count in counts.items():
        buckets[index].inc(count)


class WorstTenants(Collector):
    """``timer_tenant_lateness_worst_seconds{tenant}``: the highest firing lateness of each
    of the ``top`` tenants whose timers fired latest in the last one to two ``window_s``.

    The shared histogram says how late timers fire; this says whose. Its labels are bounded:
    ``top`` tenants at a time, however many fire. Each window keeps one maximum per tenant
    that fired in it (at most ``most_tenants``; past that, the lower half is dropped, as it
    cannot reach the top), and the last two windows are reported.
    """

    def __init__(
        self,
        *,
        top: int = 10,
        window_s: float = 60.0,
        most_tenants: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.top = top
        self.window_s = window_s
        self.most_tenants = most_tenants
        self._clock = clock
        self._window_start = clock()
        self._current: dict[str, float] = {}
        self._previous: dict[str, float] = {}

    def observe(self, entries: Sequence[TimerEntry], lateness: Sequence[float]) -> None:
        """Note each fired timer's lateness against its tenant."""
        self._turn()
        current = self._current
        for entry, late in zip(entries, lateness, strict=True):
            tenant = entry.tenant_id
            if late > current.get(tenant, -math.inf):
                current[tenant] = late
        if len(current) > self.most_tenants:
            kept = heapq.nlargest(self.most_tenants // 2, current.items(), key=lambda kv: kv[1])
            self._current = dict(kept)

    def worst(self) -> list[tuple[str, float]]:
        """The ``top`` tenants by their highest lateness in the last two windows."""
        self._turn()
        merged = dict(self._previous)
        for tenant, late in self._current.items():
            if late > merged.get(tenant, -math.inf):
                merged[tenant] = late
        return heapq.nlargest(self.top, merged.items(), key=lambda kv: kv[1])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "timer_tenant_lateness_worst_seconds",
            f"Highest firing lateness of each of the {self.top} tenants whose timers fired "
            f"latest in the last {self.window_s:g}-{2 * self.window_s:g} s (lateness as in "
            "timer_firing_lateness_seconds).",
            labels=["tenant"],
        )
        for tenant, late in self.worst():
            family.add_metric([tenant], late)
        yield family

    def _turn(self) -> None:
        now = self._clock()
        if now - self._window_start < self.window_s:
            return
        # A window that ended longer than a window ago has nothing left to report.
        recent = now - self._window_start < 2 * self.window_s
        self._previous = self._current if recent else {}
        self._current = {}
        self._window_start = now


class PrometheusInstrumentation(Instrumentation):
    """Counts commands, firings, failures and timings into its own registry, and logs them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.commands = Counter(
            "timer_commands_received",
            "Commands received, by outcome (stored, ignored, stale, rejected).",
            ["outcome"],
            registry=self.registry,
        )
        self.processed = Counter(
            "timer_schedules_processed",
            "Timers fired: DueTimeReached acknowledged by the broker and marked Reached.",
            registry=self.registry,
        )
        self.publish_failures = Counter(
            "timer_publish_failures",
            "DueTimeReached publishes that were not acknowledged (the timer stays Scheduled).",
            registry=self.registry,
        )
        self.quarantines = Counter(
            "timer_quarantined",
            "Timers quarantined: their publish kept failing while others were published; "
            "left out until retried (timer-service quarantine).",
            registry=self.registry,
        )
        self.quarantined = Gauge(
            "timer_timers_quarantined",
            "Timers quarantined now (left out of every pass until retried).",
            registry=self.registry,
        )
        self._quarantined_since: datetime | None = None
        self.oldest_quarantined = Gauge(
            "timer_oldest_quarantined_seconds",
            "How long the longest-quarantined timer has been held, as of the scrape (0 when "
            "none is).",
            registry=self.registry,
        )
        self.oldest_quarantined.set_function(lambda: quarantine_age(self._quarantined_since))

        self.worker_errors = Counter(
            "timer_worker_errors",
            "Worker passes that failed as a whole (store errors); retried with backoff.",
            registry=self.registry,
        )
        self.purged = Counter(
            "timer_timers_purged",
            "Fired timers (and cancel tombstones) deleted by retention (TIMER_RETENTION).",
            registry=self.registry,
        )
        self.polling = Histogram(
            "timer_polling_duration_seconds",
            "Duration of one worker pass (find due, publish, mark).",
            buckets=POLL_BUCKETS,
            registry=self.registry,
        )
        self.lateness = Histogram(
            "timer_firing_lateness_seconds",
            "Firing lateness: reachedAt - max(dueAt, registeredAt), so a timer scheduled "
            "in the past counts from when it was stored.",
            buckets=LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.worst_tenants = WorstTenants()
        self.registry.register(self.worst_tenants)
        self.pending = Gauge(
            "timer_timers_pending",
            "Timers stored and still Scheduled (refreshed every few seconds, less often when "
            "counting them takes longer than 1% of the time).",
            registry=self.registry,
        )
        self.due = Gauge(
            "timer_timers_due",
            "Pending timers by when they are due (the census, refreshed every "
            "TIMER_CENSUS_INTERVAL): overdue, within 1m, 1h, 1d, or later; each counted up "
            "to timer_census_cap (a value at the cap means at least that many).",
            ["due"],
            registry=self.registry,
        )
        self.oldest_overdue = Gauge(
            "timer_oldest_overdue_seconds",
            "How long the oldest pending timer has been overdue (0 when none is; the census).",
            registry=self.registry,
        )
        self.census_cap = Gauge(
            "timer_census_cap",
            "The count at which each census bucket stops (TIMER_CENSUS_CAP).",
            registry=self.registry,
        )
        self.census_duration = Gauge(
            "timer_census_duration_seconds",
            "How long the last census took (its queries, end to end).",
            registry=self.registry,
        )
        self.instances = Gauge(
            "timer_instances_sharing",
            "Instances sharing the tenants, this one included: those it heard on the "
            "PostgreSQL LISTEN channel in the last 3.5 s (1 alone, on SQLite, or without "
            "LISTEN; refreshed every few seconds).",
            registry=self.registry,
        )
        self.broker_state_recreated = Counter(
            "timer_broker_state_recreated",
            "Streams and consumers found missing while running and recreated, by kind "
            "(stream, consumer).",
            ["what"],
            registry=self.registry,
        )
        self.clock_skew = Gauge(
            "timer_clock_skew_seconds",
            "This host's wall clock minus the clock that decides due times (PostgreSQL's), "
            "as last measured (every 2 s); positive: the host is ahead. 0 where the host's "
            "own clock decides (SQLite).",
            registry=self.registry,
        )
        self.last_poll = Gauge(
            "timer_last_poll_timestamp_seconds",
            "Unix time of the last completed worker pass.",
            registry=self.registry,
        )
        for outcome in ("stored", "ignored", "stale", "rejected"):
            self.commands.labels(outcome)
        for bucket, _, _ in BUCKETS:
            self.due.labels(bucket)

    def census_taken(self, census: Census) -> None:
        """Set the census gauges from one reading."""
        for bucket, count in census.counts.items():
            self.due.labels(bucket).set(count)
        self.oldest_overdue.set(census.oldest_overdue_s)
        self.census_cap.set(census.cap)
        self.census_duration.set(census.duration_s)

    def command_handled(self, envelope: MessageEnvelope[Command], outcome: str) -> None:
        self.commands.labels(COUNTED_AS[outcome]).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s %s",
                envelope.type,
                outcome,
                extra={
                    "tenant_id": envelope.tenant_id,
                    "service_call_id": envelope.payload.service_call_id,
                    "correlation_id": envelope.correlation_id,
                },
            )

    def commands_handled(
        self, envelopes: Sequence[MessageEnvelope[Command]], outcomes: Sequence[str]
    ) -> None:
        # One increment per outcome seen, not per command: a label lookup and a locked
        # increment per command were a few percent of the schedule path.
        if log.isEnabledFor(logging.DEBUG):
            super().commands_handled(envelopes, outcomes)
            return
        for outcome, count in collections.Counter(outcomes).items():
            self.commands.labels(COUNTED_AS[outcome]).inc(count)

    def command_rejected(self, subject: str, reason: str) -> None:
        self.commands.labels("rejected").inc()
        log.warning("command rejected on %s: %s", subject, reason, extra={"subject": subject})

    def timers_fired(self, entries: Sequence[TimerEntry]) -> None:
        self.processed.inc(len(entries))
        lateness = firing_lateness(entries)
        observe_all(self.lateness, lateness)
        self.worst_tenants.observe(entries, lateness)
        if log.isEnabledFor(logging.DEBUG):
            for entry in entries:
                log.debug(
                    "fired",
                    extra={
                        "tenant_id": entry.tenant_id,
                        "service_call_id": entry.service_call_id,
                        "correlation_id": entry.correlation_id,
                    },
                )

    def publish_failed(self, entry: TimerEntry, error: PublishError) -> None:
        self.publish_failures.inc()

    def timer_quarantined(self, entry: TimerEntry, error: PublishError, failures: int) -> None:
        self.quarantines.inc()

    def quarantine_size(self, count: int) -> None:
        self.quarantined.set(count)

    def quarantine_oldest(self, since: datetime | None) -> None:
        self._quarantined_since = since

    def poll_completed(self, duration_s: float, fired: int) -> None:
        self.polling.observe(duration_s)
        self.last_poll.set_to_current_time()

    def worker_error(self, error: BaseException) -> None:
        self.worker_errors.inc()

    def timers_purged(self, count: int) -> None:
        self.purged.inc(count)
