"""Group commit's rules at etcd's boundary: a fake Txn call that records each request and
answers as told (the real etcd's behaviour is in tests/integration/test_batch_txn.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from aetcd.rpc import rpc_pb2 as pb

from timeslice_orchestrator.store.batch import Answer, TxnBatcher

TIMEOUT = 5.0


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), code.name)


def _txn(name: str) -> pb.TxnRequest:
    return pb.TxnRequest(
        success=[pb.RequestOp(request_put=pb.PutRequest(key=name.encode(), value=b"v"))]
    )


def _answer(request: pb.TxnRequest, revision: int) -> pb.TxnResponse:
    response = pb.TxnResponse(succeeded=True)
    response.header.revision = revision
    for op in request.success:
        if op.WhichOneof("request") == "request_txn":
            nested = pb.TxnResponse(succeeded=True)
            response.responses.append(pb.ResponseOp(response_txn=nested))
    return response


class FakeEtcd:
    """Holds each request until released, then answers it or fails it with the next code of
    ``failures`` (None: answer)."""

    def __init__(self, *failures: grpc.StatusCode | None) -> None:
        self.requests: list[pb.TxnRequest] = []
        self.deadlines: list[float] = []
        self.release = asyncio.Event()
        self.failures = list(failures)
        self.revision = 10

    async def send(self, request: pb.TxnRequest, deadline: float) -> pb.TxnResponse:
        self.requests.append(request)
        self.deadlines.append(deadline)
        await self.release.wait()
        code = self.failures.pop(0) if self.failures else None
        if code is not None:
            raise _rpc_error(code)
        self.revision += 1
        return _answer(request, self.revision)


def _names(request: pb.TxnRequest) -> list[str]:
    """The transactions a request carries (itself, or its nested ones)."""
    ops = request.success
    if ops and ops[0].WhichOneof("request") == "request_txn":
        return [op.request_txn.success[0].request_put.key.decode() for op in ops]
    return [ops[0].request_put.key.decode()]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _two_queued_behind_one(etcd: FakeEtcd) -> list[asyncio.Task[Answer]]:
    """``a`` goes out alone and is answered; ``b`` and ``c`` (other groups), queued behind
    it, go next in one request: their calls."""
    batcher = TxnBatcher(etcd.send, TIMEOUT, in_flight=1)
    first = asyncio.ensure_future(batcher.txn(_txn("a"), "g1"))
    rest = [asyncio.ensure_future(batcher.txn(_txn(n), n)) for n in ("b", "c")]
    await _settle()
    etcd.release.set()
    await first
    return rest


async def test_a_lone_transaction_goes_at_once_as_itself() -> None:
    etcd = FakeEtcd()
    etcd.release.set()
    batcher = TxnBatcher(etcd.send, TIMEOUT)
    answer = await batcher.txn(_txn("a"), "g1")
    assert answer.succeeded and answer.revision == 11
    assert etcd.requests == [_txn("a")]  # not nested in an outer transaction


async def test_waiting_transactions_go_together_one_per_group_within_the_limit() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd.send, TIMEOUT, in_flight=1, max_txns=3)
    calls: list[asyncio.Future[Any]] = [
        asyncio.ensure_future(batcher.txn(_txn(name), group))
        for name, group in [("a", "g1"), ("b", "g1"), ("c", "g2"), ("d", "g3"), ("e", "g4")]
    ]
    await _settle()
    etcd.release.set()
    answers = await asyncio.gather(*calls)
    assert [_names(r) for r in etcd.requests] == [["a"], ["b", "c", "d"], ["e"]]
    # The two batched ones got the outer request's revision, as one etcd write.
    assert [a.revision for a in answers] == [11, 12, 12, 12, 13]


async def test_a_request_is_due_when_its_oldest_caller_is() -> None:
    """Waiting for a turn eats into a caller's deadline: it never waits longer than alone."""
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd.send, TIMEOUT, in_flight=1)
    first = asyncio.ensure_future(batcher.txn(_txn("a"), "g1"))
    await _settle()
    asked = time.monotonic()
    older = asyncio.ensure_future(batcher.txn(_txn("b"), "g2"))
    await asyncio.sleep(0.05)
    newer_asked = time.monotonic()
    newer = asyncio.ensure_future(batcher.txn(_txn("c"), "g3"))
    await _settle()
    etcd.release.set()
    await asyncio.gather(first, older, newer)
    assert [_names(r) for r in etcd.requests] == [["a"], ["b", "c"]]
    assert asked + TIMEOUT <= etcd.deadlines[1] < newer_asked + TIMEOUT  # b's, not c's


