"""What the dashboard tells beside its live rows: each group's colour, its timeline of holds
and switches, and the nodes.

Pure parts, fed by :class:`~.dashboard.Dashboard` with what the mirror shows:

- :func:`group_color`: a colour derived from the group's name alone, so a group keeps its
  colour whatever other groups appear or go (a colour by position would shift them all).
- :class:`GroupTimeline`: who held the group, from when to when, and each switch between
  holds with how long it took (the driver's figure) and whether an emulated backend made it.
  Bounded: at most ``max_entries`` entries a group, the oldest dropped first.
- :func:`node_json`: a node as the nodes view shows it: its backend (and whether it only
  models data movement), since when its agent is connected, the jobs parked there and their
  bytes, and the host memory free its agent last reported, with when. Agents report it in
  their hello and heartbeats to the replica holding their stream, which keeps it in memory
  only (not in etcd): another replica's page says which replica holds the figure ("reported
  to r1") rather than guess, and a modelled host's figure is labelled emulated.
"""

from __future__ import annotations

import colorsys
import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from timeslice_orchestrator.hub import HostReport
from timeslice_orchestrator.store.records import AgentRecord

__all__ = [
    "GroupTimeline",
    "Hold",
    "HostReports",
    "Story",
    "SwitchSpan",
    "group_color",
    "node_json",
]

DEFAULT_TIMELINE_ENTRIES = 30


class HostReports(Protocol):
    """Where the host memory free of the agents whose streams this replica holds is kept
    (the agent hub)."""

    @property
    def host_version(self) -> int:
        """Counts the reports heard: a change means the nodes view is worth sending again."""
        ...

    def host_report(self, node: str) -> HostReport | None: ...


def group_color(name: str) -> str:
    """A stable ``#rrggbb`` for ``name``: its hue from a hash of the name, in a saturation and
    lightness that read on white; the same name gets the same colour on every page, every
    replica and every run."""
    digest = hashlib.sha256(name.encode()).digest()
    hue = int.from_bytes(digest[:2], "big") / 65536
    # Two lightness steps (from another byte) keep neighbouring hues apart more often.
    lightness = 0.40 if digest[2] & 1 else 0.50
    red, green, blue = colorsys.hls_to_rgb(hue, lightness, 0.65)
    return "#" + "".join(f"{round(c * 255):02x}" for c in (red, green, blue))


@dataclass(frozen=True, slots=True)
class Hold:
    """A job held the group from ``start`` to ``end`` (None: holds it still). Wall clock."""

    job: str
    start: float
    end: float | None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "hold", "job": self.job, "start": self.start, "end": self.end}


@dataclass(frozen=True, slots=True)
class SwitchSpan:
    """A switch that ended at ``end`` (wall clock) after ``seconds`` (the driver's figure)."""

    from_job: str
    to_job: str
    end: float
    seconds: float
    outcome: str  # "committed" | "rolled_back"
    emulated: bool  # a node of the group only models data movement: the time is modelled

    @property
    def start(self) -> float:
        return self.end - self.seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "switch",
            "from": self.from_job,
            "to": self.to_job,
            "start": self.start,
            "end": self.end,
            "seconds": round(self.seconds, 4),
            "outcome": self.outcome,
            "emulated": self.emulated,
        }


class GroupTimeline:
    """One group's holds and switches in the order they happened (bounded, oldest dropped)."""

    def __init__(self, max_entries: int = DEFAULT_TIMELINE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._entries: deque[Hold | SwitchSpan] = deque(maxlen=max_entries)
        self._open: Hold | None = None  # the hold in progress, not yet in _entries

    def holder(self, job: str, at: float) -> None:
        """The group's holder is ``job`` ("" when free) as of ``at``: a different holder ends
        the hold in progress there and starts one."""
        current = self._open
        if current is not None and current.job == job:
            return
        if current is not None:
            self._entries.append(Hold(current.job, current.start, max(at, current.start)))
        self._open = Hold(job, at, None) if job else None

    def switched(self, span: SwitchSpan) -> None:
        """A switch ended (it is placed where it ended; holds around it are the holder's)."""
        self._entries.append(span)

    @property
    def last_activity(self) -> float | None:
        """When something last happened (None: nothing), or now if a hold is in progress."""
        if self._open is not None:
            return float("inf")
        if not self._entries:
            return None
        last = self._entries[-1]
        return last.end if last.end is not None else float("inf")

    def entries(self, since: float) -> list[Hold | SwitchSpan]:
        """What happened from ``since`` on (holds that ended before are left out), oldest
        first, the hold in progress last."""
        out: list[Hold | SwitchSpan] = [e for e in self._entries if e.end is None or e.end >= since]
        if self._open is not None:
            out.append(self._open)
        return sorted(out, key=lambda e: e.start)

    def to_json(self, since: float) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries(since)]


