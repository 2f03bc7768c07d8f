"""Operator commands that change a group: ``timeslice yield`` and ``timeslice members``."""

from __future__ import annotations

import argparse
import asyncio

from timeslice.cli.base import (
    Commands,
    add_json_option,
    add_operator_option,
    add_target_option,
    call,
    epoch,
    job_of,
    operator_metadata,
    out,
    parse_targets,
    print_json,
)
from timeslice.ids import validate_group_id, validate_node
from timeslice_proto.timeslice.v1 import (
    GroupStatus,
    SetGroupMembersRequest,
    TimeSliceStub,
    YieldRequest,
    YieldResponse,
)

__all__ = ["cmd_members", "cmd_yield", "register"]


def register(commands: Commands) -> None:
    """Add ``yield`` and ``members``."""
    yield_ = commands.add(
        "yield",
        cmd_yield,
        help="operator yield: release a job's hold by its epoch",
        description="Release the hold job J has on GROUP under epoch E (as 'timeslice status' "
        "shows it), without the job's session: for a job that hangs while holding. Needs the "
        "operator token or an operator certificate. Exits 4 if J does not hold GROUP under E "
        "(nothing changes), 7 if not an operator.",
        epilog="examples:\n"
        "  timeslice yield trainer-group --job job-a --epoch 42 --token-file /etc/ts/token\n"
        "  timeslice yield trainer-group --job job-a --epoch 42 --json",
    )
    yield_.add_argument("group", metavar="GROUP")
    yield_.add_argument("--job", metavar="J", help="the job (default: $TIMESLICE_JOB_ID)")
    yield_.add_argument("--epoch", required=True, type=epoch, metavar="E")
    add_target_option(yield_)
    add_operator_option(yield_)
    add_json_option(yield_)

    members = commands.add(
        "members",
        cmd_members,
        help="pin the nodes a group always spans (static membership), or unpin",
        description="Pin the nodes GROUP always spans (every switch checkpoints and restores "
        "on all of them, registered or not), or --clear to go back to the nodes whose agents "
        "registered workers of the group. Needs the operator token or an operator "
        "certificate; every pinned node's agent must be connected.",
        epilog="examples:\n"
        "  timeslice members trainer-group --set node-0,node-1\n"
        "  timeslice members trainer-group --clear --json",
    )
    members.add_argument("group", metavar="GROUP")
    pin = members.add_mutually_exclusive_group(required=True)
    pin.add_argument("--set", metavar="NODES", help="comma-separated node names")
    pin.add_argument("--clear", action="store_true", help="back to registrations only")
    add_target_option(members)
    add_operator_option(members)
    add_json_option(members)


def cmd_yield(args: argparse.Namespace) -> int:
    """``timeslice yield GROUP --job J --epoch E``."""
    group = validate_group_id(args.group)
    job = job_of(args)
    targets = parse_targets(args.target)
    # An empty session_id is the operator yield: by (job, epoch), with the operator token.
    request = YieldRequest(session_id="", job_id=job, group_id=group, epoch=args.epoch)
    metadata = operator_metadata(args)

    async def rpc(stub: TimeSliceStub, timeout: float) -> YieldResponse:
        return await stub.yield_(request, timeout=timeout, metadata=metadata)

    asyncio.run(call(targets, f"Yield({group})", rpc))
    if args.json:
        print_json({"group_id": group, "job_id": job, "epoch": args.epoch, "yielded": True})
    else:
        out("yielded")
    return 0


def cmd_members(args: argparse.Namespace) -> int:
    """``timeslice members GROUP --set NODES | --clear``."""
    group = validate_group_id(args.group)
    nodes = [] if args.clear else [n.strip() for n in args.set.split(",") if n.strip()]
    for node in nodes:
        validate_node(node)
    targets = parse_targets(args.target)
    request = SetGroupMembersRequest(group_id=group, nodes=nodes)
    metadata = operator_metadata(args)

    async def rpc(stub: TimeSliceStub, timeout: float) -> GroupStatus:
        return await stub.set_group_members(request, timeout=timeout, metadata=metadata)

    status = asyncio.run(call(targets, f"SetGroupMembers({group})", rpc))
    if args.json:
        print_json({"group_id": group, "static_members": list(status.static_members)})
        return 0
    pinned = ", ".join(status.static_members) or "(none: registrations only)"
    out(f"{group}: pinned nodes {pinned}")
    return 0
