"""Property-based fuzzing of every RPC of the orchestrator and of the agent, on real processes.

Each case sends one request over a raw HTTP/2 channel: a message built field by field from
the method's schema with random (often out-of-range, badly encoded) values, raw random bytes,
a valid message cut short, or a gRPC frame whose declared length lies. Properties:

- every answer is a typed status (never UNKNOWN or INTERNAL), a refusal saying its kind;
- a message that is not a strict encoding of its type (by :func:`timeslice.wire.validate`,
  and in fixed cases built to be wrong) is refused as malformed, by the strict codec, before
  any handler sees it: betterproto2 alone would read most of them leniently;
- the services stay up, and no traceback reaches their logs;
- etcd is byte-for-byte unchanged by a refused call.

``make test`` runs a small derandomized corpus (the ``ci`` profile); ``make fuzz`` runs the
``fuzz`` profile: many more, random cases.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import betterproto2
import pytest
from grpclib.client import Channel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ClusterFactory
from tests.integration.etcdview import snapshot
from tests.wirecalls import TYPED, frame, raw_call, raw_channel, varint
from timeslice.errors import ErrorKind
from timeslice.wire import MalformedMessage, validate
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    AgentMessage,
    CloseSessionRequest,
    CommandResult,
    GetGroupStatusRequest,
    KeepAliveRequest,
    ListGroupsRequest,
    OpenSessionRequest,
    SetGroupMembersRequest,
    WatchGroupRequest,
    WorkerInfo,
    YieldRequest,
)
from timeslice_tools.dev.cluster import LocalCluster

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("TIMESLICE_FUZZ_EXAMPLES", "200")),
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("TIMESLICE_FUZZ_EXAMPLES", "2000")),
    derandomize=False,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("TIMESLICE_FUZZ_PROFILE", "ci"))

ORCHESTRATOR_METHODS: dict[str, type[betterproto2.Message]] = {
    "/timeslice.v1.TimeSlice/OpenSession": OpenSessionRequest,
    "/timeslice.v1.TimeSlice/KeepAlive": KeepAliveRequest,
    "/timeslice.v1.TimeSlice/CloseSession": CloseSessionRequest,
    "/timeslice.v1.TimeSlice/Acquire": AcquireRequest,
    "/timeslice.v1.TimeSlice/Yield": YieldRequest,
    "/timeslice.v1.TimeSlice/YieldStream": YieldRequest,
    "/timeslice.v1.TimeSlice/ListGroups": ListGroupsRequest,
    "/timeslice.v1.TimeSlice/GetGroupStatus": GetGroupStatusRequest,
    "/timeslice.v1.TimeSlice/WatchGroup": WatchGroupRequest,
    "/timeslice.v1.TimeSlice/SetGroupMembers": SetGroupMembersRequest,
    "/timeslice.v1.AgentHub/Connect": AgentMessage,
}
AGENT_METHODS: dict[str, type[betterproto2.Message]] = {
    "/timeslice.v1.WorkerLink/Register": WorkerInfo,
    "/timeslice.v1.WorkerLink/CompleteCommand": CommandResult,
}

# -- building messages field by field -------------------------------------------------------


# Strings that sometimes name real things (so some calls get past validation) and often not.
_TEXT = st.one_of(
    st.sampled_from(["fz", "g", "node-0", "", "..", "a/b", "x" * 300]),
    st.text(max_size=40),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)
_RAW_STRING = st.one_of(
    _TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=40),  # often invalid UTF-8
)
_NUMBER = st.one_of(
    st.integers(0, 10),
    st.integers(0, 2**32 + 10),
    st.integers(2**32 - 3, 2**64 - 1),
    st.sampled_from([2**31, 2**63, 2**64 - 1, 2**32 + 5]),
)


@st.composite
def _message(draw: st.DrawFn, cls: type[betterproto2.Message], depth: int = 0) -> bytes:
    """Fields of ``cls`` in random order, each with a random (maybe wrong) encoding."""
    meta: Any = getattr(cls, "_betterproto")  # noqa: B009 - a classproperty mypy cannot type
    out = bytearray()
    names = list(meta.meta_by_field_name)
    for name in draw(st.lists(st.sampled_from(names), max_size=6)) if names else []:
        field = meta.meta_by_field_name[name]
        kind = field.proto_type
        if kind == betterproto2.TYPE_MESSAGE and depth < 3:
            nested = meta.cls_by_field[name]
            body = draw(_message(nested, depth + 1))
            out += varint(field.number << 3 | 2) + varint(len(body)) + body
        elif kind in (betterproto2.TYPE_STRING, betterproto2.TYPE_BYTES, betterproto2.TYPE_MAP):
            body = draw(_RAW_STRING)
            out += varint(field.number << 3 | 2) + varint(len(body)) + body
        elif kind in (betterproto2.TYPE_DOUBLE, betterproto2.TYPE_FIXED64):
            out += varint(field.number << 3 | 1) + draw(st.binary(min_size=8, max_size=8))
        else:
            out += varint(field.number << 3 | 0) + varint(draw(_NUMBER))
    if draw(st.booleans()) and depth == 0:
        out += draw(st.binary(max_size=8))  # trailing junk: an unknown or broken field
    return bytes(out)


@dataclass(frozen=True)
class Case:
    method: str
    data: bytes  # as it goes on the wire (framed)

    def __repr__(self) -> str:
        return f"Case({self.method}, {self.data[:80]!r}{'...' if len(self.data) > 80 else ''})"


def cases(methods: dict[str, type[betterproto2.Message]]) -> st.SearchStrategy[Case]:
    @st.composite
    def build(draw: st.DrawFn) -> Case:
        method = draw(st.sampled_from(sorted(methods)))
        cls = methods[method]
        how = draw(st.sampled_from(["fields", "fields", "raw", "truncated", "bad frame"]))
        if how == "raw":
            return Case(method, frame(draw(st.binary(max_size=200))))
        payload = draw(_message(cls))
        if how == "truncated" and payload:
            return Case(method, frame(payload[: draw(st.integers(0, len(payload) - 1))]))
        if how == "bad frame":
            return Case(method, frame(payload, declared=len(payload) + draw(st.integers(1, 64))))
        return Case(method, frame(payload))

    return build()


# -- running cases against real processes ----------------------------------------------------


def malformed(case: Case, methods: dict[str, type[betterproto2.Message]]) -> str | None:
    """The request type's name if ``case`` is a whole frame whose message is not strict."""
    header, payload = case.data[:5], case.data[5:]
    if header != frame(payload)[:5]:
        return None  # a lying or compressed frame: refused before the codec
    cls = methods[case.method]
    try:
        validate(payload, cls)
    except MalformedMessage:
        return cls.__name__
    return None


