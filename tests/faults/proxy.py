"""A TCP pass-through that a test can hold: the bytes wait in the proxy, the connection stays.

For faults that a process pause cannot make: one side cut off while the other still
answers (a client's stream whose GRANTED is on the wire, a replica cut off from etcd while
its clients still reach it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class HoldingProxy:
    """Forwards connections to ``upstream``. :meth:`hold` keeps what the server sends (and
    with ``both``, what the client sends too) in the proxy until :meth:`release`."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._host, self._port = host, int(port)
        self._down = asyncio.Event()  # server -> client flows
        self._up = asyncio.Event()  # client -> server flows
        self.release()
        self._pipes: set[asyncio.Task[None]] = set()
        self.target = ""

    def hold(self, *, both: bool = False) -> None:
        self._down.clear()
        if both:
            self._up.clear()

    def release(self) -> None:
        self._down.set()
        self._up.set()

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
        try:
            server_r, server_w = await asyncio.open_connection(self._host, self._port)
        except OSError:
            client_w.close()
            return
        for pipe in (
            self._pipe(client_r, server_w, self._up),
            self._pipe(server_r, client_w, self._down),
        ):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(
        src: asyncio.StreamReader, dst: asyncio.StreamWriter, flowing: asyncio.Event
    ) -> None:
        try:
            while data := await src.read(65536):
                await flowing.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()
