"""Placement pools from the command line: ``timeslice place`` and ``timeslice pool``.

::

    timeslice place POOL --job J --role R [--role R2 ...] [--profile R:BUSY:PERIOD[:async]]
    timeslice place POOL --show
    timeslice pool create POOL --groups G1,G2,... [--cap C] [--claim G=CLAIM ...]
    timeslice pool show POOL
    timeslice pool pin POOL --job J [--role R] --group G      (unpin: no --group)
    timeslice pool unpin POOL --job J [--role R]
    timeslice pool exclude POOL --job A --other B             (include: undo)
    timeslice pool include POOL --job A --other B
    timeslice pool drain POOL --group G                        (undrain: undo)
    timeslice pool undrain POOL --group G
    timeslice pool claim POOL --group G --claim CLAIM          (unclaim: no --claim)
    timeslice pool unclaim POOL --group G

``place`` is what a launcher calls before it starts a job's processes: each role's group,
the group's pinned nodes, its claim (the Kubernetes ResourceClaim the group's pods name, when
the pool records one) and the reason (docs/placement.md). The ``pool`` commands other than
``show`` need the operator token or an operator certificate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
from collections.abc import Sequence

from timeslice.cli.base import (
    Commands,
    add_json_option,
    add_operator_option,
    add_target_option,
    call,
    operator_metadata,
    out,
    parse_targets,
    print_json,
)
from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_id, validate_job_id
from timeslice.targets import Target
from timeslice_proto.timeslice.placement.v1 import (
    CreatePoolRequest,
    GetPoolRequest,
    GroupClaim,
    Mode,
    PlacementStub,
    PlaceRequest,
    PlaceResponse,
    Pool,
    RoleProfile,
    RuleKind,
    UpdatePoolRequest,
)
from timeslice_proto.timeslice.v1 import TimeSliceStub

__all__ = [
    "cmd_place",
    "cmd_pool",
    "env_lines",
    "get_pool",
    "parse_claims",
    "parse_profile",
    "pool_view",
    "register",
    "show_pool",
]

_RULES = {
    "pin": RuleKind.PIN,
    "unpin": RuleKind.UNPIN,
    "exclude": RuleKind.EXCLUDE,
    "include": RuleKind.INCLUDE,
    "drain": RuleKind.DRAIN,
    "undrain": RuleKind.UNDRAIN,
    "claim": RuleKind.CLAIM,
    "unclaim": RuleKind.UNCLAIM,
}


def register(commands: Commands) -> None:
    """Add ``place`` and ``pool``."""
    place = commands.add(
        "place",
        cmd_place,
        help="place a job's roles on the groups of a placement pool (launchers)",
        description="Ask the orchestrator which group of POOL each role of job J uses: its "
        "recorded group while the job runs, else a placement made now from the roles' "
        "measured (or declared, --profile) phases. Prints each role's group, the group's "
        "pinned nodes, its claim (the ResourceClaim its pods name, if the pool has one) and "
        "the reason. --show prints the pool instead: its groups, rules, "
        "assignments, audit trail and each group's expected and measured duty.",
        epilog="examples:\n"
        "  timeslice place h100-pool --job grpo-7 --role sampler --role trainer --json\n"
        "  timeslice place h100-pool --job grpo-7 --role sampler --profile sampler:0.3:20\n"
        "  timeslice place h100-pool --show\n"
        "  export $(timeslice place h100-pool --job grpo-7 --role trainer --env)",
    )
    place.add_argument("pool", metavar="POOL")
    place.add_argument("--job", metavar="J")
    place.add_argument("--role", action="append", default=[], metavar="R")
    place.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="R:BUSY:PERIOD[:async]",
        help="a role's declared profile: busy fraction and period in seconds (until measured)",
    )
    place.add_argument("--show", action="store_true", help="print the pool instead")
    place.add_argument(
        "--env",
        action="store_true",
        help="print TIMESLICE_GROUP=<group> (one role) or TIMESLICE_GROUP_<ROLE>=<group> lines "
        "for a launcher's environment (the agent finds job processes by TIMESLICE_GROUP), "
        "and TIMESLICE_CLAIM[_<ROLE>]=<claim> for a group with a claim",
    )
    add_target_option(place)
    add_operator_option(place)
    add_json_option(place)

    pool = commands.add(
        "pool",
        cmd_pool,
        help="declare a placement pool, show it, or change its rules (operators)",
        description="Operators declare a pool's groups and load cap (create), pin a job's "
        "role to a group, exclude a pair of jobs from sharing a group, drain a group (no new "
        "placements; what runs there stays), set a group's claim (the Kubernetes "
        "ResourceClaim its pods name, which place answers), or undo these. Every change is in "
        "the pool's audit trail (show).",
        epilog="examples:\n"
        "  timeslice pool create h100-pool --groups g1,g2,g3 --cap 0.9\n"
        "  timeslice pool create h100-pool --groups g1,g2 --claim g1=gpus-a --claim g2=gpus-b\n"
        "  timeslice pool claim h100-pool --group g3 --claim gpus-c\n"
        "  timeslice pool pin h100-pool --job grpo-7 --role trainer --group g2\n"
        "  timeslice pool exclude h100-pool --job grpo-7 --other grpo-9\n"
        "  timeslice pool drain h100-pool --group g3\n"
        "  timeslice pool show h100-pool --json",
    )
    pool.add_argument("action", choices=["create", "show", *_RULES], metavar="ACTION")
    pool.add_argument("pool", metavar="POOL")
    pool.add_argument("--groups", metavar="G1,G2", help="create: the pool's groups, in order")
    pool.add_argument("--cap", type=float, default=0.0, help="create: load cap (default 0.9)")
    pool.add_argument("--job", metavar="J")
    pool.add_argument("--role", default="main", metavar="R")
    pool.add_argument("--group", metavar="G")
    pool.add_argument("--other", metavar="J2", help="exclude/include: the other job")
    pool.add_argument(
        "--claim",
        action="append",
        default=[],
        metavar="G=CLAIM",
        help="create: a group's Kubernetes ResourceClaim (repeat per group); "
        "claim: the claim of --group",
    )
    add_target_option(pool)
    add_operator_option(pool)
    add_json_option(pool)


def parse_profile(text: str) -> RoleProfile:
    """``ROLE:BUSY:PERIOD[:async]`` -> a declared profile (checked by the orchestrator)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ("sync", "async")):
        raise InvalidArgument(f"--profile {text!r}: expected ROLE:BUSY:PERIOD[:sync|async]")
    try:
        busy, period = float(parts[1]), float(parts[2])
    except ValueError:
        raise InvalidArgument(f"--profile {text!r}: BUSY and PERIOD are numbers") from None
    mode = Mode.ASYNC if len(parts) == 4 and parts[3] == "async" else Mode.SYNC
    role = validate_id(parts[0], "role")
    return RoleProfile(role=role, busy=busy, period_seconds=period, cv=0.5, mode=mode)


