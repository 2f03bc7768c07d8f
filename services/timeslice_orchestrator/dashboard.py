"""The live dashboard on the HTTP port: ``/`` (the page), ``/events`` (SSE), ``/state`` (JSON).

Everything shown comes from this replica's mirror (every replica mirrors every group, so the
page works behind any of them) and from the :class:`~.holds.HoldTracker` that feeds the
``/metrics`` duty cycle: nothing here reads etcd, and no figure is computed twice. The
placement pools, which the mirror does not follow, are the exception: read from etcd while a
page is open, at most every few seconds, under a deadline (:mod:`.dashboard_pools`).

A stream is a server-sent event stream. What it owes its browser is kept as a *set* of the
group names that changed since its last write (plus two flags), never as a list of messages:
a burst of a thousand changes to one group costs one entry, and the state sent is the group's
latest when the write happens. The set is bounded by the groups a stream shows; past that it
collapses into "send a new snapshot". Writes are spaced by at least ``min_interval``, and a
write that does not finish within ``stuck_seconds`` (the browser stopped reading, and the
socket's buffers are full) drops the stream: a stuck browser holds at most the kernel's socket
buffers and aiohttp's write buffer, then nothing. At most ``max_streams`` streams are open at
once; the next gets 503.

The page is a constant (``dashboard.html``, package data) with inline script and style allowed
by hash in a strict Content-Security-Policy; it puts every name into the document as text
(``textContent``), never as markup, so a group or job called ``<script>`` shows as such.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import importlib.resources
import json
import logging
import re
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from timeslice_orchestrator.dashboard_pools import PoolsPanel
from timeslice_orchestrator.dashboard_story import HostReports, Story, SwitchSpan, group_color
from timeslice_orchestrator.holds import HoldTracker
from timeslice_orchestrator.store.mirror import GroupView, RelayPost
from timeslice_orchestrator.store.records import (
    AgentRecord,
    CorruptRecord,
    GroupStats,
    HolderRecord,
    Stored,
    SwitchRecord,
    hold_epoch,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_STREAMS",
    "PAGE",
    "Dashboard",
    "DashboardConfig",
    "MirrorView",
    "SwitchEnd",
    "content_security_policy",
    "dashboard_url",
    "parse_query",
]

DEFAULT_MAX_STREAMS = 256
_GROUP_PREFIX = "group:"
_AGENTS_TOPIC = "agent"
# Query strings: only these keys, each at most once, values checked (see parse_query).
_QUERY_KEYS = frozenset({"group"})
_MAX_QUERY = 1024
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")


class MirrorView(Protocol):
    """What the dashboard reads of the replica's :class:`~.store.follower.Mirror`."""

    revision: int

    def group_names(self) -> list[str]: ...
    def has_group(self, group: str) -> bool: ...
    def group(self, group: str) -> GroupView: ...
    def stats(self, group: str) -> GroupStats | None: ...
    def holder(self, group: str) -> Stored[HolderRecord] | None: ...
    def switch(self, group: str) -> Stored[SwitchRecord] | None: ...
    def has_waiters(self, group: str) -> bool: ...
    def quiet(self, group: str) -> bool: ...
    def agents(self) -> dict[str, AgentRecord]: ...
    def relays(self) -> list[RelayPost]: ...
    def add_listener(self, listener: Callable[[set[str]], None]) -> None: ...
    def remove_listener(self, listener: Callable[[set[str]], None]) -> None: ...


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    """Limits of the dashboard; see the module docstring."""

    max_streams: int = DEFAULT_MAX_STREAMS
    """Event streams open at once; one more gets 503 (``--dashboard-max-streams``)."""
    stuck_seconds: float = 10.0
    """A write to a stream that takes longer drops the stream (``--dashboard-stuck-seconds``)."""
    min_interval: float = 0.2
    """Writes to one stream are at least this far apart (changes in between coalesce)."""
    ping_seconds: float = 15.0
    """A comment line after this long without a write: proxies keep the stream open, and a
    gone browser is noticed."""
    max_groups: int = 200
    """Groups one page shows at most (busiest first); the rest are counted, not sent."""
    max_queue: int = 20
    """Waiters listed per group (the queue's length is always sent)."""
    recent_switches: int = 30
    """Switch ends kept for the "recent switches" list."""
    timeline_entries: int = 30
    """Holds and switches a group's timeline keeps (the oldest go first)."""
    timeline_groups: int = 2000
    """Groups with a timeline at most: past it, a group gets one when others have gone quiet
    (memory stays bounded with 100,000 busy groups; the page shows 200 at most)."""
    sample_seconds: float = 5.0
    """How often the duty cycle chart gets a point."""
    history_seconds: float = 600.0
    """How far back the chart goes."""
    chart_groups: int = 8
    """Groups the chart draws at most (highest duty cycle first)."""

    def __post_init__(self) -> None:
        if self.max_streams < 0:
            raise ValueError("max_streams must not be negative")
        if self.stuck_seconds <= 0 or self.min_interval < 0 or self.sample_seconds <= 0:
            raise ValueError("stuck_seconds and sample_seconds must be positive")


