"""Traces reach a real receiver: the services, as separate processes configured only by the
standard ``OTEL_*`` environment, export over OTLP/gRPC to a trace collector built from the
OpenTelemetry proto service definitions; one switch's spans arrive, from the orchestrator and
from every agent, joined into one trace by their parent links."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    attributes: dict[str, object]


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
                        )
                    )
        return pb.ExportTraceServiceResponse()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    server = grpc.aio.server()
    receiver = Collector()
    pb_grpc.add_TraceServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield receiver, port
    finally:
        await server.stop(grace=None)


async def test_a_switch_arrives_at_an_otlp_receiver_as_one_trace(
    cluster_factory: ClusterFactory, collector: tuple[Collector, int]
) -> None:
    receiver, port = collector
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon after each span ends
    }
    cluster = cluster_factory(replicas=1, agents=2, env=env, agent_args=["--sim-state-gb", "0.1"])
    sockets = cluster.agent_sockets
    workers = [
        register("g", job_id=job, socket=str(sockets[node])) for job in "ab" for node in sockets
    ]
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
        ):
            await a.acquire("g", timeout=30)
            waiter = asyncio.create_task(b.acquire("g", timeout=30))
            await asyncio.sleep(0.3)
            await a.yield_("g")
            grant = await waiter
            assert grant.previous_job_id == "a"  # a switch ran (b had nothing to restore)
            await b.yield_("g")
    finally:
        for w in workers:
            w.close()

    def switch_to_b() -> list[ReceivedSpan]:
        return [
            s
            for s in receiver.spans
            if s.name == "timeslice.switch" and s.attributes.get("timeslice.to_job") == "b"
        ]

    nodes = sorted(sockets)
    deadline = time.monotonic() + 20
    while True:
        roots = switch_to_b()
        if roots:
            trace = [s for s in receiver.spans if s.trace_id == roots[0].trace_id]
            agent_spans = [s for s in trace if s.name.startswith("timeslice.agent.")]
            if len(agent_spans) == 2 * len(nodes):
                break
        assert time.monotonic() < deadline, [(s.service, s.name) for s in receiver.spans]
        await asyncio.sleep(0.1)

    (root,) = roots
    by_id = {s.span_id: s for s in trace}
    assert root.service == "timeslice-orchestrator" and root.parent_span_id == b""
    phases = {s.name: s for s in trace if s.parent_span_id == root.span_id}
    assert set(phases) == {"timeslice.evict", "timeslice.restore"}
    for phase, kind in (("evict", "checkpoint"), ("restore", "restore")):
        per_node = [s for s in trace if s.parent_span_id == phases[f"timeslice.{phase}"].span_id]
        assert sorted(s.name for s in per_node) == [f"timeslice.{phase} {n}" for n in nodes]
        for node_span in per_node:
            # The agent's span, exported by the agent's own process, names the
            # orchestrator's span for its node as its parent: the link crossed processes.
            children = [s for s in agent_spans if s.parent_span_id == node_span.span_id]
            assert [c.name for c in children] == [f"timeslice.agent.{kind}"]
            (child,) = children
            assert child.service == "timeslice-agent"
            assert child.attributes["timeslice.node"] == node_span.attributes["timeslice.node"]
            assert by_id[child.parent_span_id] is node_span
