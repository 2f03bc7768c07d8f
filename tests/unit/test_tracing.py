"""Tracing's switches and trace context (timeslice.tracing): when the OTEL_* environment turns
tracing on, and a span's W3C context carried to another process and back as a parent or a
link. Spans of real services are in tests/tracing/."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from timeslice.tracing import (
    carrier_of,
    context_from,
    link_to,
    provider_from_env,
    tracer_for,
    tracing_requested,
)


def test_tracing_is_on_only_when_the_environment_asks() -> None:
    assert not tracing_requested({})
    assert not tracing_requested({"OTEL_SERVICE_NAME": "x"})
    assert tracing_requested({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing_requested({"OTEL_TRACES_EXPORTER": " jaeger , otlp"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"})
    # "none" wins, as the OpenTelemetry specification says, even with an endpoint set.
    assert not tracing_requested(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    )


def test_off_is_no_provider_and_the_no_op_tracer() -> None:
    assert provider_from_env("timeslice-orchestrator", {}) is None
    tracer = tracer_for(None)
    with tracer.start_as_current_span("s") as span:
        assert carrier_of(span) == {}  # a no-op span carries nothing


def test_the_service_name_is_the_environments_else_the_services() -> None:
    env = {"OTEL_TRACES_EXPORTER": "console"}
    provider = provider_from_env("timeslice-agent", env)
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "timeslice-agent"
    finally:
        provider.shutdown()
    provider = provider_from_env("timeslice-agent", {**env, "OTEL_SERVICE_NAME": "agent-n1"})
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "agent-n1"
    finally:
        provider.shutdown()


def test_a_carried_context_comes_back_as_the_same_span_for_a_parent_or_a_link() -> None:
    tracer = tracer_for(TracerProvider())
    with tracer.start_as_current_span("switch") as span:
        carrier = carrier_of(span)
    sent = span.get_span_context()
    assert carrier["traceparent"].startswith(f"00-{sent.trace_id:032x}-{sent.span_id:016x}-")
    parent = context_from(carrier)
    assert parent is not None
    with tracer.start_as_current_span("checkpoint", context=parent) as child:
        assert child.get_span_context().trace_id == sent.trace_id
        assert child.parent is not None and child.parent.span_id == sent.span_id  # type: ignore[attr-defined]
    link = link_to(carrier)
    assert link is not None and link.context.span_id == sent.span_id
    assert context_from({}) is None
    assert link_to({}) is None
    assert link_to({"traceparent": "not a trace context"}) is None
    assert trace.get_current_span().get_span_context().is_valid is False
