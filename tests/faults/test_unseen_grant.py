"""A grant still on the wire when its acquire is aborted goes back; it does not block the group.

Aborting an acquire (a cancel, its timeout) resets the Acquire stream, and the server takes
back a grant it could not deliver. But when the server had already sent GRANTED and ended
its stream, the reset arrives too late for it, and the client drops the GRANTED that arrives
after its reset. The hold then sat on the client's live session with no record in the
client: nobody else was granted the group until the job exited, and the job's own next
acquire was refused ("already holds"). The client now looks the group up after an abort and
gives back a hold of its own that it has no grant for.

How the GRANTED is kept on the wire: the waiter reaches the replica through a TCP proxy that
holds the bytes coming from the server while the grant is made and the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import wait_for_status
from timeslice import AsyncTimeSliceClient

pytestmark = pytest.mark.slow

GROUP = "g"


class HoldingProxy:
    """TCP pass-through to ``upstream``; while held, bytes from the server wait in the proxy."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._host, self._port = host, int(port)
        self._open = asyncio.Event()
        self._open.set()
        self._pipes: set[asyncio.Task[None]] = set()
        self.target = ""

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[HoldingProxy]:
        server = await asyncio.start_server(self._serve, self._host, 0)
        self.target = f"{self._host}:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            for pipe in self._pipes:
                pipe.cancel()
            await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(self._host, self._port)
        for pipe in (self._pipe(client_r, server_w, held=False), self._pipe(server_r, client_w)):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, held: bool = True
    ) -> None:
        try:
            while data := await src.read(65536):
                if held:
                    await self._open.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()


async def test_a_grant_on_the_wire_when_its_acquire_is_aborted_is_given_back(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=1, agents=0)
    (replica,) = cluster.targets
    async with (
        HoldingProxy(replica).running() as proxy,
        AsyncTimeSliceClient([replica], job_id="a") as a,
        AsyncTimeSliceClient([proxy.target], job_id="b") as b,
        AsyncTimeSliceClient([replica], job_id="observer") as observer,
    ):
        first = await a.acquire(GROUP, timeout=30)
        waiter = asyncio.create_task(b.acquire(GROUP))
        await wait_for_status(observer, GROUP, lambda s: [q.job_id for q in s.queue] == ["b"], 10)

        proxy.hold()
        await a.yield_(GROUP)  # hands the group over to b: GRANTED goes out, into the proxy
        granted = await wait_for_status(observer, GROUP, lambda s: s.holder_job_id == "b", 10)
        assert granted.holder_epoch > first.epoch
        await asyncio.sleep(0.3)  # the replica ends b's stream; that too waits in the proxy
        assert not waiter.done()
        waiter.cancel()  # the reset reaches the replica after its stream ended
        with pytest.raises(asyncio.CancelledError):
            await waiter
        proxy.release()  # the GRANTED arrives for a stream the client has reset

        # The client finds the hold it has no grant for and gives it back; its next acquire
        # of the group, at once, waits for that instead of meeting the hold ("already holds").
        again = await asyncio.wait_for(b.acquire(GROUP, timeout=10), 15)
        assert again.epoch > granted.holder_epoch
        status = await observer.status(GROUP)
        assert (status.holder_job_id, status.holder_epoch) == ("b", again.epoch)
        await b.yield_(GROUP)
        after = await a.acquire(GROUP, timeout=10)
        await a.yield_(GROUP)
        assert after.epoch > again.epoch
