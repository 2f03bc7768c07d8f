"""The span tree of one switch over 4 nodes, collected with the SDK's in-memory exporter.

The orchestrator and four agents run in this process (real etcd, real gRPC over loopback and
unix sockets) so one TracerProvider sees the spans of both sides; the agents' spans join the
orchestrator's through the trace context each directive carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from timeslice import AsyncTimeSliceClient, register
from timeslice.tracing import provider_from_env, tracing_requested
from timeslice_agent.config import parse_config
from timeslice_agent.service import Agent
from timeslice_orchestrator.app import Orchestrator
from timeslice_orchestrator.config import parse_args
from timeslice_orchestrator.store.etcd import WatchBatch
from timeslice_tools.dev._procs import free_ports
from timeslice_tools.dev.etcd import EtcdServer

NODES = [f"node-{i}" for i in range(4)]


@dataclass
class WatchLag:
    """How late the orchestrator's mirror applies each watch batch (changed while it runs)."""

    seconds: float = 0.0


@contextlib.asynccontextmanager
async def traced_cluster(
    etcd: EtcdServer, tmp: Path, provider: TracerProvider, watch_lag: WatchLag | None = None
) -> AsyncIterator[tuple[str, dict[str, str]]]:
    grpc_port, http_port = free_ports(2)
    config = parse_args(
        [
            "--listen", f"127.0.0.1:{grpc_port}",
            "--http", f"127.0.0.1:{http_port}",
            "--etcd", etcd.endpoint,
            "--prefix", f"/timeslice/trace-{tmp.name}",
            "--replica-id", "r0",
            # Plaintext on purpose: one of the few tests that run without TLS (in-process
            # services on the plaintext etcd; TLS itself is covered by every cluster test).
            "--insecure",
            # No heartbeats: orchestrator and agents share this process's event loop, and on a
            # loaded machine a stalled loop would make an agent drop its stream mid-switch (the
            # stall gate), splitting the switch over two passes and two spans. Liveness has
            # its own tests (tests/faults/test_agent_pause.py).
            "--agent-liveness-timeout", "0",
        ]
    )  # fmt: skip
    orchestrator = Orchestrator(config, tracing=provider)
    if watch_lag is not None:
        # A slow watch: the mirror sees every change late (a loaded replica).
        apply = orchestrator.mirror._apply

        async def late(batch: WatchBatch) -> None:
            await asyncio.sleep(watch_lag.seconds)
            await apply(batch)

        orchestrator.mirror._apply = late  # type: ignore[method-assign]
    await orchestrator.start()
    stop = asyncio.Event()
    run_orchestrator = asyncio.create_task(orchestrator.run(stop))
    target = f"127.0.0.1:{grpc_port}"
    sockets = {node: str(tmp / node / "w.sock") for node in NODES}
    agents = [
        Agent(
            parse_config(
                [
                    "--orchestrator", target,
                    "--node", node,
                    "--backend", "sim",
                    "--worker-socket", sockets[node],
                    "--sim-state-gb", "0.1",
                    "--insecure",
                ],
                {},
            ),
            tracing=provider,
        )
        for node in NODES
    ]  # fmt: skip
    runs = [asyncio.create_task(agent.run(stop)) for agent in agents]
    try:
        async with asyncio.timeout(20):
            while len(orchestrator.mirror.agents()) < len(NODES):
                await asyncio.sleep(0.02)
        yield target, sockets
    finally:
        stop.set()
        await asyncio.gather(*runs, run_orchestrator, return_exceptions=True)
        await orchestrator.close()


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    pid = parent.context.span_id
    return [s for s in spans if s.parent is not None and s.parent.span_id == pid]


def start_time(span: ReadableSpan) -> int:
    assert span.start_time is not None, f"{span.name} never started"
    return span.start_time


def end_time(span: ReadableSpan) -> int:
    assert span.end_time is not None, f"{span.name} never ended"
    return span.end_time


