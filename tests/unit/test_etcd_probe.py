"""The member probe's verdicts on calls in flight (no server: calls and answers are stand-ins),
and its settings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aetcd.rpc import rpc_pb2 as pb

from timeslice.errors import InvalidArgument
from timeslice_orchestrator.config import parse_args
from timeslice_orchestrator.store.etcd import EtcdClient, MemberProbe
from timeslice_orchestrator.store.etcd.members import (
    ELECTION_PENALTY,
    MEMBER_PENALTY,
    TERM_GRACE,
    _Pending,
)


class _Call:
    """Stands in for a gRPC call: only cancel() is used."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        was = self.cancelled
        self.cancelled = True
        return not was


def _status(*, term: int, leader: int) -> pb.StatusResponse:
    return pb.StatusResponse(header=pb.ResponseHeader(member_id=1), leader=leader, raftTerm=term)


@pytest.fixture
async def client() -> AsyncIterator[EtcdClient]:
    etcd = EtcdClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        yield etcd
    finally:
        await etcd.close()


def _pending(member_term: int) -> _Pending:
    return _Pending(_Call(), time.monotonic(), member_term)


async def test_a_live_member_with_a_leader_keeps_its_calls(client: EtcdClient) -> None:
    member = client._members[0]
    waiting = [_pending(5), _pending(0)]
    client._judge(member, _status(term=5, leader=2), waiting)
    assert not any(p.call.cancelled for p in waiting)
    assert waiting[1].term == 5  # a call sent before any term was known takes this one
    assert member.failed_until <= time.monotonic()


async def test_a_call_across_a_new_term_gets_a_grace(client: EtcdClient) -> None:
    """A write the new leader inherited is answered a heartbeat into its term: looks past the
    change within TERM_GRACE of the first leave the call be; the next one ends it, and the
    member (which has a leader) is not passed over."""
    member = client._members[0]
    waiting = [_pending(5)]
    client._judge(member, _status(term=6, leader=3), waiting)
    assert not waiting[0].call.cancelled and waiting[0].newer_term_at
    client._judge(member, _status(term=6, leader=3), waiting)
    assert not waiting[0].call.cancelled
    waiting[0].newer_term_at -= TERM_GRACE  # as if that long had passed
    client._judge(member, _status(term=6, leader=3), waiting)
    assert waiting[0].call.cancelled
    assert waiting[0].abandoned is not None
    assert "new leader" in (waiting[0].abandoned.details() or "")
    assert member.failed_until <= time.monotonic()
    assert client._term == 6


async def test_a_member_without_a_leader_ends_its_calls(client: EtcdClient) -> None:
    member = client._members[1]
    waiting = [_pending(5)]
    before = time.monotonic()
    client._judge(member, _status(term=5, leader=0), waiting)
    assert waiting[0].call.cancelled
    assert before + ELECTION_PENALTY - 0.5 < member.failed_until <= time.monotonic() + 1.0


async def test_a_silent_member_ends_its_calls_and_is_passed_over(client: EtcdClient) -> None:
    member = client._members[2]
    waiting = [_pending(5), _pending(5)]
    client._current = 2
    client._judge(member, None, waiting)
    assert all(p.call.cancelled for p in waiting)
    assert member.failed_until > time.monotonic() + MEMBER_PENALTY - 1.0
    assert client._pick() is not member
    # A write ended so may have been applied: it must not read as one etcd refused.
    details = waiting[0].abandoned.details() if waiting[0].abandoned else ""
    assert "may or may not have been applied" in (details or "")


async def test_a_refused_probe_is_an_answer_that_says_nothing(client: EtcdClient) -> None:
    member = client._members[0]
    waiting = [_pending(5)]
    client._judge(member, pb.StatusResponse(), waiting)
    assert not waiting[0].call.cancelled


def test_probe_settings_are_checked() -> None:
    assert not MemberProbe(after=0).enabled
    for after, timeout in ((-1.0, 0.5), (0.5, 0.0), (0.5, -1.0)):
        with pytest.raises(InvalidArgument):
            MemberProbe(after=after, timeout=timeout)
    with pytest.raises(InvalidArgument):
        EtcdClient(["127.0.0.1:1"], timeout=0)


def test_probe_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_INSECURE", "1")
    config = parse_args([])
    assert config.etcd_timeout == 5.0
    assert config.etcd_probe == MemberProbe(after=0.5, timeout=0.5)
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_ETCD_PROBE_AFTER", "0.3")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_ETCD_TIMEOUT", "3")
    config = parse_args(["--etcd-probe-timeout", "0.4"])
    assert (config.etcd_timeout, config.etcd_probe) == (3.0, MemberProbe(0.3, 0.4))
    assert not parse_args(["--etcd-probe-after", "0"]).etcd_probe.enabled
    for bad in (
        ["--etcd-timeout", "0"],
        ["--etcd-probe-after", "-1"],
        ["--etcd-probe-timeout", "0"],
        ["--etcd-timeout", "1", "--etcd-probe-after", "0.6"],  # the deadline would come first
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
