"""``timeslice acquire``: hold a group as a job, then yield (for operators and tests).

Unlike the other commands this one is a job: it uses the SDK client, which owns the session
and its keepalive. Signals: SIGINT/SIGTERM while waiting cancels the acquire (the queue entry
goes); while holding, it yields and exits 0; while yielding, it is ignored so that the yield
completes.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import signal
import sys
import threading
from types import FrameType

from timeslice._acquire import GRANT_WARNING
from timeslice._roles import DEFAULT_ROLE
from timeslice.cli.base import (
    Commands,
    Interrupted,
    add_json_option,
    add_target_option,
    job_of,
    non_negative_float,
    out,
    parse_targets,
    positive_float,
)
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.errors import Cancelled, InvalidArgument
from timeslice.ids import validate_group_id, validate_id

__all__ = ["cmd_acquire", "register"]


def register(commands: Commands) -> None:
    """Add ``acquire``."""
    acquire = commands.add(
        "acquire",
        cmd_acquire,
        help="acquire a group as a job, hold it, then yield (for operators and tests)",
        description="Acquire GROUP as job J (waiting in its queue), print the grant, hold it "
        "for --hold seconds or until SIGINT/SIGTERM, then yield. Exits 5 if --timeout passes "
        "first (the queue entry is removed), 6 if no orchestrator can be reached. With --json "
        "each event is one JSON object per line. A group that is not known (no node serves "
        "it, no operator created it: a mistyped name?) is refused (exit 3), unless "
        "--allow-unknown grants it with a warning on stderr (the SDK's default). J defaults "
        "to $TIMESLICE_JOB_ID. With --pool POOL --role R instead of GROUP, "
        "the group is the one the orchestrator places the job's role on (as "
        "on_accelerators(pool=, role=) does; docs/placement.md), printed on stderr (with "
        "--json: the events' group_id, pool and role).",
        epilog="examples:\n"
        "  timeslice acquire trainer-group --job job-a --hold 30\n"
        "  timeslice acquire trainer-group --job job-a --timeout 60 --hold 0 --json\n"
        "  timeslice acquire --pool h100-pool --role sampler --job job-a --hold 10",
    )
    acquire.add_argument("group", nargs="?", metavar="GROUP")
    acquire.add_argument("--job", metavar="J", help="the job (default: $TIMESLICE_JOB_ID)")
    acquire.add_argument(
        "--pool", metavar="POOL", help="acquire the group of a role in this placement pool"
    )
    acquire.add_argument(
        "--role", metavar="R", help=f"with --pool: the job's role (default {DEFAULT_ROLE})"
    )
    add_target_option(acquire)
    acquire.add_argument("--timeout", type=positive_float, metavar="S", help="give up after S s")
    acquire.add_argument(
        "--hold",
        type=non_negative_float,
        metavar="SECONDS",
        help="hold for this long (default: until SIGINT/SIGTERM)",
    )
    # At a shell a typo is the likely reason for an unknown group: refused unless asked for
    # (docs/groups.md). A group placement chose came from an operator's pool: never refused.
    acquire.add_argument(
        "--allow-unknown",
        action="store_true",
        help="grant a group that is not known (creating it, with a warning) instead of refusing it",
    )
    add_json_option(acquire)


class _SignalMode(enum.Enum):
    """Where ``timeslice acquire`` is, which decides what a signal does."""

    WAITING = "waiting"
    HOLDING = "holding"
    FINISHING = "finishing"


def cmd_acquire(args: argparse.Namespace) -> int:
    """``timeslice acquire GROUP --job J`` or ``timeslice acquire --pool P --role R --job J``."""
    job = job_of(args)
    place = _placement(args)
    group = "" if place is not None else validate_group_id(args.group)
    targets = [str(t) for t in parse_targets(args.target)]

    stop = threading.Event()
    stage = _SignalMode.WAITING

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stage is _SignalMode.WAITING:
            # Unwinds the blocking acquire; the SDK's cancel path removes our queue entry.
            raise Interrupted
        if stage is _SignalMode.HOLDING:
            stop.set()
        # FINISHING: the yield is under way; a second Ctrl-C must not cut it short.

    strict = place is None and not args.allow_unknown
    client = TimeSliceOrchestratorClient(targets, job_id=job, strict_groups=strict)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # The grant's warning is printed below, once, in this command's words.
    sdk_log = logging.getLogger("timeslice")
    sdk_log.addFilter(_not_grant_warning)
    try:
        try:
            if place is not None:
                group = client.group_for(*place)
                if not args.json:
                    print(
                        f"placed: {job}/{place[1]} in pool {place[0]} -> group {group}",
                        file=sys.stderr,
                        flush=True,
                    )
            grant = client.acquire(group, timeout=args.timeout)
        except Interrupted:
            raise Cancelled(f"interrupted while waiting for {group or 'a placement'}") from None
        stage = _SignalMode.HOLDING
        if grant.warning:
            print(f"warning: {grant.warning}", file=sys.stderr, flush=True)
        # The pool and role the group was resolved from, in every event.
        placed = {} if place is None else {"pool": place[0], "role": place[1]}
        if args.json:
            warning = {"warning": grant.warning} if grant.warning else {}
            _event(
                "granted",
                group,
                job,
                epoch=grant.epoch,
                waited_seconds=grant.waited_seconds,
                **placed,
                **warning,
            )
        else:
            out(f"granted epoch={grant.epoch} waited={grant.waited_seconds:.3f}")
        stop.wait(timeout=args.hold)
        stage = _SignalMode.FINISHING
        client.yield_(group)
        if args.json:
            _event("yielded", group, job, **placed)
        else:
            out("yielded")
    finally:
        stage = _SignalMode.FINISHING
        sdk_log.removeFilter(_not_grant_warning)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Ends the session: if we were interrupted between the grant and the yield, this is
        # what releases the hold.
        client.close()
    return 0


def _placement(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(pool, role)`` for ``--pool``/``--role``; None for a GROUP. Exactly one of the two.

    Raises:
        InvalidArgument: both, neither, or ``--role`` without ``--pool``.
    """
    if args.pool is None:
        if args.role is not None:
            raise InvalidArgument("--role needs --pool")
        if args.group is None:
            raise InvalidArgument("acquire needs a GROUP, or --pool POOL [--role R]")
        return None
    if args.group is not None:
        raise InvalidArgument("acquire takes a GROUP or --pool POOL, not both")
    return validate_id(args.pool, "pool"), validate_id(args.role or DEFAULT_ROLE, "role")


def _not_grant_warning(record: logging.LogRecord) -> bool:
    """Leave out the SDK's log record of a grant's warning (the command prints it)."""
    return not getattr(record, GRANT_WARNING, False)


def _event(event: str, group: str, job: str, **fields: object) -> None:
    """One ``--json`` line: a compact object per event, so a script can read them as they
    come (JSON Lines)."""
    out(json.dumps({"event": event, "group_id": group, "job_id": job, **fields}))
