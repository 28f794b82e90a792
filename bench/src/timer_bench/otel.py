"""What OpenTelemetry costs the fire path: timers/s with it off, on, and on with traced timers.

Each measurement is a fresh process: a SQLite store holding ``--timers`` overdue timers, a
``nats-server`` of its own, and a ``TimerWorker`` (batches of 100) publishing them all,
acked, and marking them ``Reached``. Variants: ``off`` (Prometheus only, the service's
default), ``sdk`` (``OtelInstrumentation`` on SDK providers exporting to a sink, so Timer's
hooks and the SDK are measured, not a collector), ``sdk-traced`` (every timer scheduled with
a sampled trace context), ``sdk-timer-spans`` (a ``timer.due`` span per traced timer), and
``baseline`` (``off`` on the sources of ``--baseline-ref``). Variants alternate in rotated
order; the figure is the median of each round's ratio to ``off``. Then the hooks of one
firing alone, without store or broker.

Each measurement runs as ``python -m timer_bench.otel --child VARIANT --timers N``, the
baseline's with that commit's packages first on ``PYTHONPATH``: this module imports only the
kit, ``watched`` (which needs no more of ``timer_core`` than an earlier commit has) and the
packages under test, never ``procs``, which uses API an earlier commit lacks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs

# The kit, the watching publisher and the packages under test only: the baseline's child
# imports this module on an earlier commit's packages, which the parent's helpers (procs)
# may not fit.
from timer_bench import kit
from timer_bench.watched import WatchedPublisher

VARIANTS = ("off", "sdk", "sdk-traced", "sdk-timer-spans")
BATCH = 100


def traced(entry: Any, i: int) -> Any:
    from timer_core import TraceContext

    context = TraceContext(f"00-{i + 1:032x}-{i + 1:016x}-01", "bench=1")
    return attrs.evolve(entry, trace_context=context)


async def fire_path(variant: str, timers: int, work: Path) -> dict[str, float]:
    """Store ``timers`` overdue timers, then time a worker firing them all through NATS."""
    from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import Instrumentation, TimerEntry
    from timer_service.metrics import PrometheusInstrumentation

    instrumentation: Instrumentation = PrometheusInstrumentation()
    shutdown = None
    if variant.startswith("sdk"):
        instrumentation, shutdown = sdk(instrumentation, timer_spans=variant == "sdk-timer-spans")
    now = datetime.now(UTC)
    entries = [
        TimerEntry(
            tenant_id=f"tenant-{i % 10}",
            service_call_id=f"call-{i:07d}",
            due_at=now - timedelta(seconds=60) + timedelta(microseconds=i),
            registered_at=now - timedelta(seconds=120),
            correlation_id=f"corr-{i}",
        )
        for i in range(timers)
    ]
    if variant in ("sdk-traced", "sdk-timer-spans"):
        entries = [traced(entry, i) for i, entry in enumerate(entries)]
    server = NatsServerProcess(work / "nats", host="127.0.0.1", port=0)
    server.start()
    try:
        async with SqliteTimerStore(work / "timer.db") as store:
            for start in range(0, timers, 1000):
                await store.apply(entries[start : start + 1000])
            async with NatsBroker(NatsSettings(url=server.url)) as broker:
                watched = WatchedPublisher(broker.publisher, timers)
                cpu = time.process_time()
                elapsed = await watched.fire_all(
                    store, batch=BATCH, instrumentation=instrumentation
                )
                cpu = time.process_time() - cpu
    finally:
        server.stop()
        if shutdown is not None:
            shutdown()
    return {"rate": timers / elapsed, "cpu_us": cpu / timers * 1e6}


def sdk(inner: Any, *, timer_spans: bool) -> tuple[Any, Any]:
    """``OtelInstrumentation`` on SDK providers exporting to sinks; and their shutdown."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from timer_service.otel import OtelInstrumentation

    class SpanSink(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class MetricSink(MetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 0, **kwargs: Any) -> Any:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 0) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 0, **kwargs: Any) -> None:
            pass

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(SpanSink()))
    reader = PeriodicExportingMetricReader(MetricSink(), export_interval_millis=1000)
    meter_provider = MeterProvider(metric_readers=[reader])

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    instrumentation = OtelInstrumentation(
        inner,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        timer_spans=timer_spans,
    )
    return instrumentation, shutdown


