"""A client that re-attaches to a grant learns the same ticket (place in line) it was given.

A replica that dies between committing a grant and delivering it leaves the client to retry
its Acquire (same session, same request id) on another replica, which hands back the grant.
That answer used to carry ticket 0, which made a correct FIFO history look out of order (the
soak test's FIFO check caught it once in a few runs). The grant now remembers its ticket.
"""

from __future__ import annotations

from tests.conftest import ClusterFactory
from tests.integration.rawclient import opened, raw_stub
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    AcquireState,
    OpenSessionRequest,
    YieldRequest,
)


async def _granted(stub: object, request: AcquireRequest) -> AcquireEvent:
    events = [ev async for ev in stub.acquire(request)]  # type: ignore[attr-defined]
    assert events[-1].state == AcquireState.GRANTED, events
    return events[-1]  # type: ignore[no-any-return]


async def test_reattached_grant_carries_its_original_ticket(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0)
    async with raw_stub(cluster.target) as stub:
        a, a_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="a", ttl_seconds=30))
        )
        b, b_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="b", ttl_seconds=30))
        )
        first = await _granted(
            stub, AcquireRequest(a, "a", "g", request_id="ra", session_secret=a_secret)
        )
        assert first.ticket > 0
        again = await _granted(
            stub, AcquireRequest(a, "a", "g", request_id="ra", session_secret=a_secret)
        )
        assert (again.epoch, again.ticket) == (first.epoch, first.ticket)
        await stub.yield_(YieldRequest(a, "a", "g", first.epoch, session_secret=a_secret))
        second = await _granted(
            stub, AcquireRequest(b, "b", "g", request_id="rb", session_secret=b_secret)
        )
        again = await _granted(
            stub, AcquireRequest(b, "b", "g", request_id="rb", session_secret=b_secret)
        )
        assert second.ticket > first.ticket
        assert (again.epoch, again.ticket) == (second.epoch, second.ticket)
