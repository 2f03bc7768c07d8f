"""Traces reach a real receiver: the services, as separate processes configured only by the
standard ``OTEL_*`` environment, export over OTLP/gRPC to a trace collector built from the
OpenTelemetry proto service definitions; one switch's spans arrive, from the orchestrator and
from every agent, joined into one trace by their parent links."""

from __future__ import annotations

import asyncio
import time

from tests.conftest import ClusterFactory
from tests.tracing.otlp import Collector, ReceivedSpan, otlp_env
from timeslice import AsyncTimeSliceClient, register


async def test_a_switch_arrives_at_an_otlp_receiver_as_one_trace(
    cluster_factory: ClusterFactory, collector: tuple[Collector, int]
) -> None:
    receiver, port = collector
    env = otlp_env(port)
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
    assert root.attributes["timeslice.switch_kind"] == "handover"
    by_id = {s.span_id: s for s in trace}
    assert root.service == "timeslice-orchestrator" and root.parent_span_id == b""
    phases = {s.name: s for s in trace if s.parent_span_id == root.span_id}
    assert set(phases) == {"timeslice.evict", "timeslice.restore"}
    for phase, kind in (("evict", "checkpoint"), ("restore", "restore")):
        per_node = [s for s in trace if s.parent_span_id == phases[f"timeslice.{phase}"].span_id]
        # One operation name for every node; the node is an attribute.
        assert [s.name for s in per_node] == [f"timeslice.{phase}.node"] * len(nodes)
        assert sorted(str(s.attributes["timeslice.node"]) for s in per_node) == nodes
        for node_span in per_node:
            # The agent's span, exported by the agent's own process, names the
            # orchestrator's span for its node as its parent: the link crossed processes.
            children = [s for s in agent_spans if s.parent_span_id == node_span.span_id]
            assert [c.name for c in children] == [f"timeslice.agent.{kind}"]
            (child,) = children
            assert child.service == "timeslice-agent"
            assert child.attributes["timeslice.node"] == node_span.attributes["timeslice.node"]
            assert by_id[child.parent_span_id] is node_span
