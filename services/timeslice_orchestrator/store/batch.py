"""Group commit: independent transactions of different groups share one etcd request.

Each Txn call costs the replica about as much CPU in gRPC as the rest of an acquire's work,
and etcd a raft entry of its own. Under load many groups' transactions are in flight at once;
a :class:`TxnBatcher` sends them as the nested transactions of one outer transaction with no
compares, so each keeps its own compares and branches and gets its own answer.

When it batches, and why that is safe:

- A transaction goes out at once, alone, while fewer than ``in_flight`` requests are out: an
  idle replica's latency does not change (a lone transaction is sent as itself, not nested).
  The rest wait for the next request to return and then go together.
- At most one transaction per key (the caller's, in practice the group) per request. etcd
  evaluates every nested compare against the state before the request and gives all its writes
  one revision, so two transactions of one group in one request would both pass compares that
  only one of them may pass, and two queue entries would share a ticket. Transactions of
  different groups were concurrent calls anyway: running them "at the same instant" is one of
  the orders they could have had.
- Only transactions whose revision means nothing beyond its group may be batched (grants,
  queue entries, releases). A switch record's or a fence's revision is compared across groups
  (the epoch floor, docs/fencing.md): those are never batched.
- etcd refuses a whole request before applying any of it when one part is invalid (a lease
  gone, a duplicate key): then each transaction is sent again alone and gets its own answer.
  An error that leaves it unknown whether the request applied (no answer, a lost connection)
  goes to every caller, as it would have for each call alone.
- A caller waits no longer than alone: its deadline counts from when it asked, and a request
  is due when the earliest of its callers is. One whose turn comes with less than a quarter
  of its deadline left is answered DEADLINE_EXCEEDED without being sent (the requests ahead
  of it took the rest: etcd is stalled), so a request never goes with a deadline too short
  for a healthy member, which would then be blamed for it.
- Batches stay small (32 transactions, 32 KiB): a watch that catches up receives up to 1,000
  revisions in one message, and each request is one revision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from aetcd.rpc import rpc_pb2 as pb

log = logging.getLogger(__name__)

# Requests out at once before transactions start waiting to share the next one.
IN_FLIGHT = 2
# etcd refuses more than 128 operations in one branch (--max-txn-ops) and requests over
# 1.5 MiB (--max-request-bytes); the watch's catch-up messages (above) want less still.
MAX_TXNS = 32
MAX_BYTES = 32 * 1024
# The share of its deadline a transaction must have left when its turn comes to be sent.
MIN_SHARE_LEFT = 0.25

# etcd's answers that refuse a request before any of it is applied: each part is sent alone.
_REFUSED_WHOLE = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,  # duplicate key, too many operations, too large
        grpc.StatusCode.NOT_FOUND,  # a put's lease is gone
        grpc.StatusCode.PERMISSION_DENIED,  # etcd auth: a key outside the user's role
    }
)


@dataclass(frozen=True, slots=True)
class Answer:
    """One transaction's own answer, as if it had been sent alone."""

    succeeded: bool
    revision: int
    responses: list[pb.ResponseOp]


@dataclass(slots=True)
class _Waiting:
    request: pb.TxnRequest
    key: str
    size: int
    due: float  # time.monotonic() by which its caller must have its answer
    answer: asyncio.Future[Answer] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