def node_json(
    agent: AgentRecord,
    parked: list[str],
    host: HostReport | None = None,
    replica: str | None = None,
) -> dict[str, Any]:
    """A node as the nodes view shows it; ``parked``: the jobs whose state is parked there
    (from the residency records of the groups this dashboard has shown); ``host``: the host
    memory free its agent last reported on a stream this replica holds; ``replica``: this
    replica's id, to name the replica that holds the figure when this one does not (None: the
    dashboard sees no agent streams, so it names none)."""
    elsewhere = host is None and replica is not None and agent.replica != replica
    return {
        "node": agent.node,
        "backend": agent.backend,
        "emulated": agent.emulated,
        "replica": agent.replica,
        "connected_at": agent.connected_at,
        "devices": agent.devices,
        "workers": len(agent.workers),
        "jobs": sorted({w.job for w in agent.workers}),
        "parked": sorted(parked),
        "parked_bytes": sum(agent.job_bytes(job) for job in set(parked)),
        # Heard by this replica only (heartbeats are not written to etcd): never guessed.
        "host_free_bytes": host.available_bytes if host is not None else None,
        "host_heard_at": host.heard_at if host is not None else None,
        "host_emulated": host.modelled if host is not None else False,
        "host_reported_to": agent.replica if elsewhere else None,
    }


class Story:
    """What the dashboard keeps for its timelines and nodes view, bounded: a timeline for at
    most ``max_groups`` groups (a group past that gets one once another has gone quiet), and
    the jobs parked on each node as the residency of the groups shown last said."""

    def __init__(self, max_groups: int, max_entries: int = DEFAULT_TIMELINE_ENTRIES) -> None:
        self.max_groups = max_groups
        self.max_entries = max_entries
        self.timelines: dict[str, GroupTimeline] = {}
        self._parked: dict[str, dict[str, list[str]]] = {}
        self.parked_version = 0
        """Counts changes of the parked jobs: a stream sends the nodes view again on one."""

    def timeline(self, group: str) -> GroupTimeline | None:
        """The group's timeline, made on first use; None while ``max_groups`` are kept."""
        timeline = self.timelines.get(group)
        if timeline is None and len(self.timelines) < self.max_groups:
            timeline = self.timelines[group] = GroupTimeline(self.max_entries)
        return timeline

    def timeline_json(self, group: str, since: float) -> list[dict[str, Any]]:
        timeline = self.timelines.get(group)
        return timeline.to_json(since) if timeline is not None else []

    def forget(self, group: str) -> None:
        """The group is gone."""
        self.timelines.pop(group, None)
        if self._parked.pop(group, None):
            self.parked_version += 1

    def prune(self, horizon: float) -> None:
        """Drop the timelines with nothing after ``horizon`` and no hold in progress."""
        for group, timeline in list(self.timelines.items()):
            last = timeline.last_activity
            if last is None or last < horizon:
                del self.timelines[group]

    def parked(self, group: str, by_node: dict[str, list[str]]) -> None:
        """The jobs parked on each node for ``group``, as its residency shows them now."""
        if self._parked.get(group, {}) != by_node:
            self._parked[group] = by_node
            self.parked_version += 1

    def nodes_json(
        self,
        agents: dict[str, AgentRecord],
        host: Callable[[str], HostReport | None] | None = None,
        replica: str | None = None,
    ) -> list[dict[str, Any]]:
        """Every connected node, with the jobs parked there as the groups seen say, and the
        host memory free ``host`` has for it (see :func:`node_json`)."""
        parked: dict[str, list[str]] = {}
        for by_node in self._parked.values():
            for node, jobs in by_node.items():
                parked.setdefault(node, []).extend(jobs)
        return [
            node_json(agents[n], parked.get(n, []), host(n) if host is not None else None, replica)
            for n in sorted(agents)
        ]
