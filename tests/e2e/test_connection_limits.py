"""What a peer may hold on a replica's gRPC port (mutual TLS), on a real replica process.

A security probe held 11,000 TCP connections that never started TLS: the replica's RSS went
from 128 MB to 1.33 GB in 25 s (256 KiB of read buffer per connection, allocated at accept),
and 3,000 idle TLS connections of one job certificate all stayed open. Here: half-open
connections from many addresses and from one, idle connections, and one identity's many
connections, each against the limit that bounds it (timeslice_orchestrator.tls).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import cast

import pytest
from grpclib import GRPCError
from grpclib.client import Channel, Handler
from grpclib.exceptions import StreamTerminatedError

from bench._common import parse_metrics, proc_sample
from bench.connections import close_now, half_open, raise_open_files, spread_sources
from timeslice.aio import AsyncTimeSliceClient
from timeslice.targets import parse_address
from timeslice.tls import TlsFiles, client_context
from timeslice_orchestrator.config import parse_args
from timeslice_orchestrator.tls import ConnectionLimits
from timeslice_proto.timeslice.v1 import (
    GetGroupStatusRequest,
    GroupEvent,
    TimeSliceStub,
    WatchGroupRequest,
)
from timeslice_tools.dev.certs import CertPair
from timeslice_tools.dev.cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

ClusterFactory = Callable[..., LocalCluster]


def _metrics(cluster: LocalCluster) -> dict[str, float]:
    http = cluster.replica_http[0]
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    return parse_metrics(text)


async def _metric(cluster: LocalCluster, name: str) -> float:
    return (await asyncio.to_thread(_metrics, cluster)).get(name, 0.0)


async def _until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)
    assert check(), what


def _rss_mb(pid: int) -> float:
    return proc_sample(pid).rss_bytes / 2**20


async def test_half_open_connections_cost_little_and_a_job_still_acquires(
    cluster_factory: ClusterFactory,
) -> None:
    raise_open_files(8192)  # the attacker's sockets here, the replica's (it inherits it)
    cluster = cluster_factory(
        replicas=1,
        agents=0,
        orchestrator_args=[
            "--hello-timeout", "2",
            "--handshake-timeout", "4",
            "--max-pending-handshakes", "512",
            "--max-pending-per-address", "32",
        ],
    )  # fmt: skip
    pid = cluster.services["r0"].pid
    assert pid is not None
    before = _rss_mb(pid)

    # One address: past 32 pending, its new connections are closed at once.
    one = await half_open(cluster.target, ["127.0.0.3"], 200)
    try:
        await _until(
            "connections over the per-address cap are closed",
            lambda: (
                _metrics(cluster).get('timeslice_connections_closed_total{reason="address_cap"}', 0)
                >= 200 - 32
            ),
        )
    finally:
        for sock in one:
            close_now(sock)

    # 2,000 from 100 addresses (20 each, under the per-address cap): the global cap holds.
    peak = [before]
    sampling = True

    async def sample() -> None:
        while sampling:
            peak[0] = max(peak[0], _rss_mb(pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    spread = await half_open(cluster.target, spread_sources(100), 2000)
    try:
        assert len(spread) > 1500, f"only {len(spread)} of 2000 connected"
        pending = await _metric(cluster, "timeslice_pending_handshakes")
        assert pending <= 512, pending
        # A job connecting now (another address) gets its grant, every time.
        loop = asyncio.get_running_loop()
        for i in range(5):
            started = loop.time()
            async with AsyncTimeSliceClient(
                cluster.target, job_id=f"victim-{i}", call_timeout=10, **cluster.client_tls
            ) as victim:
                await victim.acquire("victim-group", timeout=10)
                await victim.yield_("victim-group")
            assert loop.time() - started < 5.0, f"acquire {i} took {loop.time() - started:.1f} s"
        await asyncio.sleep(0.5)
    finally:
        sampling = False
        await sampler
        for sock in spread:
            close_now(sock)
    # The probe's 256 KiB per connection would be 500 MB for these.
    assert peak[0] - before < 80, f"RSS went from {before:.0f} MB to {peak[0]:.0f} MB"
    metrics = await asyncio.to_thread(_metrics, cluster)
    assert metrics.get('timeslice_connections_closed_total{reason="evicted"}', 0) > 0, metrics
    # Silent connections end at the hello deadline; nothing stays pending.
    await _until(
        "every pending connection is gone",
        lambda: _metrics(cluster).get("timeslice_pending_handshakes", -1) == 0,
    )
    assert cluster.services["r0"].is_running()


@contextlib.asynccontextmanager
async def _channel(cluster: LocalCluster, pair: CertPair | None = None) -> AsyncIterator[Channel]:
    """A bare grpclib channel to the replica, with ``pair``'s certificate (default: the
    session's operator certificate)."""
    pki = cluster.pki
    assert pki is not None
    pair = pair or pki.operator
    files = TlsFiles(str(pki.ca), str(pair.cert), str(pair.key))
    context = await asyncio.to_thread(client_context, files)
    host, port = parse_address(cluster.target)
    channel = Channel(host, port, ssl=context)
    try:
        yield channel
    finally:
        channel.close()


