"""What half-open and idle connections cost a replica, and whether a job still gets its grant.

    python -m bench.connections                      # this tree
    python -m bench.connections --before e14a228     # and the orchestrator as of that commit

One replica with mutual TLS (a real etcd, no agents), started afresh for each attack. The
attacker opens its connections to the gRPC port as fast as it can, holds them for ``--hold``
seconds, and reopens none that the replica closes:

- ``one address``: ``--connections`` TCP connections from 127.0.0.2 that never send a byte
  (no TLS ClientHello: the probe of issue 37);
- ``N addresses``: the same spread over ``--sources`` addresses (127.0.1.x), fewer from each
  than the per-address cap, so that the global cap is what holds;
- ``N addresses, 1 byte``: spread the same way, each sending one byte (a TLS record's first)
  and nothing more: in its handshake proper, not silent;
- ``idle TLS``: ``--tls-connections`` TLS connections with one job's certificate, each
  sending the HTTP/2 preface and then nothing.

Meanwhile a victim job, from 127.0.0.1, opens a new connection for every sample (TCP, TLS,
session) and acquires and yields a group: its acquire latency includes the connect. The
replica's RSS (``VmRSS``) is read every 0.1 s from before the attack to the end of the hold:
before, peak, and the peak's growth. "open after hold": the attacker's connections the
replica had not closed by then.

The before build is the commit's ``libs/`` and ``services/`` (``git archive``) run by this
tree's cluster code, so it gets none of the new flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._common import machine_info, machine_line, proc_sample, running_cluster, scrape_metrics
from bench.analysis import Stats
from bench.floor import export_build
from timeslice.aio import AsyncTimeSliceClient
from timeslice.targets import parse_address
from timeslice.tls import TlsFiles, client_context
from timeslice_tools.dev.cluster import LocalCluster

_CALL_TIMEOUT = 10.0
_CONNECT_TIMEOUT = 5.0
_IN_FLIGHT = 256  # connects at once
_RST = struct.pack("ii", 1, 0)


def raise_open_files(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (at most its hard limit);
    processes started afterwards (replicas) inherit it. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, want), hard)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def spread_sources(count: int) -> list[str]:
    """``count`` loopback source addresses, 127.0.1.1 on (all local on Linux)."""
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(count)]


async def half_open(
    target: str,
    sources: Sequence[str],
    count: int,
    *,
    first: bytes = b"",
    timeout: float = _CONNECT_TIMEOUT,
) -> list[socket.socket]:
    """``count`` TCP connections to ``target`` that send nothing (or only ``first``), round
    robin over ``sources`` (local addresses to bind); those that did not connect within
    ``timeout`` are left out (closed)."""
    host, port = parse_address(target)
    loop = asyncio.get_running_loop()
    opened: list[socket.socket] = []
    slots = asyncio.Semaphore(_IN_FLIGHT)

    async def one(source: str) -> None:
        async with slots:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.bind((source, 0))
                async with asyncio.timeout(timeout):
                    await loop.sock_connect(sock, (host, port))
                    if first:
                        await loop.sock_sendall(sock, first)
            except (OSError, TimeoutError):
                close_now(sock)
                return
            opened.append(sock)

    await asyncio.gather(*(one(sources[i % len(sources)]) for i in range(count)))
    return opened


def still_open(socks: Sequence[socket.socket]) -> int:
    """How many of ``socks`` the server has not closed (no EOF, no reset waiting)."""
    alive = 0
    for sock in socks:
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            alive += 1
            continue
        except OSError:
            continue
        if data:
            alive += 1
    return alive


def close_now(sock: socket.socket) -> None:
    """Close with a reset: thousands of closes leave no TIME_WAIT on the attacker's side."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    sock.close()


# An HTTP/2 client's preface and an empty SETTINGS frame: what a gRPC client sends first.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


