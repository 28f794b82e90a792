"""W3C trace context: what a ``ScheduleTimer`` carries and its ``DueTimeReached`` carries on."""

from timer_core._trace import TRACEPARENT_HEADER, TRACESTATE_HEADER, TraceContext

__all__ = ["TRACEPARENT_HEADER", "TRACESTATE_HEADER", "TraceContext"]