async def test_a_transaction_whose_time_is_nearly_out_is_answered_without_being_sent() -> None:
    """Its turn comes with under a quarter of its deadline left: the requests ahead took
    the rest. Sent now, it would go with a deadline no healthy etcd meets."""
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd.send, 1.0, in_flight=1)
    first = asyncio.ensure_future(batcher.txn(_txn("a"), "g1"))
    await _settle()
    late = asyncio.ensure_future(batcher.txn(_txn("b"), "g2"))  # due in 1.0 s
    await asyncio.sleep(0.5)
    fresh = asyncio.ensure_future(batcher.txn(_txn("c"), "g3"))  # due 0.5 s after b
    await asyncio.sleep(0.35)  # b has 0.15 s left: under 0.25
    etcd.release.set()
    await first
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await late
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await fresh).succeeded
    assert [_names(r) for r in etcd.requests] == [["a"], ["c"]]


async def test_an_unknown_outcome_goes_to_every_caller_and_nothing_is_sent_again() -> None:
    """No answer means the request may have applied: sending it again could apply it twice."""
    etcd = FakeEtcd(None, grpc.StatusCode.UNAVAILABLE)  # the second request: connection lost
    rest = await _two_queued_behind_one(etcd)
    for call in rest:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [_names(r) for r in etcd.requests] == [["a"], ["b", "c"]]


async def test_a_request_refused_whole_is_sent_again_part_by_part() -> None:
    etcd = FakeEtcd(None, grpc.StatusCode.INVALID_ARGUMENT)  # say, a duplicate key
    rest = await _two_queued_behind_one(etcd)
    answers = await asyncio.gather(*rest)
    assert all(a.succeeded for a in answers)
    assert [_names(r) for r in etcd.requests] == [["a"], ["b", "c"], ["b"], ["c"]]


async def test_a_caller_that_leaves_before_its_turn_is_never_sent() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd.send, TIMEOUT, in_flight=1)
    first = asyncio.ensure_future(batcher.txn(_txn("a"), "g1"))
    gone = asyncio.ensure_future(batcher.txn(_txn("b"), "g2"))
    stays = asyncio.ensure_future(batcher.txn(_txn("c"), "g3"))
    await _settle()
    gone.cancel()
    etcd.release.set()
    await first
    await stays
    assert [_names(r) for r in etcd.requests] == [["a"], ["c"]]


async def test_close_ends_what_is_out_and_what_waits() -> None:
    """Callers hear CANCELLED from etcd's side, not a CancelledError they would take for
    their own task's cancellation."""
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd.send, TIMEOUT, in_flight=1)
    out = asyncio.ensure_future(batcher.txn(_txn("a"), "g1"))
    waiting = asyncio.ensure_future(batcher.txn(_txn("b"), "g2"))
    await _settle()
    await batcher.close()
    for call in (out, waiting):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.aio.AioRpcError):
        await batcher.txn(_txn("c"), "g3")
    assert [_names(r) for r in etcd.requests] == [["a"]]


def test_limits_must_be_positive() -> None:
    async def send(request: pb.TxnRequest, deadline: float) -> pb.TxnResponse:
        raise AssertionError("not called")

    with pytest.raises(ValueError):
        TxnBatcher(send, TIMEOUT, in_flight=0)
    with pytest.raises(ValueError):
        TxnBatcher(send, 0.0)
