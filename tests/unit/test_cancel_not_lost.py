"""A cancel that comes as an etcd step ends is not lost.

Python 3.11's ``asyncio.wait_for`` returns the awaited result when the step finishes just as
its caller is cancelled, and the cancellation is gone (gh-86296): a mirror stopped at that
moment ran on, and whoever waited for it to stop waited for ever (a clean-clone run hung 180 s
in ``tests/integration/test_etcd_rewind.py`` that way). The client's steps use
``asyncio.timeout``, which keeps the cancel.
"""

from __future__ import annotations

import asyncio

from timeslice_orchestrator.store.etcd import EtcdClient


async def test_a_step_that_ends_as_its_caller_is_cancelled_still_cancels() -> None:
    client = EtcdClient(["127.0.0.1:9"])  # never dialled: the step is a plain future
    try:
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        step = asyncio.create_task(client._call(answer, 5.0))
        await asyncio.sleep(0)  # the step is waiting for its answer
        answer.set_result("read")  # the answer comes ...
        step.cancel()  # ... in the same pass as the cancel
        await asyncio.wait({step})
        assert step.cancelled(), f"the cancel was lost: the step returned {step.result()!r}"
    finally:
        await client.close()