def parse_claims(texts: Sequence[str]) -> list[GroupClaim]:
    """``G=CLAIM`` each -> the groups' claims (the orchestrator checks the names)."""
    claims = []
    for text in texts:
        group, sep, claim = text.partition("=")
        if not sep or not claim:
            raise InvalidArgument(f"--claim {text!r}: expected GROUP=CLAIM")
        claims.append(GroupClaim(group_id=validate_group_id(group.strip()), claim=claim.strip()))
    return claims


def cmd_place(args: argparse.Namespace) -> int:
    """``timeslice place POOL --job J --role R ...`` or ``--show``."""
    pool = validate_id(args.pool, "pool")
    if args.show:
        return show_pool(args, pool)
    if not args.job or not args.role:
        raise InvalidArgument("place needs --job and at least one --role (or --show)")
    job = validate_job_id(args.job)
    roles = [validate_id(r, "role") for r in args.role]
    profiles = [parse_profile(p) for p in args.profile]
    request = PlaceRequest(pool=pool, job_id=job, roles=roles, profiles=profiles)
    metadata = operator_metadata(args)

    async def rpc(stub: TimeSliceStub, timeout: float) -> PlaceResponse:
        return await PlacementStub(stub.channel).place(request, timeout=timeout, metadata=metadata)

    answer = asyncio.run(call(parse_targets(args.target), f"Place({pool})", rpc))
    if args.env:
        for line in env_lines(answer):
            out(line)
    elif args.json:
        print_json(answer.to_dict(include_default_values=True))
    else:
        for r in answer.roles:
            nodes = ",".join(r.nodes) or "-"
            claim = f"  claim {r.claim}" if r.claim else ""
            out(f"{job}/{r.role}: {r.group_id or '(none)'}  nodes {nodes}{claim}  {r.reason}")
    return 0 if answer.placed else 1


def env_lines(answer: PlaceResponse) -> list[str]:
    """``TIMESLICE_GROUP=g`` (and ``TIMESLICE_CLAIM=c`` when the group has a claim) for one
    placed role, else ``TIMESLICE_GROUP_<ROLE>=g`` (and ``TIMESLICE_CLAIM_<ROLE>=c``) each
    (the role upper-cased, other characters than letters and digits as ``_``)."""
    placed = [r for r in answer.roles if r.group_id]
    if len(answer.roles) == 1 and placed:
        (r,) = placed
        claim = [f"TIMESLICE_CLAIM={r.claim}"] if r.claim else []
        return [f"TIMESLICE_GROUP={r.group_id}", *claim]
    lines = []
    for r in placed:
        name = "".join(c if c.isalnum() else "_" for c in r.role.upper())
        lines.append(f"TIMESLICE_GROUP_{name}={r.group_id}")
        if r.claim:
            lines.append(f"TIMESLICE_CLAIM_{name}={r.claim}")
    return lines


