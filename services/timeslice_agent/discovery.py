"""Finding a job's GPU processes without code changes, by the labels in their environment.

A process belongs to a job when its environment (``/proc/<pid>/environ``, readable because
the agent is privileged) holds ``TIMESLICE_JOB_ID`` and ``TIMESLICE_GROUP``; on Kubernetes the
downward API sets both from pod labels. An optional ``TIMESLICE_NODE`` limits a process to the
agent of that node (several agents share one host in the dev cluster and in tests).

Candidates come from NVML's running compute processes on a GPU node, or from every process
in procfs where NVML is absent, which lets CPU-only tests prove discovery with real processes.

The same labels guard against misuse: a process whose environment names a job is never
registered, frozen or checkpointed for another job (:func:`foreign_pids`). Discovery follows
the registration rules of :mod:`timeslice_agent.peers`: never the agent itself or pid 0/1,
and each process found is pinned by its identity (start time and uids), so the backends act
on it only while that same process holds the pid.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_job_id
from timeslice_agent.nvml import DeviceMemory
from timeslice_agent.procs import PROC, ProcessIdentity, identity_of
from timeslice_proto.timeslice.v1 import WorkerInfo

log = logging.getLogger(__name__)

JOB_ENV = "TIMESLICE_JOB_ID"
GROUP_ENV = "TIMESLICE_GROUP"
NODE_ENV = "TIMESLICE_NODE"
# A process environment larger than this is not read past (labels sit in the first pages).
_MAX_ENVIRON_BYTES = 1 << 20


@dataclass(frozen=True)
class ProcessLabels:
    """What a process's environment says it belongs to."""

    pid: int
    job_id: str
    group_id: str
    node: str


def labels_of(pid: int, proc: Path = PROC) -> ProcessLabels | None:
    """The labels of ``pid``, or None when it has none (or cannot be read, or is malformed)."""
    try:
        with open(proc / str(pid) / "environ", "rb") as f:
            raw = f.read(_MAX_ENVIRON_BYTES)
    except OSError:
        return None
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key in (b"TIMESLICE_JOB_ID", b"TIMESLICE_GROUP", b"TIMESLICE_NODE"):
            env[key.decode()] = value.decode(errors="replace")
    job = env.get(JOB_ENV, "")
    if not job:
        return None
    try:
        validate_job_id(job)
        group = validate_group_id(env.get(GROUP_ENV, "")) if env.get(GROUP_ENV) else ""
    except InvalidArgument as exc:
        log.debug("process %d has malformed timeslice labels: %s", pid, exc)
        return None
    return ProcessLabels(pid=pid, job_id=job, group_id=group, node=env.get(NODE_ENV, ""))


@dataclass(frozen=True)
class Discovered:
    """A labelled process found by a scan, pinned to the process that was found."""

    info: WorkerInfo
    identity: ProcessIdentity


def foreign_pids(job_id: str, pids: Iterable[int], proc: Path = PROC) -> list[int]:
    """The pids whose environment names a job other than ``job_id`` (never to be moved)."""
    foreign = []
    for pid in pids:
        labels = labels_of(pid, proc)
        if labels is not None and labels.job_id != job_id:
            foreign.append(pid)
    return foreign


def _all_pids(proc: Path) -> list[int]:
    return [int(name) for name in os.listdir(proc) if name.isdigit()]


class ProcessFinder:
    """Scans for labelled processes of this node (from NVML's list, or all of procfs)."""

    def __init__(
        self,
        *,
        node: str,
        memory: DeviceMemory | None,
        own_pid: int | None = None,
        proc: Path = PROC,
    ) -> None:
        self._node = node
        self._memory = memory
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._proc = proc

    @property
    def source(self) -> str:
        """``nvml`` or ``procfs``: where candidates come from."""
        return "nvml" if self._memory is not None else "procfs"

    def _labelled(self, candidates: Iterable[int]) -> list[Discovered]:
        found = []
        for pid in sorted(candidates):
            if pid == self._own_pid or pid <= 1:
                continue
            identity = identity_of(pid, self._proc)
            if identity is None:
                continue
            labels = labels_of(pid, self._proc)
            if labels is None or not labels.group_id:
                continue
            if labels.node and labels.node != self._node:
                continue
            # The labels must be the pinned process's: not read across a pid reuse.
            if identity_of(pid, self._proc) != identity:
                continue
            info = WorkerInfo(job_id=labels.job_id, group_id=labels.group_id, pid=pid)
            found.append(Discovered(info, identity))
        return found

    async def scan(self) -> list[Discovered]:
        """Every labelled process of this node, as worker records without app callbacks."""
        if self._memory is not None:
            candidates: Iterable[int] = await self._memory.compute_pids()
            return await asyncio.to_thread(self._labelled, candidates)

        def scan_procfs() -> list[Discovered]:
            return self._labelled(_all_pids(self._proc))

        return await asyncio.to_thread(scan_procfs)