# With a slow watch, the driver's mirror still shows the switch when b (granted directly, not
# through the mirror) yields and kicks it: the pass must wait for its own commit to show, not
# carry the committed switch on again (a second span, directives sent twice).
@pytest.mark.parametrize("watch_lag", [0.0, 0.2], ids=["prompt-watch", "slow-watch"])
async def test_switch_span_tree_over_four_nodes(
    etcd_server: EtcdServer, tmp_path: Path, watch_lag: float
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    lag = WatchLag()
    async with traced_cluster(etcd_server, tmp_path, provider, lag) as (target, sockets):
        # The agents run in this process, and an agent never acts on itself: each worker is
        # a child process this process registers (its own descendant, which is allowed).
        sleepers = [subprocess.Popen(["sleep", "120"]) for _ in range(2 * len(NODES))]
        pids = iter(c.pid for c in sleepers)
        workers = [
            await asyncio.to_thread(register, "g", job_id=job, socket=sockets[node], pid=next(pids))
            for job in ("a", "b")
            for node in NODES
        ]
        try:
            async with (
                AsyncTimeSliceClient(target, job_id="a", insecure=True) as a,
                AsyncTimeSliceClient(target, job_id="b", insecure=True) as b,
            ):
                await a.acquire("g", timeout=20)
                waiter = asyncio.create_task(b.acquire("g", timeout=20))
                await asyncio.sleep(0.3)
                exporter.clear()
                lag.seconds = watch_lag
                await a.yield_("g")
                grant = await waiter
                # b's first hold: its restore directives found nothing parked to bring back.
                assert not grant.restored and grant.previous_job_id == "a"
                await b.yield_("g")
        finally:
            for w in workers:
                w.close()
            for child in sleepers:
                child.kill()
                child.wait()
    spans = list(exporter.get_finished_spans())

    every = [s for s in spans if s.name == "timeslice.switch"]
    # The switch to a may end after the exporter was cleared (its grant reaches a, and the
    # test goes on, before the driver's pass closes the span on a loaded machine): only the
    # switch to b is the one under test, and there is exactly one.
    switches = [s for s in every if (s.attributes or {}).get("timeslice.to_job") == "b"]
    others = [dict(s.attributes or {}) for s in every if s not in switches]
    assert len(switches) == 1, [dict(s.attributes or {}) for s in every]
    assert all(o["timeslice.to_job"] == "a" for o in others), others
    switch = switches[0]
    assert switch.parent is None
    attrs = dict(switch.attributes or {})
    assert attrs["timeslice.group"] == "g"
    assert attrs["timeslice.from_jobs"] == "a" and attrs["timeslice.to_job"] == "b"
    assert attrs["timeslice.nodes"] == 4
    epoch = attrs["timeslice.epoch"]

    phases = {s.name: s for s in children(spans, switch)}
    assert set(phases) == {"timeslice.evict", "timeslice.restore"}
    assert end_time(phases["timeslice.evict"]) <= start_time(phases["timeslice.restore"])
    for phase, kind, job in (("evict", "checkpoint", "a"), ("restore", "restore", "b")):
        per_node = children(spans, phases[f"timeslice.{phase}"])
        # One operation name for every node (a tracing UI groups them); the node is an
        # attribute.
        assert [s.name for s in per_node] == [f"timeslice.{phase}.node"] * len(NODES)
        assert sorted(str((s.attributes or {})["timeslice.node"]) for s in per_node) == NODES
        for node_span in per_node:
            node_attrs = dict(node_span.attributes or {})
            assert node_attrs["timeslice.job"] == job
            assert node_attrs["timeslice.epoch"] == epoch
            assert node_attrs["timeslice.backend"] == "sim"
            assert node_attrs["timeslice.emulated"] is True
            agent_spans = children(spans, node_span)
            assert [s.name for s in agent_spans] == [f"timeslice.agent.{kind}"]
            agent_attrs = dict(agent_spans[0].attributes or {})
            assert agent_attrs["timeslice.node"] == node_attrs["timeslice.node"]
            assert agent_attrs["timeslice.status"] == "ok"
            if kind == "checkpoint":
                assert agent_attrs["timeslice.bytes_moved"] == 100_000_000
                assert node_attrs["timeslice.bytes_moved"] == 100_000_000
        # The nodes of a phase ran concurrently: their spans overlap.
        assert max(start_time(s) for s in per_node) < min(end_time(s) for s in per_node)

    # No span name carries an id (a node's name, a switch's epoch): those are attributes.
    named = {s.name for s in spans}
    assert not [n for n in named if " " in n or "node-" in n or str(epoch) in n], named

    rpcs = [s for s in spans if s.name == "timeslice.v1.TimeSlice/Yield"]
    assert rpcs, "client RPCs get server spans"
    rpc_attrs = dict(rpcs[0].attributes or {})
    assert rpc_attrs["rpc.system"] == "grpc"
    assert rpc_attrs["rpc.service"] == "timeslice.v1.TimeSlice"
    assert rpc_attrs["rpc.method"] == "Yield"
    assert rpc_attrs["rpc.grpc.status_code"] == 0


def test_tracing_is_off_unless_the_environment_asks() -> None:
    assert not tracing_requested({})
    assert provider_from_env("x", {}) is None
    assert not tracing_requested({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing_requested({"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    provider = provider_from_env("svc", {"OTEL_TRACES_EXPORTER": "console"})
    assert provider is not None
    provider.shutdown()


@pytest.mark.parametrize("name", ["timeslice-orchestrator"])
def test_off_means_no_provider_in_services(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ):
        monkeypatch.delenv(var, raising=False)
    assert provider_from_env(name) is None
