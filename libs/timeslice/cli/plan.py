"""``timeslice plan``: propose which jobs should share which group, from recorded usage."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict

from timeslice.cli.base import (
    Commands,
    add_json_option,
    add_target_option,
    non_negative_float,
    out,
    parse_targets,
    positive_float,
)
from timeslice.cli.status import get_status, list_groups
from timeslice.plan import propose, render, workloads_from
from timeslice_proto.timeslice.v1 import GroupStatus

__all__ = ["cmd_plan", "register"]


def register(commands: Commands) -> None:
    """Add ``plan``."""
    plan = commands.add(
        "plan",
        cmd_plan,
        help="propose which jobs should share which group, from recorded usage",
        description="Read every group's usage ledger (how long each job held and waited) and "
        "propose which jobs could share one group without its load passing --cap, counting "
        "--switch-seconds per hand-over against a shared group.",
        epilog="examples:\n"
        "  timeslice plan --cap 0.8 --switch-seconds 2\n"
        "  timeslice plan --json | jq '.[] | .predicted_duty'",
    )
    add_target_option(plan)
    plan.add_argument(
        "--cap", type=positive_float, default=0.9, help="maximum load of a group (default 0.9)"
    )
    plan.add_argument(
        "--switch-seconds",
        type=non_negative_float,
        default=0.0,
        help="cost of one context switch, to count against shared groups",
    )
    add_json_option(plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """``timeslice plan``."""
    targets = parse_targets(args.target)

    async def statuses() -> list[GroupStatus]:
        return [await get_status(targets, g.group_id) for g in await list_groups(targets)]

    found = asyncio.run(statuses())
    workloads = workloads_from(found)
    proposals = propose(workloads, cap=args.cap, switch_seconds=args.switch_seconds)
    if args.json:
        out(
            json.dumps(
                [
                    {
                        "workloads": [asdict(w) for w in p.workloads],
                        "predicted_duty": p.predicted_duty,
                        "load": p.load,
                    }
                    for p in proposals
                ],
                indent=2,
            )
        )
    elif not workloads:
        print("(no usage recorded yet)", file=sys.stderr, flush=True)
    else:
        out(render(proposals, len({w.group for w in workloads})))
    return 0
