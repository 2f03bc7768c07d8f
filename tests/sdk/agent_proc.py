"""A fake node agent in its own process, so a test can kill it like a crashed agent.

Usage: python -m tests.sdk.agent_proc SOCKET_PATH
Prints "ready" once serving, then "registered <job_id>" for each worker that registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

from grpclib.server import Server

from tests.sdk.fakes import FakeAgent
from timeslice_proto.timeslice.v1 import WorkerCommand, WorkerInfo


class PrintingAgent(FakeAgent):
    async def register(self, message: WorkerInfo) -> AsyncIterator[WorkerCommand]:
        print("registered", message.job_id, flush=True)
        async for command in super().register(message):
            yield command


async def main(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left behind by a killed predecessor
    server = Server([PrintingAgent()])
    await server.start(path=path)
    print("ready", flush=True)
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
