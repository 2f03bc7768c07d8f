"""W3C trace context from the job's own OpenTelemetry spans to the orchestrator.

When the code calling the SDK has a current OpenTelemetry span (a training loop's ``step``
span), every call the SDK makes carries that span's context (``traceparent``, ``tracestate``)
in its gRPC metadata, so the orchestrator's server spans (Acquire, Yield) are its children.

OpenTelemetry is optional here: the SDK depends on grpclib and betterproto2 only
(packaging/sdk), and a job that has a span to propagate has ``opentelemetry-api`` installed
by definition. Without it every function below does nothing, at the cost of one check.

What each call carries is the context current where it is *opened*:

- a unary call and an Acquire wait: the caller's context (an Acquire re-opened after a
  failover is re-opened by the same acquire, in the same context);
- a YieldStream is shared by every yield of the client over one connection, so its metadata
  carries the context of the yield that opened it, which says nothing about later yields: each
  YieldRequest carries its own context in ``trace_context`` (:func:`carrier`), and the
  orchestrator takes the parent of a streamed Yield from there only;
- the synchronous client runs its calls on a loop in another thread: ``asyncio``'s
  ``run_coroutine_threadsafe`` copies the caller's contextvars into the task it starts there,
  so the caller's span is current in the call (tests/tracing/test_job_trace.py checks it);
- background work that outlives the call that started it (the session keepalive) runs
  detached from the caller's span (:func:`detached`), or every keepalive of the process
  would hang under the first step that opened the session.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from grpclib.client import Channel
from grpclib.events import SendRequest, listen

T = TypeVar("T")

try:
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _otel_trace
    from opentelemetry.propagate import inject as _inject
except ImportError:  # pragma: no cover - exercised only where OpenTelemetry is absent
    _otel_context = None  # type: ignore[assignment]
    _otel_trace = None  # type: ignore[assignment]
    _inject = None  # type: ignore[assignment]


def available() -> bool:
    """Whether OpenTelemetry's API is importable (without it nothing is propagated)."""
    return _otel_context is not None


def carrier() -> dict[str, str]:
    """The current span's W3C trace context as a string map; empty without a recording or
    remote span (no OpenTelemetry, no span, or a no-op tracer)."""
    if _otel_trace is None or _inject is None:
        return {}
    if not _otel_trace.get_current_span().get_span_context().is_valid:
        return {}
    headers: dict[str, str] = {}
    _inject(headers)
    return headers


async def _on_send_request(event: SendRequest) -> None:
    for key, value in carrier().items():
        # The metadata of a retried stream is built afresh, but never carry two parents.
        event.metadata.popall(key, None)
        event.metadata[key] = value


def install(channel: Channel) -> Channel:
    """Make every request ``channel`` sends carry the caller's trace context; ``channel``."""
    if available():
        listen(channel, SendRequest, _on_send_request)
    return channel


def detached(coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """``coro``, run outside any span (long-lived background work started by a call)."""
    if _otel_context is None:
        return coro
    return _attached(_otel_context.Context(), coro)


async def _attached(ctx: Any, coro: Coroutine[Any, Any, T]) -> T:
    assert _otel_context is not None
    # Attaching here changes only the context of the task awaiting this (the background
    # task's own copy), and is undone when it ends.
    token = _otel_context.attach(ctx)
    try:
        return await coro
    finally:
        _otel_context.detach(token)