# One etcd Txn call: the request and its deadline (time.monotonic()); raises AioRpcError.
Send = Callable[[pb.TxnRequest, float], Awaitable[pb.TxnResponse]]


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class TxnBatcher:
    """Sends transactions through ``send``, several in one request when they queue up, each
    within ``timeout`` of its caller asking; see the module's docstring."""

    def __init__(
        self,
        send: Send,
        timeout: float,
        *,
        in_flight: int = IN_FLIGHT,
        max_txns: int = MAX_TXNS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        if in_flight < 1 or max_txns < 1 or timeout <= 0:
            raise ValueError("in_flight, max_txns and timeout must be positive")
        self._send = send
        self._timeout = timeout
        self._in_flight = in_flight
        self._max_txns = max_txns
        self._max_bytes = max_bytes
        self._waiting: list[_Waiting] = []
        self._requests: set[asyncio.Task[None]] = set()
        self._closed = False
        self.requests_sent = 0  # etcd requests, batched or not (tests and benchmarks)
        self.txns_sent = 0

    async def txn(self, request: pb.TxnRequest, key: str) -> Answer:
        """Run ``request``, batched with others of other keys when requests are out; raises
        AioRpcError as the Txn call does (CANCELLED once the client is closed)."""
        if self._closed:
            raise _error(grpc.StatusCode.CANCELLED, "the etcd client is closed")
        waiting = _Waiting(request, key, request.ByteSize(), time.monotonic() + self._timeout)
        self._waiting.append(waiting)
        self._pump()
        return await waiting.answer

    async def close(self) -> None:
        """End the requests still out; every caller still waiting gets CANCELLED."""
        self._closed = True
        closed = _error(grpc.StatusCode.CANCELLED, "the etcd client was closed")
        for task in list(self._requests):
            task.cancel()
        if self._requests:
            await asyncio.wait(self._requests)
        for waiting in self._waiting:
            _settle(waiting, closed)
        self._waiting.clear()

    def _pump(self) -> None:
        while self._waiting and len(self._requests) < self._in_flight and not self._closed:
            batch = self._take()
            if not batch:
                return
            task = asyncio.ensure_future(self._run(batch))
            self._requests.add(task)
            task.add_done_callback(self._request_done)

    def _take(self) -> list[_Waiting]:
        """The next request's transactions, oldest first: one per key, within the limits.
        Those whose callers left, or whose time is nearly out, are answered and dropped."""
        batch: list[_Waiting] = []
        keys: set[str] = set()
        size = 0
        left: list[_Waiting] = []
        send_by = time.monotonic() + self._timeout * MIN_SHARE_LEFT
        for waiting in self._waiting:
            if waiting.answer.done():
                continue  # its caller gave up before it was sent: it never runs
            if waiting.due < send_by:
                _settle(
                    waiting,
                    _error(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "not sent: the deadline nearly passed while it waited for its turn",
                    ),
                )
                continue
            fits = len(batch) < self._max_txns and (
                not batch or size + waiting.size <= self._max_bytes
            )
            if fits and waiting.key not in keys:
                batch.append(waiting)
                keys.add(waiting.key)
                size += waiting.size
            else:
                left.append(waiting)
        self._waiting = left
        self.txns_sent += len(batch)
        return batch

    def _request_done(self, task: asyncio.Task[None]) -> None:
        self._requests.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._closed:
            # _run answers every caller itself; reaching here is a bug: make it visible.
            log.error("etcd batch request failed", exc_info=task.exception())
        self._pump()

    async def _run(self, batch: list[_Waiting]) -> None:
        try:
            if len(batch) == 1:
                await self._alone(batch[0])
                return
            self.requests_sent += 1
            outer = pb.TxnRequest(success=[pb.RequestOp(request_txn=w.request) for w in batch])
            try:
                response = await self._send(outer, min(w.due for w in batch))
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _REFUSED_WHOLE:
                    response = None
                else:
                    for waiting in batch:
                        _settle(waiting, exc)
                    return
            if response is None:
                # Nothing of it applied: each one alone finds out which part was refused.
                # (Rare, so they go at once, not counted against in_flight.)
                outcomes = await asyncio.gather(
                    *(self._alone(w) for w in batch), return_exceptions=True
                )
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
                return
            revision = int(response.header.revision)
            for waiting, op in zip(batch, response.responses, strict=True):
                own = op.response_txn
                _settle(waiting, Answer(bool(own.succeeded), revision, list(own.responses)))
        except BaseException as exc:
            _settle_all(batch, exc)
            raise

    async def _alone(self, waiting: _Waiting) -> None:
        self.requests_sent += 1
        try:
            response = await self._send(waiting.request, waiting.due)
        except grpc.aio.AioRpcError as exc:
            _settle(waiting, exc)
            return
        except BaseException as exc:
            _settle_all([waiting], exc)
            raise
        answer = Answer(
            bool(response.succeeded), int(response.header.revision), list(response.responses)
        )
        _settle(waiting, answer)


def _settle(waiting: _Waiting, outcome: Answer | BaseException) -> None:
    if waiting.answer.done():
        return  # answered already, or its caller was cancelled meanwhile
    if isinstance(outcome, Answer):
        waiting.answer.set_result(outcome)
    else:
        waiting.answer.set_exception(outcome)


def _settle_all(batch: list[_Waiting], exc: BaseException) -> None:
    """Answer callers a request could not: cancelled (the client closed) or a bug."""
    if isinstance(exc, asyncio.CancelledError):
        exc = _error(grpc.StatusCode.CANCELLED, "the etcd client was closed")
    for waiting in batch:
        _settle(waiting, exc)