# Known wrong, whatever ``validate`` says: betterproto2 reads each without complaint (a value
# masked or taken as true, a truncated field cut short, a list in a number, a group skipped),
# so only the strict codec refuses them.
_REGISTER = "/timeslice.v1.WorkerLink/Register"
_COMPLETE = "/timeslice.v1.WorkerLink/CompleteCommand"
AGENT_MALFORMED = (
    Case(_REGISTER, frame(varint(3 << 3) + varint(2**32 + 5))),  # pid: uint32
    Case(_REGISTER, frame(varint(6 << 3) + varint(7))),  # acquirer: bool
    Case(_REGISTER, frame(varint(4 << 3 | 2) + varint(1) + b"\x01")),  # state_bytes: LEN
    Case(_COMPLETE, frame(varint(1 << 3 | 2) + varint(10) + b"ab")),  # command_id truncated
    Case(_COMPLETE, frame(varint(2 << 3) + varint(2))),  # ok: bool
    Case(_COMPLETE, frame(varint(9 << 3 | 3))),  # a group (wire type 3)
)


class Harness:
    def __init__(
        self, cluster: LocalCluster, target: str, methods: dict[str, type[betterproto2.Message]]
    ) -> None:
        self.cluster = cluster
        self.methods = methods
        self.loop = asyncio.new_event_loop()
        self.channel: Channel = self.loop.run_until_complete(self._channel(target))
        self.statuses: dict[str, int] = {}

    @staticmethod
    async def _channel(target: str) -> Channel:
        return raw_channel(target)

    def snapshot(self) -> dict[str, tuple[bytes, int]]:
        return self.loop.run_until_complete(snapshot(self.cluster))

    def quiet_snapshot(self) -> dict[str, tuple[bytes, int]]:
        """A snapshot taken once the store stopped changing (after an accepted call)."""
        last = self.snapshot()
        for _ in range(20):
            self.loop.run_until_complete(asyncio.sleep(0.1))
            now = self.snapshot()
            if now == last:
                return now
            last = now
        return last

    def run(self, case: Case, before: dict[str, tuple[bytes, int]]) -> bool:
        """Run one case; whether it was accepted (then the store may have changed)."""
        outcome = self.loop.run_until_complete(
            raw_call(self.channel, case.method, case.data, timeout=2.0)
        )
        name = outcome.status.name
        self.statuses[name] = self.statuses.get(name, 0) + 1
        assert outcome.status in TYPED, f"{case}: untyped {outcome.status.name} {outcome.message}"
        wrong = malformed(case, self.methods)
        if wrong is not None:
            # The strict codec refuses it before a handler runs (validation switched off, a
            # handler would see betterproto2's lenient reading of it).
            assert outcome.status.name == "INVALID_ARGUMENT", f"{case}: {name} {outcome.message}"
            assert outcome.kind is ErrorKind.INVALID_ARGUMENT, f"{case}: kind {outcome.kind}"
            assert outcome.message.startswith(f"malformed {wrong}: "), (
                f"{case}: {outcome.message!r} is not the strict codec's refusal"
            )
            self.statuses["malformed"] = self.statuses.get("malformed", 0) + 1
        if outcome.refused and outcome.status.name != "DEADLINE_EXCEEDED":
            if case.method.startswith("/timeslice.v1.TimeSlice/") or wrong is not None:
                # The client API (and the codec, everywhere) names the error kind for the SDK.
                assert outcome.kind is not None, f"{case}: {outcome.message!r}: no kind"
            assert outcome.message, f"{case}: a refusal must say why"
            after = self.snapshot()
            assert after == before, f"{case} was refused ({outcome.message}) but changed etcd"
            return False
        return True

    def close(self) -> None:
        self.channel.close()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()