def _lost(channel: Channel) -> bool:
    """The channel's connection was closed (grpclib marks its handler when asyncio reports it)."""
    protocol = channel._protocol
    return protocol is None or bool(cast(Handler, protocol.handler).connection_lost)


async def test_an_idle_connection_is_closed_and_one_with_an_open_stream_stays(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        replicas=1, agents=0, orchestrator_args=["--idle-connection-timeout", "1"]
    )
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="j1", **cluster.client_tls) as holder,
        _channel(cluster) as quiet,
        _channel(cluster) as watching,
    ):
        await holder.acquire("g")
        await TimeSliceStub(quiet, timeout=10).get_group_status(GetGroupStatusRequest("g"))
        events: list[GroupEvent] = []

        async def watch() -> None:
            stub = TimeSliceStub(watching)
            async for event in stub.watch_group(WatchGroupRequest("g")):
                events.append(event)

        watcher = asyncio.create_task(watch())
        try:
            await _until("the watch's first event", lambda: len(events) == 1)
            # The quiet connection is closed (GOAWAY) within the timeout and a sweep.
            await _until("the quiet connection is closed", lambda: _lost(quiet), timeout=6)
            await asyncio.sleep(1.5)  # past the timeout again: the watch has sent nothing since
            assert not _lost(watching)
            await holder.yield_("g")  # the watch is alive: it sees the change
            await _until("the watch sees the yield", lambda: len(events) >= 2)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, GRPCError, StreamTerminatedError):
                await watcher
        assert await _metric(cluster, 'timeslice_connections_closed_total{reason="idle"}') >= 1
        # Its stream ended: the watching connection is idle from then on, and closed too.
        await _until("the watch's connection is closed", lambda: _lost(watching), timeout=6)
        # A closed connection is only that: the next call connects again.
        status = await TimeSliceStub(quiet, timeout=10).get_group_status(GetGroupStatusRequest("g"))
        assert status.group_id == "g"


async def _served(channel: Channel) -> bool:
    """Whether the replica answers a call on ``channel`` (any gRPC status counts)."""
    try:
        await TimeSliceStub(channel, timeout=10).get_group_status(GetGroupStatusRequest("none"))
    except GRPCError:
        return True
    except (StreamTerminatedError, ConnectionError, OSError):
        return False
    return True


async def test_one_identity_keeps_a_bounded_number_of_connections(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        replicas=1, agents=0, orchestrator_args=["--max-connections-per-identity", "3"]
    )
    pki = cluster.pki
    assert pki is not None
    j1, j2 = pki.job("j1"), pki.job("j2")
    async with contextlib.AsyncExitStack() as stack:
        first = [await stack.enter_async_context(_channel(cluster, j1)) for _ in range(3)]
        for channel in first:
            assert await _served(channel)
        fourth = await stack.enter_async_context(_channel(cluster, j1))
        assert not await _served(fourth), "a 4th connection of job j1 was served"
        # Another job is not affected.
        other = await stack.enter_async_context(_channel(cluster, j2))
        assert await _served(other)
        # One of j1's connections closes: j1 may connect again.
        first[0].close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            async with _channel(cluster, j1) as again:
                if await _served(again):
                    break
            assert loop.time() < deadline, "j1 could not connect again after closing one"
            await asyncio.sleep(0.2)
    refused = await _metric(cluster, 'timeslice_connections_closed_total{reason="identity_cap"}')
    assert refused >= 1
    assert "already has 3 connections" in cluster.log_tail("r0", 200)


def test_connection_flags_and_their_environment_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_MAX_CONNECTIONS_PER_IDENTITY", "7")
    limits = parse_args(["--insecure", "--idle-connection-timeout", "0"]).connections
    assert (limits.max_per_identity, limits.idle_timeout) == (7, 0.0)
    assert limits.max_pending == ConnectionLimits().max_pending
    for bad, flag in (
        (["--hello-timeout", "20"], "--hello-timeout"),  # past the handshake's deadline
        (["--max-pending-per-address", "0"], "--max-pending-per-address"),
        (["--idle-connection-timeout", "-1"], "--idle-connection-timeout"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--insecure", *bad])
        assert flag in capsys.readouterr().err, bad