class Held:
    """The attacker's connections: how many the server still keeps open, and closing them."""

    def __init__(self, socks: Sequence[socket.socket] = ()) -> None:
        self.socks = list(socks)
        self.streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    @property
    def connected(self) -> int:
        return len(self.socks) + len(self.streams)

    async def still_open(self) -> int:
        async def open_(reader: asyncio.StreamReader) -> bool:
            try:
                while True:  # what the server sent (SETTINGS, a GOAWAY), up to its end
                    async with asyncio.timeout(0.5):
                        if not await reader.read(1 << 16):
                            return False
            except TimeoutError:
                return True
            except OSError:
                return False

        kept = await asyncio.gather(*(open_(r) for r, _ in self.streams))
        return still_open(self.socks) + sum(kept)

    def close(self) -> None:
        for sock in self.socks:
            close_now(sock)
        for _, writer in self.streams:
            writer.transport.abort()


async def idle_tls(cluster: LocalCluster, job: str, count: int) -> Held:
    """``count`` TLS connections with ``job``'s certificate, each sending the HTTP/2 preface
    and then nothing (one of the probe's 3,000 idle connections)."""
    pki = cluster.pki
    assert pki is not None
    pair = pki.job(job)
    files = TlsFiles(str(pki.ca), str(pair.cert), str(pair.key))
    context = await asyncio.to_thread(client_context, files)
    host, port = parse_address(cluster.target)
    held = Held()
    slots = asyncio.Semaphore(32)  # under the per-address cap of pending handshakes

    async def one() -> None:
        async with slots:
            try:
                async with asyncio.timeout(_CONNECT_TIMEOUT):
                    reader, writer = await asyncio.open_connection(host, port, ssl=context)
                writer.write(H2_PREFACE)
            except (OSError, TimeoutError):
                return
            held.streams.append((reader, writer))

    await asyncio.gather(*(one() for _ in range(count)))
    return held


def rss_bytes(pid: int) -> int:
    return proc_sample(pid).rss_bytes


@dataclass
class Run:
    build: str
    attack: str
    connections: int
    connected: int
    open_at_end: int  # the attacker's connections the replica had not closed after the hold
    rss_before_mb: float
    rss_peak_mb: float
    acquire_ms: Stats
    acquire_failures: int
    replica_alive: bool
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def growth_mb(self) -> float:
        return self.rss_peak_mb - self.rss_before_mb


async def _victim(cluster: LocalCluster, stop: asyncio.Event, times: list[float]) -> int:
    """Acquire and yield, each time on a new connection, until ``stop``; failures."""
    failures = 0
    n = 0
    while not stop.is_set():
        n += 1
        started = time.perf_counter()
        client = AsyncTimeSliceClient(
            cluster.target, job_id="victim", call_timeout=_CALL_TIMEOUT, **cluster.client_tls
        )
        try:
            await client.acquire("victim-group", timeout=_CALL_TIMEOUT)
            times.append(time.perf_counter() - started)
            await client.yield_("victim-group")
        except Exception as exc:
            failures += 1
            print(f"  victim acquire {n} failed: {exc!r}", file=sys.stderr, flush=True)
        finally:
            await client.close()
        await asyncio.sleep(0.05)
    return failures


async def _watch_rss(pid: int, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):
            peak[0] = max(peak[0], rss_bytes(pid))
        await asyncio.sleep(0.1)


async def run_attack(
    cluster: LocalCluster,
    build: str,
    attack: str,
    count: int,
    hold: float,
    opener: Callable[[LocalCluster], Awaitable[Held]],
) -> Run:
    pid = cluster.services["r0"].pid
    assert pid is not None
    before = rss_bytes(pid)
    peak = [before]
    stop = asyncio.Event()
    times: list[float] = []
    watcher = asyncio.create_task(_watch_rss(pid, stop, peak))
    victim = asyncio.create_task(_victim(cluster, stop, times))
    await asyncio.sleep(1.0)  # a few samples before the attack
    held = Held()
    try:
        held = await opener(cluster)
        await asyncio.sleep(hold)
        alive = await held.still_open()
    finally:
        stop.set()
        failures = await victim
        await watcher
        held.close()
    metrics = await scrape_metrics(cluster.replica_http)
    keep = ("timeslice_tls_refusals", "timeslice_connections_closed", "timeslice_accept_pauses")
    return Run(
        build=build,
        attack=attack,
        connections=count,
        connected=held.connected,
        open_at_end=alive,
        rss_before_mb=before / 2**20,
        rss_peak_mb=peak[0] / 2**20,
        acquire_ms=Stats.of(times).scaled(1000),
        acquire_failures=failures,
        replica_alive=cluster.services["r0"].is_running(),
        metrics={
            k: v for k, v in metrics.items() if k.startswith(keep) and "_created" not in k and v
        },
    )


