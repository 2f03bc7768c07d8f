"""A burst of passes that never await must not starve the event loop (issue 13, finding 4).

At start a replica of a 100,000-group deployment queued every group; each pass over an idle
group returned without awaiting, and a worker taking keys from a non-empty queue never gave up
the loop either, so nothing else ran (the replica's lease keepalive among them) until the queue
was empty, and the lease expired.
"""

from __future__ import annotations

import asyncio

from timeslice_orchestrator.workqueue import KeyedBackoff, WorkQueue

KEYS = 20_000


async def test_quick_passes_leave_the_loop_to_others() -> None:
    done: list[str] = []
    ticks_during: list[int] = []
    ticks = 0

    async def handler(key: str) -> None:
        done.append(key)  # returns without awaiting, as a pass over an idle group does
        if len(done) == KEYS:
            ticks_during.append(ticks)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    queue: WorkQueue[str] = WorkQueue(handler, workers=4, backoff=KeyedBackoff(0.01, 0.1))
    for i in range(KEYS):
        queue.add(f"g{i}")
    other = asyncio.create_task(ticker())
    queue.start()
    try:
        async with asyncio.timeout(30):
            while len(done) < KEYS:
                await asyncio.sleep(0.01)
    finally:
        other.cancel()
        await queue.shutdown()
    # The other task ran all along: about once per pass of each worker, not once in the end.
    assert ticks_during and ticks_during[0] > KEYS / 10
