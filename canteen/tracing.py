"""OpenTelemetry tracing across gateway → scheduler → worker; off unless an endpoint is set.

With no ``--otlp-endpoint`` (and no ``OTEL_EXPORTER_OTLP_ENDPOINT``) the API's no-op tracer is
used: spans are not recorded and no trace context is sent. With one, spans are batched and
exported over OTLP/gRPC. The context travels as W3C ``traceparent`` in gRPC metadata from the
gateway to the scheduler, and inside each ``NewSequence`` from the scheduler to the worker
(the Run stream multiplexes many requests, so stream metadata cannot carry it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from canteen.logging import get_logger
from canteen.tls import Tls

log = get_logger(__name__)

OTLP_ENDPOINT_HELP = (
    "OTLP/gRPC endpoint for traces, e.g. http://127.0.0.1:4317 "
    "(empty: OTEL_EXPORTER_OTLP_ENDPOINT, else tracing off)"
)
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_KEYS = ("traceparent", "tracestate")


def configure_tracing(service_name: str, endpoint: str, tls: Tls | None = None) -> bool:
    """Installs an exporting tracer provider when an endpoint is configured; True if so.

    An ``https://`` endpoint inside the suite is dialled with the service's own client
    certificate (mutual TLS) when it has one; ``http://`` is plaintext.
    """
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return False
    # Imported only when tracing is on: the SDK and exporter are not needed otherwise.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    is_plain = endpoint.startswith("http://")
    credentials = tls.channel_credentials() if tls is not None and not is_plain else None
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=is_plain, credentials=credentials)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    log.info("tracing on", endpoint=endpoint)
    return True


def shutdown_tracing() -> None:
    """Flushes spans still buffered (a no-op when tracing is off)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from gRPC invocation metadata (empty when absent)."""
    carrier = {
        key: value if isinstance(value, str) else value.decode("latin-1")
        for key, value in (metadata or ())
        if key in _TRACE_KEYS
    }
    return _PROPAGATOR.extract(carrier)


def context_from_traceparent(traceparent: str) -> Context:
    return _PROPAGATOR.extract({"traceparent": traceparent} if traceparent else {})


def trace_metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``span`` as the parent; empty when it is not recording."""
    carrier: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return tuple(carrier.items())


def traceparent_of(span: trace.Span) -> str:
    return dict(trace_metadata(span)).get("traceparent", "")


def trace_id_of(span: trace.Span) -> str:
    """The span's trace id in hex, for log lines; empty when not traced."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
