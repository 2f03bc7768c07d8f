"""The caller's span travels in every call's metadata: what the SDK injects, and when not."""

from __future__ import annotations

import asyncio

from grpclib.events import SendRequest
from multidict import MultiDict
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from timeslice import _trace_context

TRACER = TracerProvider().get_tracer("test")


def traceparent_of(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_no_span_no_context() -> None:
    assert _trace_context.available()
    assert _trace_context.carrier() == {}


def test_the_current_span_is_the_carrier() -> None:
    with TRACER.start_as_current_span("step") as span:
        assert _trace_context.carrier()["traceparent"] == traceparent_of(span)


async def test_a_request_carries_its_callers_span_and_only_one_parent() -> None:
    metadata: MultiDict[str] = MultiDict({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    event = SendRequest(  # type: ignore[no-untyped-call]
        metadata=metadata, method_name="/x/Y", deadline=None, content_type="application/grpc"
    )
    with TRACER.start_as_current_span("step") as span:
        await _trace_context._on_send_request(event)
    assert metadata.getall("traceparent") == [traceparent_of(span)]


async def test_detached_work_runs_outside_the_span_that_started_it() -> None:
    seen: list[bool] = []

    async def keepalive() -> None:
        seen.append(trace.get_current_span().get_span_context().is_valid)

    with TRACER.start_as_current_span("step"):
        await asyncio.create_task(_trace_context.detached(keepalive()))
        await asyncio.create_task(keepalive())
    assert seen == [False, True]
