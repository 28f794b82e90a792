"""What OpenTelemetry costs the fire path: timers/s with it off, on, and on with traced timers.

Each measurement is a fresh process: a SQLite store holding ``--timers`` overdue timers, a
``nats-server`` of its own (file storage), and ``drain_due_timers`` in batches of 100
publishing them all (acked) and marking them ``Reached``, timed from the first find to the
last mark. Variants:

- ``off``: the service's default instrumentation (Prometheus), OpenTelemetry not set up;
- ``sdk``: ``OtelInstrumentation`` around it on SDK providers (a batch span processor and a
  periodic metric reader every second, both exporting to a sink that drops everything, so
  what is measured is Timer's instrumentation and the SDK, not a collector), timers untraced;
- ``sdk-traced``: the same with every timer scheduled with a sampled trace context, so each
  firing batch's span links to 100 scheduling spans and every event carries trace headers;
- ``sdk-timer-spans``: traced timers with ``timer_spans=True``, a ``timer.due`` span each;
- ``baseline`` (with ``--baseline-ref``): ``off`` run on the sources of another commit (e.g.
  the one before OpenTelemetry), to see what the hooks cost when nothing listens.

The machine is shared, so variants run interleaved, one round after another with the order
rotated, and the figure is the median over the rounds of each variant's rate divided by
``off``'s rate in the same round. Writes the "OpenTelemetry (bench/otel.py)" section of
bench/README.md.

    uv run --all-packages python bench/otel.py --baseline-ref <commit>   # about 3 minutes
    uv run --all-packages python bench/otel.py --quick                   # README untouched
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from io import BytesIO
from pathlib import Path
from typing import Any

from _readme import write_section

README = Path(__file__).with_name("README.md")
SECTION = "## OpenTelemetry (bench/otel.py)"
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "timer_core",
    "timer_adapters_memory",
    "timer_adapters_sqlite",
    "timer_adapters_nats",
    "timer_adapters_postgres",
    "timer_service",
)
VARIANTS = ("off", "sdk", "sdk-traced", "sdk-timer-spans")
BATCH = 100


# -- one measurement, in its own process ------------------------------------------------------


async def fire_path(variant: str, timers: int, work: Path) -> dict[str, Any]:
    """Store ``timers`` overdue timers, then time draining them all through NATS."""
    from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import Instrumentation, SystemClock, TimerEntry
    from timer_core.workflows import drain_due_timers
    from timer_service.metrics import PrometheusInstrumentation

    instrumentation: Instrumentation = PrometheusInstrumentation()
    shutdown = None
    if variant.startswith("sdk"):
        instrumentation, shutdown = _sdk_instrumentation(
            instrumentation, timer_spans=variant == "sdk-timer-spans"
        )
    traced = variant in ("sdk-traced", "sdk-timer-spans")
    now = datetime.now(UTC)
    store = SqliteTimerStore(work / "timer.db", pragmas={"cache_size": -32768})
    server = NatsServerProcess(work / "nats", host="127.0.0.1", port=0)
    server.start()
    try:
        await store.start()
        entries = []
        for i in range(timers):
            entry = TimerEntry(
                tenant_id=f"tenant-{i % 10}",
                service_call_id=f"call-{i:07d}",
                due_at=now - timedelta(seconds=60) + timedelta(microseconds=i),
                registered_at=now - timedelta(seconds=120),
                correlation_id=f"corr-{i}",
            )
            if traced:
                entry = _traced(entry, i)
            entries.append(entry)
        for start in range(0, timers, 1000):
            await store.apply(entries[start : start + 1000])
        broker = NatsBroker(NatsSettings(url=server.url))
        await broker.start()
        try:
            started = time.perf_counter()
            cpu = time.process_time()
            fired = 0
            while fired < timers:
                report = await drain_due_timers(
                    store,
                    broker.publisher,
                    SystemClock(),
                    batch_size=BATCH,
                    instrumentation=instrumentation,
                )
                fired += report.fired
                if report.failed:
                    raise RuntimeError(f"{len(report.failed)} publishes failed")
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu
        finally:
            await broker.aclose()
        pending = await store.count_scheduled()
        await store.aclose()
    finally:
        server.stop()
        if shutdown is not None:
            shutdown()
    assert pending == 0, pending
    return {"rate": timers / elapsed, "cpu_us": cpu / timers * 1e6}


def _traced(entry: Any, i: int) -> Any:
    import attrs

    from timer_core import TraceContext

    return attrs.evolve(
        entry, trace_context=TraceContext(f"00-{i + 1:032x}-{i + 1:016x}-01", "bench=1")
    )


def _sdk_instrumentation(inner: Any, *, timer_spans: bool) -> tuple[Any, Any]:
    """OtelInstrumentation on SDK providers that export to a sink."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

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
    meter_provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(MetricSink(), export_interval_millis=1000)]
    )

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


