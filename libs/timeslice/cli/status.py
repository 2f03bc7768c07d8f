"""``timeslice groups`` and ``timeslice status``: what the orchestrator knows about groups.

``status`` turns the wire message into a :class:`StatusView` first (ages computed, the queue in
order, phases named), so the text and the JSON forms show the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from timeslice.cli.base import (
    Commands,
    add_json_option,
    add_operator_option,
    add_target_option,
    call,
    out,
    parse_targets,
    print_json,
)
from timeslice.cli.place import show_pool
from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_id
from timeslice.targets import Target
from timeslice_proto.timeslice.v1 import (
    GetGroupStatusRequest,
    GroupStatus,
    GroupSummary,
    ListGroupsRequest,
    SwitchPhase,
    TimeSliceStub,
)

__all__ = [
    "NodeBackendView",
    "QueueView",
    "StatusView",
    "SwitchView",
    "backend_label",
    "format_group_line",
    "format_status",
    "get_status",
    "list_groups",
    "register",
    "status_view",
]


def register(commands: Commands) -> None:
    """Add ``groups`` and ``status``."""
    groups = commands.add(
        "groups",
        cmd_groups,
        help="list groups, one line each",
        description="List every group the orchestrator knows: its holder, how many jobs wait "
        "and whether a switch is in flight. Opens no session.",
        epilog="examples:\n"
        "  timeslice groups --target 10.0.0.5:50051\n"
        "  timeslice groups --json | jq -r '.[] | select(.queue_length > 0) | .group_id'",
    )
    add_target_option(groups)
    add_json_option(groups)

    status = commands.add(
        "status",
        cmd_status,
        help="a group's status (all groups without GROUP), or a placement pool's (--pool)",
        description="One group's holder, queue, nodes (with each node's backend; emulated "
        "ones labelled), the switch in flight, faults and its driver replica. Without GROUP, "
        "as 'timeslice groups'. Exits 3 if the group does not exist. With --pool POOL "
        "instead of GROUP: the pool's placement decisions, as 'timeslice place POOL --show' "
        "prints them (each role's group, decision, reason and whether it is provisional or "
        "measured; each group's expected and measured duty); exits 3 if the pool does not "
        "exist.",
        epilog="examples:\n"
        "  timeslice status trainer-group\n"
        "  timeslice status trainer-group --json | jq .holder_job_id\n"
        "  timeslice status --pool h100-pool\n"
        "  timeslice status --pool h100-pool --json | jq '.assignments[] | .reason'",
    )
    status.add_argument("group", nargs="?", metavar="GROUP")
    status.add_argument("--pool", metavar="POOL", help="a placement pool's decisions instead")
    add_target_option(status)
    add_operator_option(status)
    add_json_option(status)


@dataclass(frozen=True)
class QueueView:
    """One waiting job."""

    job_id: str
    priority: int
    enqueued_at: float
    waiting_seconds: float | None


@dataclass(frozen=True)
class SwitchView:
    """The context switch in flight."""

    switch_id: str
    epoch: int
    from_job_id: str
    to_job_id: str
    phase: str
    started_at: float
    elapsed_seconds: float | None


@dataclass(frozen=True)
class NodeBackendView:
    """The backend a node's agent registered with."""

    backend: str
    """``sim``, ``freeze``, ``app``, ``cuda``; empty while no agent is connected."""
    emulated: bool
    """The backend only models data movement: its switch times are not measurements."""


@dataclass(frozen=True)
class StatusView:
    """What ``timeslice status GROUP`` shows, decoupled from the wire message."""

    group_id: str
    holder_job_id: str
    holder_epoch: int
    held_since: float
    held_for_seconds: float | None
    queue: list[QueueView]
    nodes: dict[str, str]
    switch: SwitchView | None
    faulted: dict[str, str]
    last_error: str
    switches: int
    driver_replica: str
    # Pinned nodes with no agent connected: the group cannot switch until they are back.
    missing_members: list[str] = field(default_factory=list)
    # Node -> its backend (a separate map, so that ``nodes`` keeps its JSON shape).
    node_backends: dict[str, NodeBackendView] = field(default_factory=dict)


def _since(t: float, now: float) -> float | None:
    return max(0.0, now - t) if t > 0 else None


def _phase_name(phase: SwitchPhase | int) -> str:
    try:
        name = SwitchPhase(phase).name
    except ValueError:
        return str(int(phase))
    return name.removeprefix("SWITCH_PHASE_").lower()


def status_view(status: GroupStatus, now: float) -> StatusView:
    """What ``timeslice status`` shows of ``status``, ages taken at ``now``."""
    holding = bool(status.holder_job_id)
    switch = status.switch
    return StatusView(
        group_id=status.group_id,
        holder_job_id=status.holder_job_id,
        holder_epoch=status.holder_epoch,
        held_since=status.held_since,
        held_for_seconds=_since(status.held_since, now) if holding else None,
        queue=[
            QueueView(q.job_id, q.priority, q.enqueued_at, _since(q.enqueued_at, now))
            for q in sorted(status.queue, key=lambda q: q.revision)
        ],
        nodes={n.node: n.resident_job_id for n in status.nodes},
        switch=None
        if switch is None
        else SwitchView(
            switch_id=switch.switch_id,
            epoch=switch.epoch,
            from_job_id=switch.from_job_id,
            to_job_id=switch.to_job_id,
            phase=_phase_name(switch.phase),
            started_at=switch.started_at,
            elapsed_seconds=_since(switch.started_at, now),
        ),
        faulted={f.job_id: f.reason for f in status.faulted},
        last_error=status.last_error,
        switches=status.switches,
        driver_replica=status.driver_replica,
        missing_members=list(status.missing_members),
        node_backends={n.node: NodeBackendView(n.backend, n.emulated) for n in status.nodes},
    )


