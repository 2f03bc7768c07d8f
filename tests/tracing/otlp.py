"""A real OTLP trace receiver for the tracing tests: the OTLP/gRPC TraceService, built from the
OpenTelemetry proto service definitions, keeping every span it is sent."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    attributes: dict[str, object]
    links: tuple[tuple[bytes, bytes], ...] = ()
    """(trace id, span id) of each span this one links to."""


class Collector(pb_grpc.TraceServiceServicer):
    """The OTLP TraceService, keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []

    async def Export(  # the proto's method name
        self, request: pb.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes: dict[str, object] = {}
                    for a in span.attributes:
                        kind = a.value.WhichOneof("value")
                        attributes[a.key] = getattr(a.value, kind) if kind else None
                    self.spans.append(
                        ReceivedSpan(
                            service,
                            span.name,
                            span.trace_id,
                            span.span_id,
                            span.parent_span_id,
                            attributes,
                            tuple((link.trace_id, link.span_id) for link in span.links),
                        )
                    )
        return pb.ExportTraceServiceResponse()


async def start_collector() -> tuple[grpc.aio.Server, Collector, int]:
    """A started receiver on a free loopback port: (server, collector, port)."""
    server = grpc.aio.server()
    receiver = Collector()
    pb_grpc.add_TraceServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, receiver, port


def otlp_env(port: int) -> dict[str, str]:
    """The standard OTEL_* environment that makes a service export to the receiver."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon after each span ends
    }
