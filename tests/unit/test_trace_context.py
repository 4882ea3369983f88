"""Trace context helpers: nothing is sent when tracing is off, and a context round-trips."""

from __future__ import annotations

from typing import cast

from opentelemetry import trace
from opentelemetry.sdk.trace import Span, TracerProvider

from canteen.tracing import (
    context_from_metadata,
    context_from_traceparent,
    trace_id_of,
    trace_metadata,
    traceparent_of,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_tracing_off_sends_no_context() -> None:
    # No SDK provider installed: the API's tracer makes spans that record nothing.
    span = trace.get_tracer("test").start_span("off")
    assert not span.is_recording()
    assert trace_metadata(span) == ()
    assert traceparent_of(span) == ""
    assert trace_id_of(span) == ""


def test_a_child_of_received_metadata_keeps_the_trace_and_names_its_parent() -> None:
    tracer = TracerProvider().get_tracer("test")
    parent_ctx = context_from_metadata([("traceparent", TRACEPARENT), ("x-request-id", "r1")])
    span = cast(Span, tracer.start_span("child", context=parent_ctx))
    assert trace_id_of(span) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    sent = traceparent_of(span)
    assert sent.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert sent.split("-")[2] == format(span.get_span_context().span_id, "016x")
    # And the worker's side reads it back as the parent of its own span.
    grandchild = cast(Span, tracer.start_span("worker", context=context_from_traceparent(sent)))
    assert grandchild.parent is not None
    assert grandchild.parent.span_id == span.get_span_context().span_id


def test_a_malformed_traceparent_starts_a_fresh_trace() -> None:
    tracer = TracerProvider().get_tracer("test")
    span = cast(Span, tracer.start_span("root", context=context_from_traceparent("00-zz-yy-01")))
    assert span.parent is None and trace_id_of(span) != ""
