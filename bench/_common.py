"""Plumbing shared by the benchmarks: clusters from asyncio, /proc readings, /metrics scrapes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import re
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from timeslice import WorkerRegistration, register
from timeslice_tools.dev.cluster import LocalCluster

SIM_LABEL = "sim backend: emulated data movement"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_SCRAPE_TIMEOUT = 5.0
_REGISTER_TIMEOUT = 20.0


@contextlib.asynccontextmanager
async def running_cluster(**kwargs: Any) -> AsyncIterator[LocalCluster]:
    """A started :class:`LocalCluster`, started and stopped off the event loop.

    Starting blocks (it waits for every ``/readyz``), so it runs in a thread; nothing else
    runs on the loop at that moment, but supervised tasks of a caller must keep running.
    """
    cluster = LocalCluster(**kwargs)
    await asyncio.to_thread(cluster.start)
    try:
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def rotated(targets: Sequence[str], index: int) -> list[str]:
    """The replica list starting at replica ``index mod R``: spreads clients over replicas."""
    shift = index % len(targets)
    return [*targets[shift:], *targets[:shift]]


async def register_workers(
    cluster: LocalCluster, pairs: Sequence[tuple[str, str]], state_bytes: int = 0
) -> list[WorkerRegistration]:
    """Register this process as a worker of every (job, group) on every node of ``cluster``.

    ``state_bytes=0`` lets the sim agent use its ``--sim-state-gb`` default. The process
    calls acquire itself, so it is registered as an acquirer (a freeze backend never stops
    it). On failure the registrations made so far are closed.
    """
    sockets = cluster.agent_sockets

    def one(job: str, group: str, node: str) -> WorkerRegistration:
        return register(
            group,
            job_id=job,
            state_bytes=state_bytes,
            socket=str(sockets[node]),
            acquirer=True,
            timeout=_REGISTER_TIMEOUT,
        )

    results = await asyncio.gather(
        *(asyncio.to_thread(one, j, g, n) for j, g in pairs for n in cluster.nodes),
        return_exceptions=True,
    )
    done = [r for r in results if isinstance(r, WorkerRegistration)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_workers(done)
        raise errors[0]
    return done


async def close_workers(registrations: Sequence[WorkerRegistration]) -> None:
    """Close registrations (each joins its thread, so off the loop)."""
    await asyncio.gather(*(asyncio.to_thread(r.close) for r in registrations))


@dataclass(frozen=True, slots=True)
class ProcSample:
    """CPU seconds (user + system) and resident memory of one process at one moment."""

    cpu_seconds: float
    rss_bytes: int


def proc_sample(pid: int) -> ProcSample:
    """Read ``/proc/<pid>/stat`` and ``/proc/<pid>/status``; raises OSError if it is gone."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # The command name (field 2) may contain spaces; fields after its ')' are fixed.
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    rss = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return ProcSample(cpu, rss)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by thread name (``comm``): the
    loop's thread is ``python``, gRPC's C threads are ``event_engine`` and the like."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue  # the thread ended meanwhile
        name = head.split("(", 1)[1]
        fields = tail.split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return out


def cluster_pids(cluster: LocalCluster) -> dict[str, int]:
    """Live pids by process name (``r0``.., ``node-0``.., ``etcd``) plus ``bench`` (us)."""
    out = {name: p.pid for name, p in cluster.processes.items() if p.poll() is None}
    out["bench"] = os.getpid()
    return out


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process (0.0 for one that is gone)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            out[name] = proc_sample(pid).cpu_seconds
        except OSError:
            out[name] = 0.0
    return out


def cpu_by_role(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds spent between two readings, summed by role (orchestrator, agents, ...)."""
    out: dict[str, float] = {}
    for name, end in after.items():
        if name.startswith("r") and name[1:].isdigit():
            role = "orchestrator"
        elif name.startswith("node-"):
            role = "agents"
        else:
            role = name
        out[role] = out.get(role, 0.0) + max(0.0, end - before.get(name, end))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format to ``{'name{labels}': value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _METRIC_LINE.match(line.strip())
        if match is None:
            continue
        try:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
        except ValueError:
            continue
    return out


async def scrape_metrics(addresses: Sequence[str]) -> dict[str, float]:
    """Sum of every replica's ``/metrics`` samples (a replica that does not answer is skipped)."""
    total: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for address in addresses:
            try:
                async with session.get(f"http://{address}/metrics") as response:
                    text = await response.text()
            except (aiohttp.ClientError, TimeoutError):
                continue
            for key, value in parse_metrics(text).items():
                total[key] = total.get(key, 0.0) + value
    return total


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, memory, Python and the commit benchmarked (read-only git query)."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "accelerator": "none (sim backend: emulated data movement)",
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gb"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    info["commit"] = code_version()
    return info


def code_version() -> str:
    """What code the services run: ``<commit> services:<tree> libs:<tree>`` (+``dirty``).

    The tree hashes of services/ and libs/ change only when that code does (a commit that
    touches bench/ or docs/ leaves them alone); ``dirty`` marks uncommitted changes there.
    Read-only git queries; ``unknown`` outside a checkout. Taken at the start and the end of
    a suite: services start afresh for every benchmark, so code changed meanwhile would mix
    versions, and the summary says so.
    """
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=root, check=False
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        trees = [f"{d}:{git('rev-parse', '--short', f'HEAD:{d}')}" for d in ("services", "libs")]
        dirty = git("status", "--porcelain", "--", "services", "libs")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not commit:
        return "unknown"
    return " ".join([commit, *trees, *(["dirty"] if dirty else [])])


def machine_line(info: Mapping[str, Any]) -> str:
    """One line naming the machine of a :func:`machine_info` reading, for a report's head."""
    return (
        f"Machine: {info.get('cpus', '?')} cores ({info.get('cpu_model', '?')}), "
        f"{info.get('memory_gb', '?')} GB, no accelerator; Python {info.get('python', '?')}; "
        f"commit {info.get('commit', '?')}"
    )
