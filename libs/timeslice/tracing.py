"""OpenTelemetry tracing for the timeslice services, off unless the standard OTEL_* variables
ask for it.

Enabled when ``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``, or when an OTLP endpoint
is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); the OTLP
exporter then reads its own settings (endpoint, headers, protocol) from the environment as
usual. When off, services get OpenTelemetry's no-op tracer: no provider, no exporter, no
thread, and spans that cost a function call.

Trace context crosses from the orchestrator to the agents inside each directive
(``Directive.trace_context``, W3C ``traceparent``), so an agent's checkpoint span is a child of
the orchestrator's span for that node. From jobs it comes in each call's gRPC metadata (the
SDK sends the caller's current span, :mod:`timeslice._trace_context`), which
:func:`accept_trace_context` makes the parent of the call's server span; a waiter's context is
kept in its queue entry, and the switch that serves it links to it (docs/deployment.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from grpclib.events import RecvRequest, listen
from grpclib.server import Server
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Link, Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
INSTRUMENTATION = "timeslice"


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        return False
    return bool(
        exporters & {"otlp", "console"}
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def provider_from_env(
    service_name: str, environ: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """A provider exporting as the environment says, or None when tracing is off."""
    env = os.environ if environ is None else environ
    if not tracing_requested(env):
        return None
    name = env.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "console" in exporters:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if (
        "otlp" in exporters
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def tracer_for(provider: trace.TracerProvider | None) -> Tracer:
    """The tracer of ``provider``; the no-op tracer when it is None."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(INSTRUMENTATION)


def carrier_of(span: Span) -> dict[str, str]:
    """The W3C trace context of ``span`` as a string map (empty for a no-op span)."""
    if not span.get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def context_from(carrier: Mapping[str, str]) -> Context | None:
    """The parent context carried in a directive, or None when there is none."""
    if not carrier:
        return None
    return _PROPAGATOR.extract(dict(carrier))


def current_carrier() -> dict[str, str]:
    """The W3C trace context of the current span (empty when there is none)."""
    return carrier_of(trace.get_current_span())


def link_to(carrier: Mapping[str, str]) -> Link | None:
    """A span link to the span ``carrier`` names, or None when it names none."""
    ctx = context_from(carrier)
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def accept_trace_context(server: Server) -> None:
    """Make the caller's trace context (``traceparent`` in a request's metadata, as the SDK
    sends it) the current context of the handler, so its server span is the caller's child.

    grpclib dispatches RecvRequest in the task that then runs the handler (as
    ``identity.install`` relies on too): what is attached here is that handler's alone, and
    goes with its task.
    """

    async def on_request(event: RecvRequest) -> None:
        carrier = {k: v for k in _PROPAGATOR.fields if (v := event.metadata.get(k)) is not None}
        if "traceparent" in carrier:
            otel_context.attach(_PROPAGATOR.extract(carrier))

    listen(server, RecvRequest, on_request)