@dataclass(frozen=True, slots=True)
class SwitchEnd:
    """A switch seen to end in the mirror: the group's stats counted one more."""

    group: str
    from_job: str
    to_job: str
    outcome: str  # "committed" | "rolled_back"
    seconds: float
    at: float  # wall clock, when this replica saw it
    emulated: bool = False  # a node of the group only models data movement: modelled time

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "from": self.from_job,
            "to": self.to_job,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 4),
            "at": self.at,
            "emulated": self.emulated,
        }


@dataclass(slots=True)
class _Seen:
    """What the dashboard last saw of a group: enough to tell that a switch ended."""

    switches: int
    rollbacks: int
    holder: str
    switch_from: str
    switch_to: str
    queued: bool


@dataclass(eq=False, slots=True)
class _Stream:
    """One open event stream and what it still owes its browser (bounded: see module doc)."""

    only: str | None  # ?group=NAME: this group alone
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dirty: set[str] = field(default_factory=set)
    resync: bool = False
    recent: bool = False
    duty: bool = False
    nodes_sent: int = -1  # the parked version its nodes view was last sent at
    hosts_sent: int = -1  # the host reports' version it was last sent at (see _update)
    pools: bool = False  # the pools were read again and changed
    closed: bool = False


def _load_page() -> bytes:
    return (
        importlib.resources.files("timeslice_orchestrator").joinpath("dashboard.html").read_bytes()
    )


PAGE = _load_page()
"""The page served at ``/``: one self-contained HTML document (no external resources)."""


def _hashes(tag: str) -> list[str]:
    """CSP source hashes of every inline ``<tag>`` element of :data:`PAGE`."""
    text = PAGE.decode()
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
    return [
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in found
    ]


def content_security_policy() -> str:
    """The page's policy: its own inline script and style (by hash), the event stream on the
    same origin, and nothing else (no other script, frame, form, image or plugin)."""
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {' '.join(_hashes('script'))}",
            f"style-src {' '.join(_hashes('style'))}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


_CSP = content_security_policy()
_PAGE_HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def dashboard_url(host: str, port: int) -> str:
    """The page's address for people, from the address the HTTP port is bound to: a wildcard
    (every interface) is shown as ``localhost``, an IPv6 address in brackets."""
    if host in ("", "0.0.0.0", "::"):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def parse_query(query_string: str) -> dict[str, str]:
    """The dashboard's query parameters, strictly: ``group=NAME`` at most, nothing else.

    Raises:
        ValueError: anything else (unknown or repeated keys, bad percent escapes, bytes that
            are not UTF-8, a group name that is not a valid id, an overlong query).
    """
    if len(query_string) > _MAX_QUERY:
        raise ValueError(f"query string longer than {_MAX_QUERY} characters")
    if not query_string:
        return {}
    if _BAD_PERCENT.search(query_string):
        raise ValueError("malformed percent escape in the query string")
    pairs = urllib.parse.parse_qsl(
        query_string,
        keep_blank_values=True,
        strict_parsing=True,
        encoding="utf-8",
        errors="strict",
        max_num_fields=len(_QUERY_KEYS),
    )
    out: dict[str, str] = {}
    for key, value in pairs:
        if key not in _QUERY_KEYS:
            raise ValueError(f"unknown query parameter {key!r}")
        if key in out:
            raise ValueError(f"query parameter {key!r} given twice")
        out[key] = value
    group = out.get("group")
    if group is not None and (".." in group or not _GROUP_NAME.fullmatch(group)):
        raise ValueError("group= is not a valid group id")
    return out


