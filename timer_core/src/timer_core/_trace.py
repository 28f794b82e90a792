"""W3C trace context as plain data: what a traced ``ScheduleTimer`` carries, kept with its timer.

Timer does no tracing itself. It keeps the ``traceparent`` and ``tracestate`` a command came
with beside the timer and hands them to the ``DueTimeReached`` the timer causes, so a host
with a tracer (the OpenTelemetry extra of ``timer-service``) can link the firing to the
request that scheduled it. Messages carry them in headers, never in the JSON body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from timer_core.errors import ValidationError

__all__ = ["TRACEPARENT_HEADER", "TRACESTATE_HEADER", "TraceContext"]

TRACEPARENT_HEADER = "traceparent"
"""The W3C header naming the trace and the span a message was sent from."""
TRACESTATE_HEADER = "tracestate"
"""The W3C header with vendors' trace state, passed along unchanged."""

# Version 00 exactly; a later version may append fields after these four (W3C, section 3.3).
_TRACEPARENT = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<span_id>[0-9a-f]{16})"
    r"-(?P<flags>[0-9a-f]{2})(?P<rest>-[\x21-\x7e]*)?",
    re.ASCII,
)
_MAX_TRACESTATE = 512  # what W3C asks every vendor to propagate at least
_TRACESTATE = re.compile(r"[\x20-\x7e]*", re.ASCII)


def _check_traceparent(_: object, __: object, value: str) -> None:
    match = _TRACEPARENT.fullmatch(value) if isinstance(value, str) else None
    if (
        match is None
        or match["version"] == "ff"
        or (match["version"] == "00" and match["rest"] is not None)
        or match["trace_id"] == "0" * 32
        or match["span_id"] == "0" * 16
    ):
        raise ValidationError(
            f"traceparent must be a W3C traceparent like "
            f"00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, got {value!r:.80}"
        )


def _check_tracestate(_: object, __: object, value: str | None) -> None:
    if value is None:
        return
    if (
        not isinstance(value, str)
        or len(value) > _MAX_TRACESTATE
        or _TRACESTATE.fullmatch(value) is None
    ):
        raise ValidationError(
            f"tracestate must be at most {_MAX_TRACESTATE} printable ASCII characters, "
            f"got {value!r:.80}"
        )


@attrs.frozen(slots=True)
class TraceContext:
    """A W3C trace context: the span a message was sent from, and the vendors' trace state.

    Both values are checked on construction (:class:`~timer_core.errors.ValidationError`);
    :meth:`from_headers` instead ignores what it cannot use, as W3C asks of receivers.
    """

    traceparent: str = attrs.field(validator=_check_traceparent)
    tracestate: str | None = attrs.field(default=None, validator=_check_tracestate)

    @property
    def trace_id(self) -> str:
        """The 32 hex digits naming the trace."""
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        """The 16 hex digits naming the span the message was sent from."""
        return self.traceparent[36:52]

    @property
    def sampled(self) -> bool:
        """Whether the sender recorded its span (the ``sampled`` trace flag)."""
        return bool(int(self.traceparent[53:55], 16) & 1)

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None) -> TraceContext | None:
        """The context in ``traceparent``/``tracestate`` headers, or None.

        A missing or invalid ``traceparent`` means no context (the message itself is still
        good); an invalid ``tracestate`` is dropped, keeping the ``traceparent``.
        """
        if not headers:
            return None
        traceparent = headers.get(TRACEPARENT_HEADER)
        if traceparent is None:
            return None
        try:
            _check_traceparent(None, None, traceparent)
        except ValidationError:
            return None
        tracestate = headers.get(TRACESTATE_HEADER) or None
        try:
            _check_tracestate(None, None, tracestate)
        except ValidationError:
            tracestate = None
        return cls(traceparent, tracestate)

    def headers(self) -> dict[str, str]:
        """The context as message headers (``tracestate`` only when there is one)."""
        if self.tracestate is None:
            return {TRACEPARENT_HEADER: self.traceparent}
        return {TRACEPARENT_HEADER: self.traceparent, TRACESTATE_HEADER: self.tracestate}