async def get_pool(targets: Sequence[Target], pool: str, metadata: dict[str, str]) -> Pool:
    """``GetPool``: the pool as the caller may see it (NotFound: no such pool)."""

    async def rpc(stub: TimeSliceStub, timeout: float) -> Pool:
        request = GetPoolRequest(pool=pool)
        return await PlacementStub(stub.channel).get_pool(
            request, timeout=timeout, metadata=metadata
        )

    return await call(targets, f"GetPool({pool})", rpc)


def show_pool(args: argparse.Namespace, pool: str) -> int:
    """Print ``pool`` (:func:`pool_view`, or the wire message with ``--json``): what
    ``place --show``, ``pool show`` and ``status --pool`` print."""
    answer = asyncio.run(get_pool(parse_targets(args.target), pool, operator_metadata(args)))
    if args.json:
        print_json(answer.to_dict(include_default_values=True))
    else:
        for line in pool_view(answer):
            out(line)
    return 0


def pool_view(pool: Pool) -> list[str]:
    """The pool for people: groups with their expected and measured duty, rules, each
    assignment with its decision, whether it is provisional and its reason, the audit's tail.
    The one rendering of a pool (``place --show``, ``pool show``, ``status --pool``)."""
    lines = [f"pool {pool.pool}: cap {pool.cap:.0%}, groups {', '.join(pool.groups)}"]
    claims = {c.group_id: c.claim for c in pool.claims}
    for d in pool.duty:
        flag = "  (drained)" if d.drained else ""
        claim = f" (claim {claims[d.group_id]})" if d.group_id in claims else ""
        jobs = ", ".join(d.jobs) or "-"
        lines.append(
            f"  {d.group_id}{claim}: expected duty {d.expected:.0%}, "
            f"measured {d.measured:.0%}; {jobs}{flag}"
        )
    for p in pool.pins:
        lines.append(f"  pin {p.job_id}/{p.role} -> {p.group_id}")
    for e in pool.excluded:
        lines.append(f"  exclude {e.job_id} + {e.other_job_id}")
    lines.append("assignments:")
    for a in pool.assignments:
        kind = "provisional" if a.provisional else "measured"
        lines.append(
            f"  {a.job_id}/{a.role} -> {a.group_id} ({a.decision or '?'}; {kind}): {a.reason}"
        )
    lines.append("audit (latest last):")
    for entry in pool.audit[-20:]:
        when = datetime.datetime.fromtimestamp(entry.at, datetime.UTC).strftime("%H:%M:%S")
        who = f"{entry.job_id}/{entry.role}" if entry.job_id else ""
        lines.append(f"  {when} {entry.what} {who} {entry.group_id} {entry.reason}".rstrip())
    return lines


def cmd_pool(args: argparse.Namespace) -> int:
    """``timeslice pool ACTION POOL ...``."""
    pool = validate_id(args.pool, "pool")
    if args.action == "show":
        return show_pool(args, pool)
    metadata = operator_metadata(args)
    if args.action == "create":
        if not args.groups:
            raise InvalidArgument("pool create needs --groups G1,G2,...")
        groups = [validate_group_id(g.strip()) for g in args.groups.split(",") if g.strip()]
        if not 0 <= args.cap <= 1:
            raise InvalidArgument(f"--cap must be within (0, 1], got {args.cap}")
        create = CreatePoolRequest(
            pool=pool, groups=groups, cap=args.cap, claims=parse_claims(args.claim)
        )

        async def rpc(stub: TimeSliceStub, timeout: float) -> Pool:
            placement = PlacementStub(stub.channel)
            return await placement.create_pool(create, timeout=timeout, metadata=metadata)

    else:
        claim = ""
        if args.action == "claim":
            if len(args.claim) != 1 or "=" in args.claim[0]:
                raise InvalidArgument("pool claim needs --group G and one --claim CLAIM")
            claim = args.claim[0]
        elif args.claim:
            raise InvalidArgument(f"pool {args.action} takes no --claim")
        update = UpdatePoolRequest(
            pool=pool,
            kind=_RULES[args.action],
            job_id=args.job or "",
            role=args.role,
            group_id=args.group or "",
            other_job_id=args.other or "",
            claim=claim,
        )

        async def rpc(stub: TimeSliceStub, timeout: float) -> Pool:
            placement = PlacementStub(stub.channel)
            return await placement.update_pool(update, timeout=timeout, metadata=metadata)

    answer = asyncio.run(call(parse_targets(args.target), f"{args.action}({pool})", rpc))
    if args.json:
        print_json(answer.to_dict(include_default_values=True))
    else:
        for line in pool_view(answer):
            out(line)
    return 0