def hooks(batches: int) -> dict[str, float]:
    """Microseconds per timer of one firing's hooks alone (building the events, then the
    instrumentation), the least of 5 repetitions: other work only adds."""
    from timer_core import TimerEntry
    from timer_core.events import build_due_event
    from timer_core.instrumentation import NO_INSTRUMENTATION
    from timer_service.metrics import PrometheusInstrumentation

    now = datetime.now(UTC).replace(microsecond=0)
    plain = [
        TimerEntry(tenant_id="t", service_call_id=f"c{i}", due_at=now, registered_at=now)
        for i in range(BATCH)
    ]
    with_context = [traced(e, i) for i, e in enumerate(plain)]
    with_sdk, shutdown = sdk(PrometheusInstrumentation(), timer_spans=False)
    spans, shutdown_spans = sdk(PrometheusInstrumentation(), timer_spans=True)
    cases = {
        "no instrumentation": (NO_INSTRUMENTATION, plain),
        "`off` (Prometheus)": (PrometheusInstrumentation(), plain),
        "`sdk`, untraced timers": (with_sdk, plain),
        "`sdk`, traced timers (links)": (with_sdk, with_context),
        "`sdk`, traced timers, `timer_spans`": (spans, with_context),
    }
    out = {}
    try:
        for name, (instrumentation, entries) in cases.items():
            reached = [entry.reach(now) for entry in entries]
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(batches):
                    envelopes = [build_due_event(entry, now) for entry in entries]
                    observer = instrumentation.firing_started(envelopes)
                    observer.published([None] * len(envelopes))
                    instrumentation.timers_fired(reached)
                    observer.finished()
                    instrumentation.poll_completed(0.01, len(reached))
                best = min(best, time.perf_counter() - started)
            out[name] = round(best / (batches * BATCH) * 1e6, 2)
    finally:
        shutdown()
        shutdown_spans()
    return out


def run_one(variant: str, timers: int, baseline_tree: Path | None) -> dict[str, Any]:
    child = variant
    if variant == "baseline":
        assert baseline_tree is not None
        child = "off"
    command = [sys.executable, "-m", "timer_bench.otel", "--child", child]
    command += ["--timers", str(timers)]
    return kit.run_child(command, baseline_tree if variant == "baseline" else None, variant)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="2,000 timers, 2 rounds")
    parser.add_argument("--timers", type=int, default=20_000, help="timers per measurement")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline-ref", help="also run `off` on the sources of this commit")
    parser.add_argument("--variants", help=f"subset of {', '.join(VARIANTS)} (`off` always)")


def main(args: argparse.Namespace) -> int:
    from timer_bench.procs import package_versions

    if args.quick:
        args.timers, args.rounds = 2_000, 2
    chosen = set(args.variants.split(",")) if args.variants else set(VARIANTS)
    variants = [v for v in VARIANTS if v == "off" or v in chosen]
    variants += ["baseline"] if args.baseline_ref else []
    machine = kit.machine(packages=package_versions("opentelemetry-sdk", "nats-py"))
    with tempfile.TemporaryDirectory(prefix="timer-otel-baseline-") as tree:
        baseline = kit.export_tree(args.baseline_ref, Path(tree)) if args.baseline_ref else None

        async def measure(variant: str, round_: int) -> dict[str, Any]:
            result = run_one(variant, args.timers, baseline)
            kit.progress(f"round {round_}: {variant:<15} {result['rate']:8,.0f} timers/s")
            return result

        taken = asyncio.run(kit.alternated(args.rounds, variants, measure))
    off_rate = [one["off"]["rate"] for one in taken]
    off_cpu = [one["off"]["cpu_us"] for one in taken]
    document = {
        "date": kit.today(),
        "machine": machine,
        "settings": {
            "timers": args.timers,
            "rounds": args.rounds,
            "batch": BATCH,
            "store": "SQLite (WAL, the default `synchronous=FULL`)",
            "baseline_ref": args.baseline_ref,
        },
        "variants": {
            variant: {
                "rate": kit.median(one[variant]["rate"] for one in taken),
                "cpu_us": kit.median(one[variant]["cpu_us"] for one in taken),
                "rate_vs_off": kit.median_ratio([one[variant]["rate"] for one in taken], off_rate),
                "rounds_rate_vs_off": kit.ratios([one[variant]["rate"] for one in taken], off_rate),
                "cpu_vs_off": kit.median_ratio([one[variant]["cpu_us"] for one in taken], off_cpu),
            }
            for variant in variants
        },
        "hooks_us": hooks(30 if args.quick else 300),
    }
    kit.write_result(document, args.output)
    from timer_bench.render import otel_block

    print(otel_block(document))
    return 0


def child_main(argv: list[str]) -> int:
    """``python -m timer_bench.otel --child VARIANT --timers N``: one :func:`fire_path` on
    whatever sources this process imports; prints its rate and CPU per timer."""
    parser = argparse.ArgumentParser(prog="python -m timer_bench.otel --child")
    parser.add_argument("--child", choices=VARIANTS, required=True)
    parser.add_argument("--timers", type=int, required=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="timer-otel-bench-") as work:
        print(json.dumps(asyncio.run(fire_path(args.child, args.timers, Path(work)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