class Dashboard:
    """The dashboard's state (recent switches, duty cycle history) and its HTTP handlers.

    :meth:`on_change` is a mirror listener (registered by :meth:`start` after the hold
    tracker's, so the tracker is current when it runs); :meth:`sample` adds a point to the
    chart and is called every ``sample_seconds`` by :meth:`run` (a supervised task).
    """

    def __init__(
        self,
        mirror: MirrorView,
        tracker: HoldTracker,
        config: DashboardConfig | None = None,
        *,
        replica: str = "",
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        pools: PoolsPanel | None = None,
    ) -> None:
        self.config = config or DashboardConfig()
        self._mirror = mirror
        # Placement pools, read from etcd while a page is open (dashboard_pools.py).
        self.pools = pools
        self._page_open = asyncio.Event()
        self._tracker = tracker
        self._replica = replica
        self._clock = clock
        self._wall = wall
        self._streams: set[_Stream] = set()
        self._seen: dict[str, _Seen] = {}
        self._unreadable_seen: set[tuple[str, str]] = set()
        self.recent: deque[SwitchEnd] = deque(maxlen=self.config.recent_switches)
        samples = max(1, int(self.config.history_seconds / self.config.sample_seconds))
        self.history: deque[tuple[float, dict[str, float]]] = deque(maxlen=samples)
        # Per group: its holds and switches (groups seen held or switching), and the jobs
        # parked on each node as the group's residency last showed it (groups shown).
        self.story = Story(self.config.timeline_groups, self.config.timeline_entries)
        self._agents: dict[str, AgentRecord] | None = None  # decoded once per agents change
        # The host memory free of the agents this replica holds (the hub, set once it is up).
        self.hosts: HostReports | None = None
        self._started = False
        self.streams_gauge = Gauge(
            "timeslice_dashboard_streams", "Dashboard event streams open", registry=registry
        )
        self.refused = Counter(
            "timeslice_dashboard_refused",
            "Dashboard requests refused, by reason",
            ["reason"],
            registry=registry,
        )
        self.dropped = Counter(
            "timeslice_dashboard_streams_dropped",
            "Event streams dropped because their browser stopped reading",
            registry=registry,
        )

    @property
    def streams(self) -> int:
        """Event streams open now."""
        return len(self._streams)

    # -- feeding --------------------------------------------------------------------------

    def start(self) -> None:
        """Remember the groups as they are (no switch ends for what happened before), then
        follow every change."""
        mirror = self._mirror
        for group in mirror.group_names():
            try:
                if mirror.quiet(group):
                    # Seen first at its next change: a switch is written (a change) before
                    # it can end. A deployment's 100,000 idle groups cost no decode here.
                    continue
                self._seen[group] = self._seen_now(group)[0]
                holder = mirror.holder(group)
                timeline = self.story.timeline(group) if holder is not None else None
                if holder is not None and timeline is not None:  # the hold, from its grant
                    timeline.holder(holder.record.job, holder.record.granted_at)
            except CorruptRecord as exc:
                self._unreadable(group, exc)
        self._mirror.add_listener(self.on_change)
        self._started = True
        self.sample()

    def stop(self) -> None:
        """Stop following the mirror and end every stream (their handlers return)."""
        if self._started:
            self._mirror.remove_listener(self.on_change)
            self._started = False
        self.close_streams()

    def close_streams(self) -> None:
        """Ask every stream to end (shutdown: aiohttp waits for its handlers)."""
        for stream in self._streams:
            stream.closed = True
            stream.wake.set()

    async def run(self) -> None:
        """Sample the duty cycle every ``sample_seconds``, and read the pools while a page is
        open, for ever."""
        async with asyncio.TaskGroup() as tasks:
            if self.pools is not None:
                tasks.create_task(self._follow_pools(self.pools))
            while True:
                await asyncio.sleep(self.config.sample_seconds)
                self.sample()

    async def _follow_pools(self, pools: PoolsPanel) -> None:
        """Read the pools every ``refresh_seconds`` while a stream is open; a read that
        changed them is sent to every stream (a stream never waits for a read)."""
        while True:
            await self._page_open.wait()
            if await pools.fresh():
                for stream in self._streams:
                    stream.pools = True
                    stream.wake.set()
            await asyncio.sleep(pools.config.refresh_seconds)

    def _seen_now(self, group: str) -> tuple[_Seen, GroupStats]:
        """What the group shows now, and its statistics. Runs on every change of every group,
        dashboard open or not: it reads the few records it needs (each decoded once per
        write), not a whole view of the group."""
        mirror = self._mirror
        stats = mirror.stats(group) or GroupStats()
        holder = mirror.holder(group)
        switch = mirror.switch(group)
        seen = _Seen(
            switches=stats.switches,
            rollbacks=stats.rollbacks,
            holder=holder.record.job if holder is not None else "",
            switch_from=",".join(switch.record.from_jobs) if switch is not None else "",
            switch_to=switch.record.to_job if switch is not None else "",
            queued=mirror.has_waiters(group),
        )
        return seen, stats

    def on_change(self, topics: set[str]) -> None:
        """Mirror listener: note switch ends, mark the changed groups for every stream."""
        groups: list[str] = []
        agents = False
        for topic in topics:
            if topic.startswith(_GROUP_PREFIX):
                groups.append(topic[len(_GROUP_PREFIX) :])
            elif topic == _AGENTS_TOPIC:
                agents = True
                self._agents = None
        ended = False
        for group in groups:
            ended |= self._observe(group)
        if not self._streams:
            return
        for stream in self._streams:
            if agents:
                # A node (dis)connected: which nodes a group has may change, for any group.
                stream.resync = True
            elif stream.only is None:
                stream.dirty.update(groups)
            elif stream.only in groups:
                stream.dirty.add(stream.only)
            if len(stream.dirty) > self.config.max_groups:
                stream.dirty.clear()  # bounded: send a snapshot instead
                stream.resync = True
            stream.recent |= ended
            if stream.dirty or stream.resync or stream.recent:
                stream.wake.set()

    def _observe(self, group: str) -> bool:
        """Whether ``group``'s stats show a switch that ended since the last look."""
        if not self._mirror.has_group(group):
            self._seen.pop(group, None)
            self.story.forget(group)
            return False
        try:
            now, stats = self._seen_now(group)
        except CorruptRecord as exc:
            self._unreadable(group, exc)
            return False
        before = self._seen.get(group)
        self._seen[group] = now
        wall = self._wall()
        if now.holder or group in self.story.timelines:
            if (timeline := self.story.timeline(group)) is not None:
                timeline.holder(now.holder, wall)
        if before is None:
            return False
        ended: list[SwitchEnd] = []
        from_job = before.switch_from or before.holder
        to_job = before.switch_to or now.holder
        if now.switches > before.switches:
            # The stats record carries the last switch's duration (the driver's commit).
            ended.append(
                SwitchEnd(group, from_job, to_job, "committed", stats.last_switch_seconds, wall)
            )
        if now.rollbacks > before.rollbacks:
            ended.append(SwitchEnd(group, from_job, before.switch_to, "rolled_back", 0.0, wall))
        if ended:
            emulated = self._emulated(group)
            for end in ended:
                end = dataclasses.replace(end, emulated=emulated)
                self.recent.appendleft(end)
                if (timeline := self.story.timeline(group)) is not None:
                    timeline.switched(
                        SwitchSpan(
                            end.from_job, end.to_job, wall, end.seconds, end.outcome, emulated
                        )
                    )
        return bool(ended)

    def _emulated(self, group: str) -> bool:
        """Whether a node serving ``group`` only models data movement (its figures are
        modelled, and labelled so)."""
        if self._agents is None:
            self._agents = self._mirror.agents()
        return any(
            agent.emulated and any(w.group == group for w in agent.workers)
            for agent in self._agents.values()
        )

    def _point(self) -> tuple[float, dict[str, float]]:
        """The duty cycle of the busiest groups now (the hold tracker's figures)."""
        now = self._clock()
        tracker = self._tracker
        tracker.expire(now)
        duty = sorted(
            ((tracker.duty_cycle(g, now), g) for g in tracker.groups()),
            key=lambda item: (-item[0], item[1]),
        )[: self.config.chart_groups]
        return self._wall(), {g: round(d, 4) for d, g in duty}

    def sample(self) -> None:
        """Add the duty cycle of the busiest groups now to the chart's history."""
        self.history.append(self._point())
        # Timelines with nothing left to show (no hold in progress, nothing within the
        # chart's span) go: a group idle that long shows an empty timeline anyway.
        self.story.prune(self._wall() - self.config.history_seconds)
        for stream in self._streams:
            stream.duty = True
            stream.wake.set()

    # -- what is sent ---------------------------------------------------------------------

    def _chosen(self, only: str | None) -> tuple[list[str], int]:
        """The groups a page shows (busiest first, then by name) and how many it leaves out."""
        mirror = self._mirror
        if only is not None:
            return ([only] if mirror.has_group(only) else []), 0
        names = mirror.group_names()
        busy = {g for g, s in self._seen.items() if s.holder or s.switch_to or s.queued}
        first = [g for g in names if g in busy]
        rest = [g for g in names if g not in busy]
        chosen = (first + rest)[: self.config.max_groups]
        return chosen, len(names) - len(chosen)

    def group_json(
        self, view: GroupView, agents: dict[str, AgentRecord], acked: set[str]
    ) -> dict[str, Any]:
        """One group as the page (and ``timeslice status``) shows it."""
        now = self._clock()
        resident = view.residency().nodes
        nodes = sorted(
            set(resident)
            | set(view.static_members)
            | {n for n, a in agents.items() if any(w.group == view.group for w in a.workers)}
        )
        holder = view.holder.record if view.holder is not None else None
        serving = [agents[n] for n in nodes if n in agents]
        duty = self._tracker.duty(view.group, now)
        parked = (
            {n: list(jobs) for n, jobs in view.resident.record.parked.items()}
            if view.resident is not None
            else {}
        )
        self.story.parked(view.group, parked)
        out: dict[str, Any] = {
            "name": view.group,
            "color": group_color(view.group),
            # Every backend serving the group; emulated: some node only models data movement,
            # so the group's switch times are modelled, and the page says so beside them.
            "backends": sorted({a.backend for a in serving}),
            "emulated": any(a.emulated for a in serving),
            "holder": holder.job if holder else None,
            "epoch": hold_epoch(view.holder) if view.holder is not None else 0,
            "held_since": holder.granted_at if holder else 0.0,
            "queue": [q.job for q in view.queue[: self.config.max_queue]],
            "queue_length": len(view.queue),
            "nodes": [
                {"node": n, "jobs": list(resident.get(n, [])), "connected": n in agents}
                for n in nodes
            ],
            "switch": None,
            "switches": view.stats.switches,
            "grants": view.stats.grants,
            "rollbacks": view.stats.rollbacks,
            "faults": view.stats.faults,
            "last_switch_seconds": round(view.stats.last_switch_seconds, 4),
            "last_error": view.stats.last_error,
            "faulted": sorted(view.faults),
            "driver": view.driver or "",
            "duty": round(duty.ratio, 4),
            "duty_over": round(duty.seconds, 1),
            "timeline": self.story.timeline_json(
                view.group, self._wall() - self.config.history_seconds
            ),
        }
        if view.switch is not None:
            out["switch"] = _switch_json(view, acked)
        return out

    def snapshot(self, only: str | None = None) -> dict[str, Any]:
        """Everything a page starts from."""
        chosen, omitted = self._chosen(only)
        agents = self._mirror.agents()
        acked = self._acked() if chosen else set()
        return {
            "replica": self._replica,
            "revision": self._mirror.revision,
            "now": self._wall(),
            "window": self._tracker.window,
            "span": self.config.history_seconds,  # how far back the chart and timelines go
            "groups": self._groups_json(chosen, agents, acked),
            "nodes": self._nodes_json(agents),
            "omitted": omitted,
            "recent": [s.to_json() for s in self.recent],
            "history": self._history_json(),
            "pools": self.pools.json() if self.pools is not None else None,
        }

    def _groups_json(
        self, names: Iterable[str], agents: dict[str, AgentRecord], acked: set[str]
    ) -> list[dict[str, Any]]:
        """The groups as the page shows them; one with a record that does not decode is left
        out (and logged), not the whole page."""
        out = []
        for name in names:
            try:
                out.append(self.group_json(self._mirror.group(name), agents, acked))
            except CorruptRecord as exc:
                self._unreadable(name, exc)
        return out

    def _unreadable(self, group: str, exc: CorruptRecord) -> None:
        # Once per group and cause: the page and every change of the group come back here.
        cause = (group, str(exc))
        if cause not in self._unreadable_seen and len(self._unreadable_seen) < 256:
            self._unreadable_seen.add(cause)
            log.error("dashboard: group %s has a record that does not decode: %s", group, exc)

    def _history_json(self) -> list[dict[str, Any]]:
        # Plus a point for now, so a page opened between two samples draws up to now.
        points = [*self.history, self._point()]
        return [_point_json(t, duty) for t, duty in points]

    def _nodes_json(self, agents: dict[str, AgentRecord]) -> list[dict[str, Any]]:
        hosts = self.hosts
        if hosts is None:
            return self.story.nodes_json(agents)
        return self.story.nodes_json(agents, hosts.host_report, self._replica)

    def _acked(self) -> set[str]:
        """Directive ids answered in the relay (directives to another replica's agents)."""
        return {post.directive_id for post in self._mirror.relays() if post.posted.record.ack}

    def _update(self, stream: _Stream) -> bytes:
        """The events a stream owes, built from the state now; clears what it owed."""
        chunks: list[bytes] = []
        if stream.resync:
            stream.resync = stream.recent = stream.pools = False
            stream.dirty.clear()
            chunks.append(_event("snapshot", self.snapshot(stream.only)))
            stream.nodes_sent = self.story.parked_version
        if stream.dirty:
            names, stream.dirty = sorted(stream.dirty), set()
            agents = self._mirror.agents()
            acked = self._acked()
            present = [name for name in names if self._mirror.has_group(name)]
            changed = self._groups_json(present, agents, acked)
            removed = [name for name in names if name not in present]
            update = {
                "now": self._wall(),
                "revision": self._mirror.revision,
                "groups": changed,
                "removed": removed,
            }
            if stream.nodes_sent != self.story.parked_version:  # parked jobs changed
                update["nodes"] = self._nodes_json(agents)
                stream.nodes_sent = self.story.parked_version
            chunks.append(_event("groups", update))
        if stream.recent:
            stream.recent = False
            chunks.append(_event("recent", {"recent": [s.to_json() for s in self.recent]}))
        if stream.pools and self.pools is not None:
            stream.pools = False
            chunks.append(_event("pools", self.pools.json()))
        if stream.duty:
            stream.duty = False
            t, duty = self.history[-1]
            chunks.append(_event("duty", {"now": self._wall(), "point": _point_json(t, duty)}))
            # Host memory figures change with every heartbeat: sent at most once a sample.
            hosts = self.hosts
            if hosts is not None and stream.hosts_sent != hosts.host_version:
                stream.hosts_sent = hosts.host_version
                nodes = self._nodes_json(self._mirror.agents())
                chunks.append(_event("nodes", {"now": self._wall(), "nodes": nodes}))
        return b"".join(chunks)

    # -- HTTP -----------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        """``/`` (the page), ``/events`` (the stream), ``/state`` (one snapshot, JSON)."""
        return [
            web.get("/", self.page),
            web.get("/events", self.events),
            web.get("/state", self.state),
        ]

    @staticmethod
    def _query(request: web.Request) -> dict[str, str]:
        try:
            return parse_query(request.query_string)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"bad query string: {exc}\n") from None

    async def page(self, request: web.Request) -> web.Response:
        """The page: a constant, whatever the query (the script reads ``?group=``)."""
        try:
            self._query(request)
        except web.HTTPBadRequest:
            self.refused.labels(reason="bad_query").inc()
            raise
        return web.Response(body=PAGE, headers=_PAGE_HEADERS)

    async def state(self, request: web.Request) -> web.Response:
        """One snapshot as JSON (for scripts, and what the page starts from)."""
        try:
            query = self._query(request)
        except web.HTTPBadRequest:
            self.refused.labels(reason="bad_query").inc()
            raise
        if self.pools is not None:
            await self.pools.fresh()  # bounded by its deadline
        body = json.dumps(self.snapshot(query.get("group")), separators=(",", ":"))
        return web.Response(
            text=body,
            content_type="application/json",
            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
        )

    async def events(self, request: web.Request) -> web.StreamResponse:
        """The live stream: a snapshot, then coalesced changes until the browser goes."""
        try:
            query = self._query(request)
        except web.HTTPBadRequest:
            self.refused.labels(reason="bad_query").inc()
            raise
        if len(self._streams) >= self.config.max_streams:
            self.refused.labels(reason="too_many_streams").inc()
            raise web.HTTPServiceUnavailable(
                text=f"too many dashboard streams (at most {self.config.max_streams})\n",
                headers={"Retry-After": "10"},
            )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Content-Type-Options": "nosniff",
                "X-Accel-Buffering": "no",  # a proxy in front must not hold events back
            }
        )
        stream = _Stream(only=query.get("group"))
        self._streams.add(stream)
        self.streams_gauge.set(len(self._streams))
        self._page_open.set()
        try:
            await response.prepare(request)
            await self._pump(request, response, stream)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the browser went, or the server is closing: nothing more to say
        finally:
            stream.closed = True
            self._streams.discard(stream)
            self.streams_gauge.set(len(self._streams))
            if not self._streams:
                self._page_open.clear()
        return response

    async def _pump(
        self, request: web.Request, response: web.StreamResponse, stream: _Stream
    ) -> None:
        cfg = self.config
        # retry: how long a browser waits before it reconnects after the stream ends.
        payload = b"retry: 2000\n" + _event("snapshot", self.snapshot(stream.only))
        stream.nodes_sent = self.story.parked_version
        while not stream.closed:
            try:
                async with asyncio.timeout(cfg.stuck_seconds):
                    await response.write(payload)
            except TimeoutError:
                # The browser has stopped reading: what it has not read stays in the socket
                # buffers; drop it rather than let more pile up behind it.
                self.dropped.inc()
                log.info(
                    "dashboard: dropping an event stream to %s (a write took over %g s)",
                    request.remote,
                    cfg.stuck_seconds,
                )
                if request.transport is not None:
                    request.transport.abort()
                return
            await asyncio.sleep(cfg.min_interval)  # changes meanwhile coalesce
            try:
                async with asyncio.timeout(cfg.ping_seconds):
                    await stream.wake.wait()
            except TimeoutError:
                payload = b": ping\n\n"
                continue
            stream.wake.clear()
            if stream.closed:
                return
            payload = self._update(stream)


