"""A job's own span reaches the orchestrator and the switch that served it, in a real receiver.

The services run as separate processes exporting over OTLP (the standard ``OTEL_*``
environment) to a receiver built from the OpenTelemetry protos; this test process is the job:
it exports its own ``step`` spans to the same receiver through its own tracer provider, and
calls the orchestrator with the synchronous client (its calls run on the client's loop in
another thread, where the caller's span is not current by itself). The checks follow ids end
to end: the job's step span is the parent of its Acquire and Yield server spans, the switch
links to that Acquire, and the agents' checkpoint and restore spans are in the switch's tree.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.conftest import ClusterFactory
from tests.tracing.otlp import Collector, ReceivedSpan, otlp_env
from timeslice import AsyncTimeSliceClient, TimeSliceOrchestratorClient, register

ACQUIRE = "timeslice.v1.TimeSlice/Acquire"
YIELD = "timeslice.v1.TimeSlice/Yield"
OPEN_SESSION = "timeslice.v1.TimeSlice/OpenSession"
KEEPALIVE = "timeslice.v1.TimeSlice/KeepAlive"


async def wait_for(
    receiver: Collector, ready: Callable[[list[ReceivedSpan]], bool], what: str
) -> list[ReceivedSpan]:
    """The spans received once ``ready`` says they are all there (exports are batched)."""
    deadline = time.monotonic() + 20
    while not ready(receiver.spans):
        assert time.monotonic() < deadline, (what, [(s.service, s.name) for s in receiver.spans])
        await asyncio.sleep(0.1)
    return list(receiver.spans)


def one(spans: list[ReceivedSpan], name: str, **attributes: object) -> ReceivedSpan:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, attributes, [(s.name, s.attributes) for s in found])
    return found[0]


async def test_a_jobs_step_span_is_the_root_of_its_wait_and_links_the_switch(
    cluster_factory: ClusterFactory, collector: tuple[Collector, int]
) -> None:
    receiver, port = collector
    cluster = cluster_factory(
        replicas=1, agents=2, env=otlp_env(port), agent_args=["--sim-state-gb", "0.1"]
    )
    sockets = cluster.agent_sockets
    nodes = sorted(sockets)
    workers = [
        register("g", job_id=job, socket=str(sockets[node])) for job in "ab" for node in sockets
    ]
    # The job's own tracing: its provider, exporting to the same receiver.
    provider = TracerProvider(resource=Resource.create({"service.name": "job-b"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True))
    )
    tracer = provider.get_tracer("job")
    b_waits = threading.Event()
    steps: dict[str, tuple[bytes, bytes]] = {}

    def job_b() -> None:
        """Two steps of job b, each in its own span, on the synchronous client."""
        # A short TTL: keepalives go out every 0.5 s, outside any step of the job.
        with TimeSliceOrchestratorClient(cluster.targets, job_id="b", session_ttl=1.5) as b:
            for step in ("step-1", "step-2"):
                with tracer.start_as_current_span(step) as span:
                    ctx = span.get_span_context()
                    steps[step] = (ctx.trace_id.to_bytes(16, "big"), ctx.span_id.to_bytes(8, "big"))
                    b_waits.set()
                    # Step 1 waits for a's hold and causes a switch; step 2 finds g free.
                    b.acquire("g", timeout=30)
                    b.yield_("g")
            time.sleep(1.0)  # a keepalive or two, after the steps

    try:
        async with AsyncTimeSliceClient(cluster.targets, job_id="a") as a:
            await a.acquire("g", timeout=30)
            job = asyncio.create_task(asyncio.to_thread(job_b))
            assert await asyncio.to_thread(b_waits.wait, 30)
            await asyncio.sleep(0.5)  # b's Acquire is queued behind a's hold
            await a.yield_("g")  # a has no span of its own
            await asyncio.wait_for(job, 60)
    finally:
        for w in workers:
            w.close()
        provider.shutdown()

    (trace_1, step_1), (trace_2, step_2) = steps["step-1"], steps["step-2"]

    def complete(spans: list[ReceivedSpan]) -> bool:
        traced = [s for s in spans if s.trace_id in (trace_1, trace_2)]
        switches = [
            s
            for s in spans
            if s.name == "timeslice.switch" and s.attributes.get("timeslice.to_job") == "b"
        ]
        agents = [
            s
            for s in spans
            if s.name.startswith("timeslice.agent.")
            and switches
            and s.trace_id == switches[0].trace_id
        ]
        return (
            len([s for s in traced if s.name in (ACQUIRE, YIELD)]) == 4
            and len(agents) == 2 * len(nodes)
            and any(s.name == YIELD and s.attributes.get("timeslice.job") == "a" for s in spans)
            and any(s.name == KEEPALIVE for s in spans)
        )

    spans = await wait_for(receiver, complete, "b's calls, the switch and the agents' spans")

    # The job's step span is the parent of its Acquire (the wait) and of its Yield, across the
    # process boundary: the SDK sent the step's trace context with each call.
    for trace_id, step in ((trace_1, step_1), (trace_2, step_2)):
        mine = [s for s in spans if s.trace_id == trace_id and s.service != "job-b"]
        # Step 1 also opened the client's session (its first call).
        expected = {ACQUIRE, YIELD} | ({OPEN_SESSION} if step == step_1 else set())
        assert {s.name for s in mine if s.parent_span_id == step} == expected, [
            (s.name, s.parent_span_id.hex()) for s in mine
        ]
    # The session that step 1 opened is kept alive by background work, in no step's trace.
    keepalives = [s for s in spans if s.name == KEEPALIVE]
    assert keepalives and not [s for s in keepalives if s.trace_id in (trace_1, trace_2)]
    (acquire_1,) = [s for s in spans if s.name == ACQUIRE and s.trace_id == trace_1]
    assert acquire_1.parent_span_id == step_1 and acquire_1.attributes["timeslice.job"] == "b"
    # Step 2's yield rode the YieldStream step 1's yield opened: its parent is still step 2
    # (each YieldRequest carries its own context), not the stream's opener.
    yields_b = [s for s in spans if s.name == YIELD and s.attributes.get("timeslice.job") == "b"]
    assert sorted(s.parent_span_id for s in yields_b) == sorted([step_1, step_2])
    # a called without a span: its Yield is a root of its own, not in b's trace.
    yield_a = one(spans, YIELD, **{"timeslice.job": "a"})
    assert yield_a.parent_span_id == b"" and yield_a.trace_id not in (trace_1, trace_2)

    # The switch that served b links to b's Acquire: the job's trace reaches it by that link.
    switch = one(spans, "timeslice.switch", **{"timeslice.to_job": "b"})
    assert switch.parent_span_id == b""
    assert (acquire_1.trace_id, acquire_1.span_id) in switch.links, switch.links

    # The switch's own tree: its phases, a span per node, and each agent's checkpoint or
    # restore under the orchestrator's span for its node.
    tree = [s for s in spans if s.trace_id == switch.trace_id]
    phases = {s.name: s for s in tree if s.parent_span_id == switch.span_id}
    assert set(phases) == {"timeslice.evict", "timeslice.restore"}
    for phase, kind in (("evict", "checkpoint"), ("restore", "restore")):
        per_node = [s for s in tree if s.parent_span_id == phases[f"timeslice.{phase}"].span_id]
        assert sorted(str(s.attributes["timeslice.node"]) for s in per_node) == nodes
        for node_span in per_node:
            (agent,) = [s for s in tree if s.parent_span_id == node_span.span_id]
            assert agent.service == "timeslice-agent" and agent.name == f"timeslice.agent.{kind}"
            assert agent.attributes["timeslice.node"] == node_span.attributes["timeslice.node"]

    # No span name carries a node's name: one operation per kind of work, not per node.
    names = {s.name for s in spans}
    assert not [n for n in names if any(node in n for node in nodes) or " " in n], names


def test_the_sdk_works_without_opentelemetry() -> None:
    """The SDK does not depend on OpenTelemetry: without it, propagation is simply off."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed: every import of it fails
from timeslice import _trace_context
from timeslice._transport import open_channel
from timeslice.targets import parse_target
assert not _trace_context.available()
assert _trace_context.carrier() == {}
async def f():
    channel = _trace_context.install(open_channel(parse_target("127.0.0.1:1")))
    channel.close()
    return 7
import asyncio
assert asyncio.run(_trace_context.detached(f())) == 7
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
