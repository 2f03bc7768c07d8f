"""Two builds' handoffs side by side, sample by sample.

    python -m bench.paired --before 77edb98              # that commit against this tree
    python -m bench.paired --before 77edb98 --after 23dd799 --samples 1000
    python -m bench.paired --before HEAD                 # this tree's commit against itself (A/A)

:mod:`bench.floor` alternates builds run by run, a few seconds each. On these machines the
host's speed swings 2-3x within minutes, so a change worth a few percent hides in that drift
unless many rounds are run. Here each build runs in a process of its own, with its own SDK,
its own replica and its own etcd, all started at once; the parent then asks the two in turn
for one hand-over each (ABBA order), so every pair of samples meets the same host. Each
hand-over is :func:`bench.controlplane.hand_over_once` (the figure of the targets: both jobs'
clients in one process, one replica). A build is a commit's ``libs/`` and ``services/``
(:func:`bench.floor.export_build`), or this tree; the benchmark's own code is this tree's.

It prints each build's p50 and p99, the ratio of the after build's p50 to the before build's,
and that ratio for every 100 pairs: a difference is real when those agree and lie outside what
the same build against itself gives. On this machine two A/A runs of 600 pairs (``--before
HEAD`` against the same tree) gave 1.029 and 1.016, every 100 pairs within 0.97-1.05: one run
resolves about 4%, not less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._common import machine_info, machine_line, running_cluster
from bench.analysis import Stats
from bench.controlplane import hand_over_once
from bench.floor import export_build
from timeslice_tools.dev.cluster import LocalCluster

_ROOT = Path(__file__).resolve().parent.parent
_GROUP = "paired"
_WARMUP = 20  # hand-overs per build before measuring (sessions, connections, records)
_CHUNK = 100  # pairs per printed ratio
_START_TIMEOUT = 180.0  # a build's cluster up and warmed
_STEP_TIMEOUT = 60.0  # one hand-over, asked by the parent
_CALL_TIMEOUT = 30.0


@dataclass(frozen=True)
class PairedResult:
    before: str
    after: str
    pairs: int
    before_ms: Stats
    after_ms: Stats
    p50_ratio: float  # after / before
    chunk_ratios: list[float]  # the same, per _CHUNK pairs


async def _child() -> None:
    """One build's side: start a cluster, warm up, then one hand-over per line on stdin,
    answered with its seconds on stdout; ends at EOF."""
    from timeslice import AsyncTimeSliceClient

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with running_cluster(replicas=1, agents=0) as cluster:
        clients = [
            AsyncTimeSliceClient(
                cluster.targets,
                job_id=f"paired-{i}",
                call_timeout=_CALL_TIMEOUT,
                **cluster.client_tls,
            )
            for i in range(2)
        ]
        try:
            await _operator_group(cluster, _GROUP)
            holder, waiter = clients
            await holder.acquire(_GROUP, timeout=_CALL_TIMEOUT)
            for _ in range(_WARMUP):
                await hand_over_once(holder, waiter, _GROUP)
                holder, waiter = waiter, holder
            print("ready", flush=True)
            while await reader.readline():
                measured = await hand_over_once(holder, waiter, _GROUP)
                holder, waiter = waiter, holder
                print(measured.handoff_seconds, flush=True)
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def _operator_group(cluster: LocalCluster, group: str) -> None:
    """Create ``group`` as an operator does (``timeslice members GROUP --clear``): a known
    group, as a group its nodes serve is in a deployment, so the hand-over measured is not
    also the unknown-group warning path (docs/groups.md)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "timeslice.cli",
        "members",
        group,
        "--clear",
        "--target",
        ",".join(cluster.targets),
        "--token-file",
        str(cluster.operator_token_file),
        env={**os.environ, **cluster.client_env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), _CALL_TIMEOUT)
    if process.returncode != 0:
        raise RuntimeError(f"timeslice members {group} --clear: {err.decode().strip()}")