def _no_tracebacks(cluster: LocalCluster) -> None:
    bad = [
        p.name
        for p in cluster.log_dir.glob("*.log")
        if "Traceback" in p.read_text(errors="replace")
    ]
    assert bad == [], f"tracebacks in {bad}"


@pytest.fixture
def fuzz_cluster(cluster_factory: ClusterFactory) -> Iterator[LocalCluster]:
    yield cluster_factory(agents=1, orchestrator_args=["--max-message-bytes=65536"])


def _fuzz(
    cluster: LocalCluster,
    target: str,
    methods: dict[str, type[Any]],
    known_malformed: Sequence[Case] = (),
) -> None:
    harness = Harness(cluster, target, methods)
    state = {"before": harness.quiet_snapshot()}
    for case in known_malformed:
        assert malformed(case, methods), f"{case} is a strict encoding after all"
        assert not harness.run(case, state["before"]), f"{case} was accepted"

    @given(cases(methods))
    def property_(case: Case) -> None:
        if harness.run(case, state["before"]):
            state["before"] = harness.quiet_snapshot()

    try:
        property_()
        print(f"statuses over {target}: {dict(sorted(harness.statuses.items()))}")
    finally:
        harness.close()
    # The corpus reaches the codec's refusals (not only the frame checks before it).
    assert harness.statuses.get("malformed", 0) >= len(known_malformed) + 1, harness.statuses
    assert cluster.exited() == {}, "a service died"
    _no_tracebacks(cluster)


def test_fuzz_orchestrator_rpcs(fuzz_cluster: LocalCluster) -> None:
    _fuzz(fuzz_cluster, fuzz_cluster.targets[0], ORCHESTRATOR_METHODS)


def test_fuzz_agent_rpcs(fuzz_cluster: LocalCluster) -> None:
    target = f"unix:{fuzz_cluster.agent_sockets['node-0']}"
    _fuzz(fuzz_cluster, target, AGENT_METHODS, AGENT_MALFORMED)
