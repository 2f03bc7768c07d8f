"""Which etcd member the client turns to after failures (no server needed: no call is made)."""

from __future__ import annotations

import grpc

from timeslice_orchestrator.store.etcd import EtcdClient
from timeslice_orchestrator.store.etcd.members import ELECTION_PENALTY, _in_election


async def test_after_a_silent_member_and_an_election_the_next_try_goes_to_a_live_member() -> None:
    """The leader pauses: a call to it gets no answer (passed over for the full penalty). The
    other two then answer "leader changed" while they elect a new one. With every member
    failed lately, the client must try a live member next, not the one that did not answer:
    going back to it cost a second per-try deadline, and a 5 s lease was lost (CI, run 5 of
    6a87856)."""
    client = EtcdClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        paused, first, second = client._members
        client._failed(paused, "etcd did not answer")
        client._failed(first, "UNAVAILABLE: etcdserver: leader changed", penalty=ELECTION_PENALTY)
        client._failed(second, "UNAVAILABLE: etcdserver: leader changed", penalty=ELECTION_PENALTY)
        assert client._all_failed()
        assert client._pick() is not paused
    finally:
        await client.close()


def test_a_refusal_for_want_of_a_leader_is_told_from_silence() -> None:
    def error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    unavailable = grpc.StatusCode.UNAVAILABLE
    assert _in_election(error(unavailable, "etcdserver: leader changed"))
    assert _in_election(error(unavailable, "etcdserver: no leader"))
    assert not _in_election(error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert not _in_election(error(unavailable, "failed to connect to all addresses"))
