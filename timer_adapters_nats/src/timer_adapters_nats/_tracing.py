"""The caller's current OpenTelemetry trace context, when OpenTelemetry is installed.

Optional: without ``opentelemetry-api`` (the ``otel`` extra) there is never a context, and a
command goes out exactly as before.
"""

from __future__ import annotations

from timer_core import TraceContext

__all__ = ["current_trace_context"]

try:
    from opentelemetry import propagate
except ImportError:  # the extra is not installed: nothing to propagate
    propagate = None  # type: ignore[assignment]


def current_trace_context() -> TraceContext | None:
    """The W3C context of the span active in the caller, through the global propagator."""
    if propagate is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return TraceContext.from_headers(carrier)
