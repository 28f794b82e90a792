"""TraceContext: W3C trace context as plain data, kept with a timer, never in the JSON body."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from timer_core import DueTimeReached, MessageEnvelope, TraceContext, ValidationError
from timer_core.testing import strategies as ts

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class TestTraceContext:
    def test_parts_of_the_traceparent(self) -> None:
        """trace_id, span_id and the sampled flag are read from the traceparent."""
        context = TraceContext(TRACEPARENT)
        assert context.trace_id == "0af7651916cd43dd8448eb211c80319c"
        assert context.span_id == "b7ad6b7169203331"
        assert context.sampled
        assert not TraceContext(TRACEPARENT[:-2] + "00").sampled

    @pytest.mark.parametrize(
        "traceparent",
        [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            TRACEPARENT + "\r\nX-Injected: 1",
        ],
    )
    def test_invalid_traceparent_is_refused(self, traceparent: str) -> None:
        """Anything but a W3C traceparent raises ValidationError, and from_headers ignores it."""
        with pytest.raises(ValidationError, match="traceparent"):
            TraceContext(traceparent)
        assert TraceContext.from_headers({"traceparent": traceparent}) is None

    def test_a_later_version_may_carry_more_fields(self) -> None:
        """A traceparent of a later version with extra fields is kept (W3C forward compat)."""
        later = "01" + TRACEPARENT[2:] + "-more"
        assert TraceContext.from_headers({"traceparent": later}) == TraceContext(later)

    def test_from_headers_drops_a_bad_tracestate_and_keeps_the_parent(self) -> None:
        """An over-long or non-ASCII tracestate is dropped; the traceparent still counts."""
        for bad in ("x" * 513, "vendor=caf\u00e9", "a=1\nb=2"):
            context = TraceContext.from_headers({"traceparent": TRACEPARENT, "tracestate": bad})
            assert context == TraceContext(TRACEPARENT)

    def test_headers_round_trip(self) -> None:
        """headers() gives back what from_headers() read; no tracestate, no header for it."""
        for state in ("congo=t61rcWkgMzE", None):
            context = TraceContext(TRACEPARENT, state)
            assert TraceContext.from_headers(context.headers()) == context
        assert TraceContext(TRACEPARENT).headers() == {"traceparent": TRACEPARENT}
        assert TraceContext.from_headers({}) is None
        assert TraceContext.from_headers(None) is None


class TestWithTraceContext:
    @given(ts.event_envelopes(), st.none() | ts.trace_contexts(), st.none() | st.integers(0, 99))
    def test_equals_evolve(
        self,
        envelope: MessageEnvelope[DueTimeReached],
        context: TraceContext | None,
        position: int | None,
    ) -> None:
        """with_trace_context gives what attrs.evolve gives, every other field kept as is."""
        envelope = attrs.evolve(envelope, position=position)
        fast = envelope.with_trace_context(context)
        assert fast == attrs.evolve(envelope, trace_context=context)
        assert fast.trace_context is context
        for field in attrs.fields(MessageEnvelope):
            if field.name != "trace_context":
                assert getattr(fast, field.name) is getattr(envelope, field.name)
