"""The gRPC floor of this machine: a unary round trip to a server that does no work.

    python -m bench.grpc_floor          # serves (prints its port), for the measurement below

A hand-over crosses gRPC twice (the Yield in, the waiter's grant out), each between two
event loops that sat idle, so next to the etcd floor :mod:`bench.floor` prints one round trip
of grpclib's own health check after the same pause the handoff benchmark takes: the server
runs uvloop as a replica does, the caller the asyncio loop the benchmark's clients use.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time

from grpclib.client import Channel
from grpclib.health.service import Health
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest
from grpclib.server import Server

from bench.analysis import Stats

_WARMUP = 20


async def round_trip_after_idle(pause: float, samples: int) -> Stats:
    """Round trips (ms) of a health check, each after ``pause`` seconds of idling."""
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(await asyncio.to_thread(server.stdout.readline))
        channel = Channel("127.0.0.1", port)
        try:
            stub = HealthStub(channel)
            times = []
            for i in range(_WARMUP + samples):
                await asyncio.sleep(pause)
                t0 = time.perf_counter()
                await stub.Check(HealthCheckRequest(), timeout=5)
                if i >= _WARMUP:
                    times.append(time.perf_counter() - t0)
            return Stats.of(times).scaled(1000)
        finally:
            channel.close()
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(5)


async def _serve() -> None:
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = Server([Health()])
    await server.start(sock=listening)
    print(listening.getsockname()[1], flush=True)
    await server.wait_closed()


def main() -> None:
    try:
        import uvloop

        uvloop.run(_serve())
    except ImportError:
        asyncio.run(_serve())


if __name__ == "__main__":
    main()