def child_main(variant: str, timers: int) -> None:
    with tempfile.TemporaryDirectory(prefix="timer-otel-bench-") as work:
        result = asyncio.run(fire_path(variant, timers, Path(work)))
    print(json.dumps(result))


# -- the hooks alone, per timer -----------------------------------------------------------------


def micro(batches: int = 300) -> dict[str, float]:
    """Microseconds per timer the instrumentation's hooks of a firing cost, alone: the least
    of 5 repetitions of ``batches`` batches of 100 (the least, as other work only adds)."""
    import attrs

    from timer_core import NO_INSTRUMENTATION, TimerEntry, TraceContext, build_due_event
    from timer_service.metrics import PrometheusInstrumentation

    now = datetime.now(UTC).replace(microsecond=0)
    plain = [
        TimerEntry(tenant_id="t", service_call_id=f"c{i}", due_at=now, registered_at=now)
        for i in range(BATCH)
    ]
    traced = [
        attrs.evolve(e, trace_context=TraceContext(f"00-{i + 1:032x}-{i + 1:016x}-01"))
        for i, e in enumerate(plain)
    ]
    prometheus = PrometheusInstrumentation()
    sdk, shutdown = _sdk_instrumentation(PrometheusInstrumentation(), timer_spans=False)
    spans, shutdown_spans = _sdk_instrumentation(PrometheusInstrumentation(), timer_spans=True)
    cases = {
        "no instrumentation": (NO_INSTRUMENTATION, plain),
        "`off` (Prometheus)": (prometheus, plain),
        "`sdk`, untraced timers": (sdk, plain),
        "`sdk`, traced timers (links)": (sdk, traced),
        "`sdk`, traced timers, `timer_spans`": (spans, traced),
    }
    results = {}
    # What the OpenTelemetry hooks cost the core with nothing listening (the base class's
    # no-op observer), on their own: the `off` path pays only this.
    envelopes = [build_due_event(entry, now) for entry in plain]
    acked: list[Any] = [None] * len(envelopes)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(batches):
            observer = NO_INSTRUMENTATION.firing_started(envelopes)
            observer.published(acked)
            observer.finished()
        best = min(best, time.perf_counter() - started)
    no_op_hooks = best / (batches * BATCH) * 1e6
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
            results[name] = best / (batches * BATCH) * 1e6
    finally:
        shutdown()
        shutdown_spans()
    results["the no-op hooks alone (what `off` pays for them)"] = no_op_hooks
    return results


def micro_table(results: dict[str, float]) -> str:
    base = results["no instrumentation"]
    lines = [
        "| hooks of one firing (build the event, then the instrumentation) | us per timer "
        "| instrumentation's own, us per timer |",
        "| --- | ---: | ---: |",
    ]
    for name, value in results.items():
        if name.startswith("the no-op hooks"):
            lines.append(f"| {name} | | {value:.3f} |")
        else:
            lines.append(f"| {name} | {value:.1f} | {value - base:.1f} |")
    return "\n".join(lines)


# -- the driver -------------------------------------------------------------------------------