def _switch_json(view: GroupView, acked: Iterable[str]) -> dict[str, Any]:
    """The switch in flight: its phase and, per node, how far it got as etcd shows it.

    A phase moves on only when every node of it answered, so nodes of earlier phases are
    done; within the phase in progress a node is known done when its answer is in the relay
    (an agent connected to another replica). An agent connected to the driving replica
    answers on its stream, which etcd never sees: such a node shows done when the phase ends.
    """
    assert view.switch is not None
    record = view.switch.record
    acked = set(acked)
    phase = record.phase.value
    fenced = set(record.fenced)
    purpose = {"checkpoint": "evict", "restore": "restore", "rollback": "rollback"}[phase]
    nodes = []
    for step in record.steps:
        job = step.evict if purpose in ("evict", "rollback") else step.restore
        if step.node in fenced:
            state = "fenced"
        elif not job:
            state = "done"  # nothing to do in this phase
        elif f"{record.switch_id}-{purpose}-{step.node}-{job}" in acked:
            state = "done"
        else:
            state = "working"
        nodes.append(
            {"node": step.node, "evict": step.evict, "restore": step.restore, "state": state}
        )
    return {
        "id": record.switch_id,
        "epoch": view.switch.create_revision,
        "phase": phase,
        "from": record.from_jobs,
        "to": record.to_job,
        "started_at": record.started_at,
        "attempt": record.attempt,
        "prefetch": record.prefetch,
        "kind": record.kind.value,
        "nodes": nodes,
        "done": sum(1 for n in nodes if n["state"] != "working"),
        "total": len(nodes),
    }


def _point_json(t: float, duty: dict[str, float]) -> dict[str, Any]:
    # With each name's colour: a chart line keeps its group's colour, shown in the table or not.
    return {"t": t, "duty": duty, "colors": {g: group_color(g) for g in duty}}


def _event(name: str, data: dict[str, Any]) -> bytes:
    # JSON never holds a raw newline, so one data: line carries it.
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