async def run_build(
    build: str, pythonpath: str | None, count: int, hold: float, n_sources: int, tls_count: int
) -> list[Run]:
    kwargs: dict[str, Any] = {"replicas": 1, "agents": 0, "tls": True}
    if pythonpath is not None:
        kwargs["env"] = {"PYTHONPATH": pythonpath}
    runs = []
    spread = spread_sources(n_sources)

    def tcp(
        sources: Sequence[str], first: bytes = b""
    ) -> Callable[[LocalCluster], Awaitable[Held]]:
        async def opener(cluster: LocalCluster) -> Held:
            return Held(await half_open(cluster.target, sources, count, first=first))

        return opener

    async def nothing(cluster: LocalCluster) -> Held:
        return Held()

    async def one_job(cluster: LocalCluster) -> Held:
        return await idle_tls(cluster, "flood-job", tls_count)

    attacks = (
        ("none", 0, nothing),
        ("one address", count, tcp(["127.0.0.2"])),
        (f"{n_sources} addresses", count, tcp(spread)),
        # The first byte of a TLS record, then nothing: each is in its handshake proper.
        (f"{n_sources} addresses, 1 byte", count, tcp(spread, b"\x16")),
        ("idle TLS, one job's certificate", tls_count, one_job),
    )
    for attack, n, opener in attacks:
        # A fresh replica for each attack: one's leftovers do not weigh on the next.
        async with running_cluster(**kwargs) as cluster:
            run = await run_attack(cluster, build, attack, n, hold, opener)
        print(_row(run), file=sys.stderr, flush=True)
        runs.append(run)
    return runs


def _row(run: Run) -> str:
    return (
        f"| {run.build} | {run.attack} | {run.connected}/{run.connections} | {run.open_at_end} "
        f"| {run.rss_before_mb:.0f} | {run.rss_peak_mb:.0f} | {run.growth_mb:+.0f} "
        f"| {run.acquire_ms.p50:.1f} | {run.acquire_ms.p99:.1f} | {run.acquire_ms.n} "
        f"| {run.acquire_failures} | {'yes' if run.replica_alive else 'NO'} |"
    )


HEADER = (
    "| build | attack | connected | open after hold | RSS before MB | RSS peak MB | growth MB "
    "| victim acquire p50 ms | p99 ms | acquires | failed | replica up |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", action="append", default=[], help="a commit to measure too")
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--hold", type=float, default=12.0, help="seconds the attack holds")
    parser.add_argument("--sources", type=int, default=200, help="addresses of the spread attack")
    parser.add_argument(
        "--tls-connections", type=int, default=1000, help="idle TLS connections of one job"
    )
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args(argv)
    limit = raise_open_files(args.connections * 2 + 1024)
    if limit < args.connections + 1024:
        print(f"RLIMIT_NOFILE is {limit}: too low for {args.connections}", file=sys.stderr)
        return 2
    here = os.environ.get("PYTHONPATH")
    runs: list[Run] = []
    print(HEADER, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="timeslice-before-") as scratch:
        builds: list[tuple[str, str | None]] = []
        for commit in args.before:
            tree = export_build(commit, Path(scratch) / commit)
            parts = (f"{tree}/libs", f"{tree}/services", here)
            builds.append((commit, os.pathsep.join(p for p in parts if p)))
        builds.append(("this tree", None))
        for name, pythonpath in builds:
            runs += await run_build(
                name, pythonpath, args.connections, args.hold, args.sources, args.tls_connections
            )
    machine = machine_info()
    print(machine_line(machine))
    print(HEADER)
    for run in runs:
        print(_row(run))
        if run.metrics:
            print("  " + ", ".join(f"{k} {v:g}" for k, v in sorted(run.metrics.items())))
    if args.json is not None:
        data = {"machine": machine, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
