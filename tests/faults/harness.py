"""Helpers shared by the fault scenarios: jobs that loop through the SDK, status polling,
and the recovery-time report the closing notes and benchmarks read."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.etcdview import snapshot
from timeslice import AsyncTimeSliceClient
from timeslice_agent.journal import JournalEntry, read_journal
from timeslice_proto.timeslice.v1 import GroupStatus
from timeslice_tools.dev import _procs
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import (
    Attempt,
    Hold,
    Recorder,
    TwoPhaseSummary,
    check_fencing,
    check_two_phase,
)

REPORT = Path(os.environ.get("TIMESLICE_FAULT_REPORT", ".timeslice/fault-recovery.jsonl"))


def repeats() -> range:
    """How many times a fault scenario that races real timing runs: twice in `make test`,
    ten times in `make faults` (``TIMESLICE_FAULT_REPEATS``), which hunts the rarer
    interleavings. A race a repeat once found gets a deterministic test of its own."""
    return range(int(os.environ.get("TIMESLICE_FAULT_REPEATS", "2")))


_TERMS = re.compile(rb"^timeslice_replica_terms_total (\S+)$", re.MULTILINE)


async def http_get(address: str, path: str) -> tuple[int, bytes] | None:
    """A replica's HTTP answer (status, body), or None when it did not answer within 1 s."""
    return await asyncio.to_thread(_procs.http_status, f"http://{address}{path}", 1.0)


async def replica_terms(address: str) -> int:
    """Terms the replica at ``address`` began: a new one each time it (re)joined."""
    answer = await http_get(address, "/metrics")
    assert answer is not None and answer[0] == 200, f"no metrics from {address}"
    found = _TERMS.search(answer[1])
    assert found is not None, "timeslice_replica_terms_total missing"
    return int(float(found.group(1)))


def report_recovery(scenario: str, seconds: float, **extra: object) -> None:
    """Append one recovery time to the shared report (summarised by scripts/faultreport.py)."""
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    with REPORT.open("a") as fh:
        fh.write(json.dumps({"scenario": scenario, "seconds": seconds, **extra}) + "\n")


async def cycle(
    client: AsyncTimeSliceClient,
    group: str,
    recorder: Recorder,
    phases: int,
    *,
    hold: float = 0.02,
    gap: float = 0.01,
    timeout: float = 60.0,
    seed: int = 0,
) -> int:
    """Acquire, hold, yield ``phases`` times, recording every step."""
    rng = random.Random(seed)
    for _ in range(phases):
        started = recorder.now()
        try:
            grant = await client.acquire(group, timeout=timeout)
        except Exception as exc:
            recorder.attempt(Attempt(client.job_id, group, started, None, repr(exc)))
            raise
        granted = recorder.now()
        recorder.attempt(Attempt(client.job_id, group, started, granted))
        await asyncio.sleep(rng.uniform(0, hold))
        released = recorder.now()
        recorder.hold(Hold(client.job_id, group, grant.epoch, grant.ticket, granted, released))
        await client.yield_(group)
        await asyncio.sleep(rng.uniform(0, gap))
    return phases


async def wait_for_status(
    client: AsyncTimeSliceClient,
    group: str,
    predicate: Callable[[GroupStatus], bool],
    timeout: float,
    interval: float = 0.01,
) -> GroupStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status(group)
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"status of {group} never matched within {timeout} s: {status}")
        await asyncio.sleep(interval)


def journals(cluster: LocalCluster) -> list[JournalEntry]:
    """Every agent's journal; each must exist (an agent that never wrote one proves nothing)."""
    missing = [str(p) for p in cluster.agent_journals.values() if not p.exists()]
    assert not missing, f"agent journal(s) missing: {missing}"
    return [e for path in cluster.agent_journals.values() for e in read_journal(path)]


def check_switches(cluster: LocalCluster, *, nodes: list[str] | None = None) -> TwoPhaseSummary:
    """Fencing and two-phase order over every agent's journal, which must show switches."""
    entries = journals(cluster)
    try:
        check_fencing(entries, nodes=cluster.nodes if nodes is None else nodes)
        summary = check_two_phase(entries)
    except AssertionError as exc:
        # The journals, one line per directive in start order: what a violation needs read.
        lines = [
            f"{e.started_at:.6f} {e.finished_at:.6f} {e.node} {e.group} epoch={e.epoch} "
            f"{e.kind} {e.job} {e.status} {e.directive_id} {e.error}"
            for e in sorted(entries, key=lambda e: e.started_at)
        ]
        raise AssertionError(f"{exc}\njournals:\n" + "\n".join(lines)) from exc
    assert summary.committed > 0, f"no committed switch in the journals: {summary}"
    return summary


def replica_index(replica_id: str) -> int:
    assert replica_id.startswith("r"), replica_id
    return int(replica_id[1:])


async def describe(cluster: LocalCluster, group: str, lines: int = 15) -> str:
    """What a stuck wait needs to be told apart: the group's keys as etcd has them (a replica's
    status comes from its mirror, which may lag), and each service's last log lines."""
    root = f"{cluster.prefix}/groups/{group}/"
    keys = await snapshot(cluster)
    parts = ["etcd keys of the group (value, mod revision):"]
    parts += [
        f"  {k[len(root) :]}: {v!r} @{rev}" for k, (v, rev) in keys.items() if k.startswith(root)
    ]
    # Where each agent's stream is, and directives in flight between replicas.
    for area in ("agents", "relay"):
        here = f"{cluster.prefix}/{area}/"
        parts.append(f"etcd keys under {area}/:")
        parts += [
            f"  {k[len(here) :]}: {v[:300]!r} @{rev}"
            for k, (v, rev) in keys.items()
            if k.startswith(here)
        ]
    parts.append("each replica's own view of the group (from its mirror):")
    parts += [f"  {line}" for line in await _replica_views(cluster, group)]
    for name in cluster.services:
        parts.append(f"--- last {lines} log lines of {name}:\n{cluster.log_tail(name, lines)}")
    return "\n".join(parts)


async def _replica_views(cluster: LocalCluster, group: str) -> list[str]:
    """One line per replica: what it answers for the group (a replica whose mirror stopped
    following etcd shows a state the etcd keys above have left behind)."""
    views = []
    for name, target in zip(cluster.replica_ids, cluster.targets, strict=False):
        try:
            async with AsyncTimeSliceClient(
                target, job_id="describe", call_timeout=5, **cluster.client_tls
            ) as client:
                s = await client.status(group)
            views.append(
                f"{name}: holder {s.holder_job_id or '-'} epoch {s.holder_epoch}, queue "
                f"{[e.job_id for e in s.queue]}, switch {s.switch}, last_error {s.last_error!r}"
            )
        except Exception as exc:  # a diagnosis must not hide the failure it describes
            views.append(f"{name}: {exc!r}")
    return views