def export_tree(ref: str, target: Path) -> Path:
    """The packages' sources at ``ref``, unpacked under ``target`` (no git state changes)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref, *PACKAGES],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def run_one(variant: str, timers: int, baseline_tree: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    child_variant = variant
    if variant == "baseline":
        assert baseline_tree is not None
        env["PYTHONPATH"] = os.pathsep.join(str(baseline_tree / p / "src") for p in PACKAGES)
        child_variant = "off"
    out = subprocess.run(
        [sys.executable, __file__, "--child", child_variant, "--timers", str(timers)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def machine() -> str:
    """nproc, CPU, Python and the versions that matter here (bench/report.py reads the CPU)."""
    from importlib.metadata import version

    from report import machine as described

    where = described()
    return (
        f"nproc {where['nproc']}, {where['cpu']}; Python {where['python']}, "
        f"opentelemetry-sdk {version('opentelemetry-sdk')}, nats-py {version('nats-py')}"
    )


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def report(
    variants: list[str], rounds: list[dict[str, dict[str, Any]]], timers: int, args: Any
) -> str:
    lines = [
        "| variant | timers/s (median) | rate vs `off` (median of rounds) | rate vs `off`, "
        "each round | CPU per timer (median) | CPU vs `off` (median of rounds) |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for variant in variants:
        rates = [r[variant]["rate"] for r in rounds]
        cpus = [r[variant]["cpu_us"] for r in rounds]
        ratios = [r[variant]["rate"] / r["off"]["rate"] for r in rounds]
        cpu_ratios = [r[variant]["cpu_us"] / r["off"]["cpu_us"] for r in rounds]
        lines.append(
            f"| `{variant}` | {statistics.median(rates):,.0f} | "
            f"{statistics.median(ratios):.3f}x | "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + f" | {statistics.median(cpus):.0f} us | {statistics.median(cpu_ratios):.3f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timers", type=int, default=20_000, help="timers fired per measurement")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--baseline-ref", help="also run `off` on the sources of this commit")
    parser.add_argument(
        "--variants", help=f"comma-separated subset of {', '.join(VARIANTS)} (`off` always runs)"
    )
    parser.add_argument("--quick", action="store_true", help="2,000 timers, 2 rounds, no README")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, args.timers)
        return 0
    if args.quick:
        args.timers, args.rounds = 2_000, 2
    chosen = set(args.variants.split(",")) if args.variants else set(VARIANTS)
    variants = [v for v in VARIANTS if v == "off" or v in chosen]
    variants += ["baseline"] if args.baseline_ref else []
    started_load = load()
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="timer-otel-baseline-") as tree:
        baseline_tree = export_tree(args.baseline_ref, Path(tree)) if args.baseline_ref else None
        for number in range(args.rounds):
            order = variants[number % len(variants) :] + variants[: number % len(variants)]
            results = {}
            for variant in order:
                results[variant] = run_one(variant, args.timers, baseline_tree)
                print(
                    f"round {number + 1}: {variant:<11} {results[variant]['rate']:8,.0f} timers/s",
                    file=sys.stderr,
                )
            rounds.append(results)
    ended_load = load()
    table = report(variants, rounds, args.timers, args)
    hooks = micro_table(micro(30 if args.quick else 300))
    baseline = (
        f" `baseline` is `off` on the sources of `{args.baseline_ref}`."
        if args.baseline_ref
        else ""
    )
    body = "\n\n".join(
        [
            f"Run: `uv run --all-packages python bench/otel.py"
            f"{' --baseline-ref ' + args.baseline_ref if args.baseline_ref else ''}` on "
            f"{datetime.now(UTC):%Y-%m-%d}. Fire path: {args.timers:,} overdue timers in SQLite "
            f"drained by `drain_due_timers` (batches of {BATCH}) through a local `nats-server` "
            "(acked, file storage), from the first find to the last mark; a fresh process, "
            "database and server per measurement; "
            f"{args.rounds} rounds, the variants interleaved in rotated order.{baseline} "
            "`sdk` exports to a sink (batch span processor, metrics read every second), so "
            "it counts Timer's instrumentation and the SDK, not a collector's network.",
            table,
            "The hooks alone, without the store or the broker (the least of 5 repetitions, so "
            "other work on the machine hardly shows): what one timer's firing costs in the "
            "instrumentation, against the fire path's CPU per timer above.",
            hooks,
            f"Machine: {machine()}; load average {started_load} at start, {ended_load} at the "
            "end (the machine is shared with other developers' builds and tests: compare the "
            "ratios, measured within one round, not the absolute rates).",
        ]
    )
    print(body)
    if not args.quick:
        write_section(SECTION, body, README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