def backend_label(backend: str, emulated: bool) -> str:
    """How every view names a node's backend: ``cuda``, ``sim, emulated``; ``no agent`` when
    no agent is connected for the node (so no backend is known)."""
    if not backend:
        return "no agent"
    return f"{backend}, emulated" if emulated else backend


def _secs(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} s"


def format_status(view: StatusView) -> str:
    """The human-readable form of one group's status."""
    lines = [f"group {view.group_id}"]
    if view.holder_job_id:
        lines.append(
            f"  holder:     {view.holder_job_id} (epoch {view.holder_epoch}, "
            f"held for {_secs(view.held_for_seconds)})"
        )
    else:
        lines.append("  holder:     none")
    if view.queue:
        lines.append("  queue:")
        for position, q in enumerate(view.queue, start=1):
            lines.append(
                f"    {position}. {q.job_id} (priority {q.priority}, waiting "
                f"{_secs(q.waiting_seconds)})"
            )
    else:
        lines.append("  queue:      empty")
    if view.nodes:
        lines.append("  nodes:")
        for node, job in sorted(view.nodes.items()):
            known = view.node_backends.get(node)
            backend = "" if known is None else f"  [{backend_label(known.backend, known.emulated)}]"
            lines.append(f"    {node}: {job or '(nothing resident)'}{backend}")
    else:
        lines.append("  nodes:      none")
    if view.switch is not None:
        s = view.switch
        lines.append(
            f"  switch:     {s.from_job_id or '(none)'} -> {s.to_job_id}, phase {s.phase}, "
            f"{_secs(s.elapsed_seconds)} in (epoch {s.epoch}, id {s.switch_id})"
        )
    else:
        lines.append("  switch:     none in flight")
    if view.faulted:
        lines.append("  faulted:")
        for job, reason in sorted(view.faulted.items()):
            lines.append(f"    {job}: {reason}")
    else:
        lines.append("  faulted:    none")
    if view.missing_members:
        lines.append(
            f"  blocked:    pinned node(s) {', '.join(view.missing_members)} not connected"
        )
    lines.append(f"  last error: {view.last_error or 'none'}")
    lines.append(f"  switches:   {view.switches}")
    lines.append(f"  driver:     {view.driver_replica or 'none'}")
    return "\n".join(lines)


def format_group_line(g: GroupSummary) -> str:
    """One line of ``timeslice groups``."""
    return (
        f"{g.group_id}  holder={g.holder_job_id or '-'}  queue={g.queue_length}  "
        f"switching={'yes' if g.switching else 'no'}"
    )


def _summary_dict(g: GroupSummary) -> dict[str, object]:
    return {
        "group_id": g.group_id,
        "holder_job_id": g.holder_job_id,
        "queue_length": g.queue_length,
        "switching": g.switching,
    }


async def list_groups(targets: Sequence[Target]) -> list[GroupSummary]:
    """Every group's summary, sorted by group id."""

    async def rpc(stub: TimeSliceStub, timeout: float) -> list[GroupSummary]:
        return list((await stub.list_groups(ListGroupsRequest(), timeout=timeout)).groups)

    return sorted(await call(targets, "ListGroups", rpc), key=lambda g: g.group_id)


async def get_status(targets: Sequence[Target], group: str) -> GroupStatus:
    """One group's full status."""
    request = GetGroupStatusRequest(group_id=group)

    async def rpc(stub: TimeSliceStub, timeout: float) -> GroupStatus:
        return await stub.get_group_status(request, timeout=timeout)

    return await call(targets, f"GetGroupStatus({group})", rpc)


def cmd_groups(args: argparse.Namespace) -> int:
    """``timeslice groups``."""
    targets = parse_targets(args.target)
    groups = asyncio.run(list_groups(targets))
    if args.json:
        print_json([_summary_dict(g) for g in groups])
    elif not groups:
        print("(no groups)", file=sys.stderr, flush=True)
    else:
        for g in groups:
            out(format_group_line(g))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``timeslice status [GROUP]`` or ``timeslice status --pool POOL``."""
    if args.pool is not None:
        if args.group is not None:
            raise InvalidArgument("status takes a GROUP or --pool POOL, not both")
        return show_pool(args, validate_id(args.pool, "pool"))
    if args.group is None:
        return cmd_groups(args)
    group = validate_group_id(args.group)
    targets = parse_targets(args.target)
    status = asyncio.run(get_status(targets, group))
    view = status_view(status, time.time())
    if args.json:
        print_json(asdict(view))
    else:
        out(format_status(view))
    return 0