class _Build:
    """A child process running one build."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self._process = process
        self.samples: list[float] = []

    @classmethod
    async def start(cls, name: str, tree: Path | None) -> _Build:
        env = dict(os.environ)
        paths = [f"{tree}/libs", f"{tree}/services"] if tree is not None else []
        env["PYTHONPATH"] = os.pathsep.join(
            [*paths, str(_ROOT / "libs"), str(_ROOT / "services"), str(_ROOT)]
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.paired",
            "--child",
            cwd=_ROOT,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(name, process)

    async def _line(self, timeout: float) -> str:
        assert self._process.stdout is not None
        async with asyncio.timeout(timeout):
            line = await self._process.stdout.readline()
        if not line:
            code = await self._process.wait()
            raise RuntimeError(f"build {self.name}: its process ended ({code})")
        return line.decode().strip()

    async def ready(self) -> None:
        while (line := await self._line(_START_TIMEOUT)) != "ready":
            print(f"{self.name}: {line}", file=sys.stderr)

    async def hand_over(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(b"go\n")
        await self._process.stdin.drain()
        self.samples.append(float(await self._line(_STEP_TIMEOUT)))

    async def stop(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            async with asyncio.timeout(60):
                await self._process.wait()
        except TimeoutError:
            self._process.kill()
            await self._process.wait()


async def measure(
    before: tuple[str, Path | None], after: tuple[str, Path | None], pairs: int
) -> PairedResult:
    """``pairs`` hand-overs of each build, interleaved ABBA."""
    builds = [await _Build.start(name, tree) for name, tree in (before, after)]
    try:
        await asyncio.gather(*(b.ready() for b in builds))
        a, b = builds
        for i in range(pairs):
            for build in (a, b) if i % 2 == 0 else (b, a):
                await build.hand_over()
    finally:
        await asyncio.gather(*(b.stop() for b in builds))
    x, y = a.samples, b.samples
    chunks = [
        statistics.median(y[i : i + _CHUNK]) / statistics.median(x[i : i + _CHUNK])
        for i in range(0, pairs - _CHUNK + 1, _CHUNK)
    ]
    before_ms, after_ms = Stats.of(x).scaled(1000), Stats.of(y).scaled(1000)
    return PairedResult(
        before=a.name,
        after=b.name,
        pairs=pairs,
        before_ms=before_ms,
        after_ms=after_ms,
        p50_ratio=after_ms.p50 / before_ms.p50,
        chunk_ratios=chunks,
    )


def report(result: PairedResult) -> str:
    r = result
    return "\n".join(
        [
            f"{r.pairs} pairs of hand-overs (1 replica, both jobs in one process each side)",
            f"  before {r.before}: p50 {r.before_ms.p50:.2f} ms, p99 {r.before_ms.p99:.2f} ms",
            f"  after  {r.after}: p50 {r.after_ms.p50:.2f} ms, p99 {r.after_ms.p99:.2f} ms",
            f"  after / before p50: {r.p50_ratio:.3f}; per {_CHUNK} pairs: "
            + ", ".join(f"{c:.2f}" for c in r.chunk_ratios),
        ]
    )


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=False, help="a commit (the baseline)")
    parser.add_argument("--after", help="a commit (default: this tree)")
    parser.add_argument("--samples", type=int, default=600, help="pairs of hand-overs")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        await _child()
        return 0
    if args.before is None:
        parser.error("--before is required")
    with tempfile.TemporaryDirectory(prefix="timeslice-paired-") as scratch:
        before = (args.before, export_build(args.before, Path(scratch) / "before"))
        after_tree = export_build(args.after, Path(scratch) / "after") if args.after else None
        after = (args.after or "this tree", after_tree)
        result = await measure(before, after, args.samples)
    machine = machine_info()
    print(machine_line(machine))
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps({**asdict(result), "machine": machine}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
