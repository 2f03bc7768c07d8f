"""What every RPC handler of the orchestrator shares: one server span (OpenTelemetry gRPC
conventions) and one mapping of errors to gRPC statuses.

A typed :class:`~timeslice.errors.TimeSliceError` leaves as its own status (the error table in
``timeslice.errors``) and is counted by kind; an etcd outage (:class:`StoreError`) leaves as
UNAVAILABLE, so clients retry elsewhere. A service that must answer differently for some
errors (the llm-d compat API answers UNAVAILABLE for a faulted group) passes ``status_of``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import betterproto2
from grpclib.const import Status
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer

from timeslice.errors import TimeSliceError, Unavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.etcd import StoreError

M = TypeVar("M", bound=betterproto2.Message)


@dataclass(frozen=True, slots=True)
class Call:
    """One RPC as its span names it."""

    service: str
    method: str
    group: str = ""
    job: str = ""


def _default_status(exc: TimeSliceError) -> Status:
    return exc.status


@contextlib.contextmanager
def served(
    call: Call,
    tracer: Tracer,
    metrics: Metrics,
    status_of: Callable[[TimeSliceError], Status] = _default_status,
    on_error: Callable[[TimeSliceError], None] | None = None,
    parent: Context | None = None,
) -> Iterator[Span]:
    """Run a handler's body in its server span; errors out as typed gRPC statuses.

    ``on_error`` sees each typed error before it leaves (an authorizer counting refusals).
    ``parent``: the span's parent context, when not the current one (the caller's span, from
    the request's metadata: ``timeslice.tracing.accept_trace_context``).
    """
    attributes: dict[str, str | int] = {
        "rpc.system": "grpc",
        "rpc.service": call.service,
        "rpc.method": call.method,
    }
    if call.group:
        attributes["timeslice.group"] = call.group
    if call.job:
        attributes["timeslice.job"] = call.job
    with tracer.start_as_current_span(
        f"{call.service}/{call.method}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except TimeSliceError as exc:
            metrics.rpc_errors.labels(kind=exc.kind.value).inc()
            if on_error is not None:
                on_error(exc)
            status = status_of(exc)
            failed(span, status, exc.message)
            raise exc.to_grpc(status) from exc
        except StoreError as exc:
            metrics.rpc_errors.labels(kind="unavailable").inc()
            failed(span, Status.UNAVAILABLE, str(exc))
            raise Unavailable(str(exc)).to_grpc() from exc
        span.set_attribute("rpc.grpc.status_code", Status.OK.value)


def failed(span: Span, status: Status, message: str) -> None:
    """Mark ``span`` as an RPC that ended with ``status``."""
    span.set_attribute("rpc.grpc.status_code", status.value)
    span.set_status(StatusCode.ERROR, message)


async def encoded_off_loop(message: M) -> M:
    """``message``, already encoded in a worker thread: return it from a handler whose answer
    is large (a listing of 100,000 groups takes 1.5 s to encode).

    grpclib encodes what a handler returns on the event loop, where a long encoding stalls
    every other call of the replica and its lease keepalive (a loaded host once lost the
    lease that way). In a thread the encoding shares the interpreter with the loop instead,
    which keeps running between the thread's slices.
    """
    payload = await asyncio.to_thread(message.SerializeToString)
    # grpclib's codec calls this method: it now hands over the bytes made in the thread.
    message.SerializeToString = lambda: payload  # type: ignore[method-assign]
    return message
