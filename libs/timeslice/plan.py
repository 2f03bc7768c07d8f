"""Placement advisor: which jobs should share which accelerator group.

Input: the orchestrator's usage ledger of every group (per job: time held, number of holds,
first and last seen), i.e. each workload's measured accelerator busy fraction
``f = held / (last_seen - first_seen)`` and its grant rate. Output: groups of workloads
packed first-fit-decreasing by ``f`` so that each group's load (the sum of ``f`` plus the
time its switches would take) stays under ``cap``; the cap bounds the slowdown (a group
loaded near 1 makes its jobs queue), and each group's predicted duty cycle is the sum of its
jobs' busy fractions (what they keep doing, time-sliced), at most ``1 - switch time``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from timeslice_proto.timeslice.v1 import GroupStatus


@dataclass(frozen=True, slots=True)
class Workload:
    job: str
    group: str  # where it was measured
    busy: float  # fraction of wall time inside accelerator phases
    grants_per_second: float

    @property
    def name(self) -> str:
        return f"{self.job}@{self.group}"


@dataclass
class Proposal:
    workloads: list[Workload] = field(default_factory=list)
    switch_seconds: float = 0.0

    @property
    def busy(self) -> float:
        return sum(w.busy for w in self.workloads)

    @property
    def switch_load(self) -> float:
        """Fraction of time spent switching if every grant moves state (one job: none)."""
        if len(self.workloads) < 2:
            return 0.0
        return self.switch_seconds * sum(w.grants_per_second for w in self.workloads)

    @property
    def load(self) -> float:
        return self.busy + self.switch_load

    @property
    def predicted_duty(self) -> float:
        return min(self.busy, max(0.0, 1.0 - self.switch_load))


def workloads_from(statuses: Iterable[GroupStatus], min_holds: int = 3) -> list[Workload]:
    """Every (job, group) with enough history to measure."""
    found = []
    for status in statuses:
        for usage in status.usage:
            window = usage.last_seen - usage.first_seen
            if usage.holds < min_holds or window <= 0:
                continue
            found.append(
                Workload(
                    job=usage.job_id,
                    group=status.group_id,
                    busy=min(1.0, usage.held_seconds / window),
                    grants_per_second=usage.holds / window,
                )
            )
    return found


def propose(
    workloads: Iterable[Workload], *, cap: float = 0.9, switch_seconds: float = 0.0
) -> list[Proposal]:
    """First-fit decreasing: the busiest workloads first, each into the first group it fits."""
    if not 0 < cap <= 1:
        raise ValueError("cap must be in (0, 1]")
    proposals: list[Proposal] = []
    for workload in sorted(workloads, key=lambda w: (-w.busy, w.name)):
        for proposal in proposals:
            trial = Proposal([*proposal.workloads, workload], switch_seconds)
            if trial.load <= cap:
                proposal.workloads.append(workload)
                break
        else:
            proposals.append(Proposal([workload], switch_seconds))
    return proposals


def render(proposals: list[Proposal], measured_groups: int) -> str:
    lines = []
    for i, p in enumerate(proposals, start=1):
        members = ", ".join(f"{w.name} (busy {w.busy:.0%})" for w in p.workloads)
        lines.append(
            f"group {i}: {members} -> predicted duty {p.predicted_duty:.0%} (load {p.load:.0%})"
        )
    total = sum(p.predicted_duty for p in proposals) / max(1, len(proposals))
    lines.append(
        f"{len(proposals)} accelerator group(s) instead of {measured_groups}; "
        f"mean predicted duty {total:.0%}"
    )
    return "\n".join(lines)
