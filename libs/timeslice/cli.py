"""The ``timeslice`` command line: a local cluster, the services, and operator commands.

::

    timeslice dev cluster [--replicas N] [--agents M] [--backend sim|freeze|app|cuda] ...
    timeslice orchestrator ARGS...        # exec python -m timeslice_orchestrator ARGS
    timeslice agent ARGS...               # exec python -m timeslice_agent ARGS
    timeslice groups [--target T] [--json]
    timeslice status [GROUP] [--target T] [--json]
    timeslice acquire GROUP --job J [--target T] [--timeout S] [--hold SECONDS]
    timeslice yield GROUP --job J --epoch E [--target T]

Errors go to stderr as ``error: <kind>: <message>``; the exit status is 2 for bad input and 1
for every other failure.

The read-only commands and the operator yield talk to the orchestrator directly over gRPC, so
they never open a session (an operator looking at a group must not appear in it); ``acquire``
uses the SDK client, which owns the session and its keep-alive.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn, TypeVar

from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError

from timeslice.errors import (
    Cancelled,
    ErrorKind,
    InvalidArgument,
    Timeout,
    TimeSliceError,
    Unavailable,
    error_from_status,
)
from timeslice.ids import validate_group_id, validate_job_id, validate_node
from timeslice.plan import propose, render, workloads_from
from timeslice_proto.timeslice.v1 import (
    GetGroupStatusRequest,
    GroupStatus,
    GroupSummary,
    ListGroupsRequest,
    SetGroupMembersRequest,
    SwitchPhase,
    TimeSliceStub,
    YieldRequest,
)

__all__ = ["main"]

TARGET_ENV = "TIMESLICE_TARGET"
DEFAULT_TARGET = "localhost:50051"
CALL_TIMEOUT = 10.0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
_SERVICES = {"orchestrator": "timeslice_orchestrator", "agent": "timeslice_agent"}

T = TypeVar("T")


# -- argument parsing ------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with our error format (``error: invalid_argument: ...``, exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        _fail(InvalidArgument(message))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    return parse


def _epoch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 < value < 2**64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid epoch (1 to 2**64-1)")
    return value


def _address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) into its parts, or InvalidArgument."""
    host, sep, port_text = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"{what} {text!r} is not HOST:PORT")
    return host, int(port_text)


def parse_targets(text: str | None) -> list[tuple[str, int]]:
    """Comma-separated orchestrator addresses; None means ``$TIMESLICE_TARGET`` or the default."""
    raw = text if text is not None else os.environ.get(TARGET_ENV) or DEFAULT_TARGET
    parts = [p for p in (s.strip() for s in raw.split(",")) if p]
    if not parts:
        raise InvalidArgument(f"target {raw!r} names no orchestrator address")
    return [_address(p, "target") for p in parts]


def parse_etcd(text: str) -> str:
    """``--etcd`` as the services take it: ``HOST:PORT[,HOST:PORT]`` (``http://`` accepted)."""
    endpoints: list[str] = []
    for part in (s.strip() for s in text.split(",")):
        if not part:
            continue
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                part = part[len(scheme) :]
        host, port = _address(part.rstrip("/"), "etcd endpoint")
        endpoints.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if not endpoints:
        raise InvalidArgument(f"etcd {text!r} names no endpoint")
    return ",".join(endpoints)


def build_parser() -> argparse.ArgumentParser:
    """The full ``timeslice`` argument parser (exposed for tests and docs)."""
    parser = _Parser(
        prog="timeslice",
        description="Co-operative accelerator time-slicing for RL post-training jobs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    target_help = (
        f"orchestrator address(es), comma-separated (default: ${TARGET_ENV} or {DEFAULT_TARGET})"
    )

    dev = sub.add_parser("dev", help="local development tools")
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="DEV_COMMAND", parser_class=_Parser)
    dev_sub.required = True
    cluster = dev_sub.add_parser(
        "cluster",
        help="run etcd, orchestrators and agents locally in the foreground",
        description="Run a local cluster until SIGINT/SIGTERM. Prints 'ready <targets>' once it "
        "serves.",
    )
    cluster.add_argument("--replicas", type=_count(1), default=1, help="orchestrator replicas")
    cluster.add_argument("--agents", type=_count(0), default=1, help="node agents")
    cluster.add_argument("--backend", choices=("sim", "freeze", "app", "cuda"), default="sim")
    cluster.add_argument("--etcd", help="use this etcd (HOST:PORT[,...]) instead of starting one")
    cluster.add_argument("--prefix", help="etcd key prefix (default /timeslice/dev-<random>)")
    cluster.add_argument("--session-ttl", type=_positive_float, default=10.0)
    cluster.add_argument(
        "--base-dir",
        type=Path,
        help="directory for logs, sockets and state (default: a temporary one, removed on exit)",
    )

    for name, module in _SERVICES.items():
        sub.add_parser(
            name,
            help=f"run {module} in the foreground (arguments are passed through)",
            add_help=False,
        )

    groups = sub.add_parser("groups", help="list groups, one line each")
    groups.add_argument("--target", help=target_help)
    groups.add_argument("--json", action="store_true", help="print JSON")

    status = sub.add_parser("status", help="a group's status (all groups without GROUP)")
    status.add_argument("group", nargs="?", metavar="GROUP")
    status.add_argument("--target", help=target_help)
    status.add_argument("--json", action="store_true", help="print JSON")

    acquire = sub.add_parser(
        "acquire", help="acquire a group as a job, hold it, then yield (for operators and tests)"
    )
    acquire.add_argument("group", metavar="GROUP")
    acquire.add_argument("--job", required=True, metavar="J")
    acquire.add_argument("--target", help=target_help)
    acquire.add_argument("--timeout", type=_positive_float, metavar="S", help="give up after S s")
    acquire.add_argument(
        "--hold",
        type=_non_negative_float,
        metavar="SECONDS",
        help="hold for this long (default: until SIGINT/SIGTERM)",
    )

    yield_ = sub.add_parser("yield", help="operator yield: release a job's hold by its epoch")
    yield_.add_argument("group", metavar="GROUP")
    yield_.add_argument("--job", required=True, metavar="J")
    yield_.add_argument("--epoch", required=True, type=_epoch, metavar="E")
    yield_.add_argument("--target", help=target_help)

    plan = sub.add_parser(
        "plan", help="propose which jobs should share which group, from recorded usage"
    )
    plan.add_argument("--target", help=target_help)
    plan.add_argument(
        "--cap", type=_positive_float, default=0.9, help="maximum load of a group (default 0.9)"
    )
    plan.add_argument(
        "--switch-seconds",
        type=_non_negative_float,
        default=0.0,
        help="cost of one context switch, to count against shared groups",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")

    members = sub.add_parser(
        "members", help="pin the nodes a group always spans (static membership), or unpin"
    )
    members.add_argument("group", metavar="GROUP")
    pin = members.add_mutually_exclusive_group(required=True)
    pin.add_argument("--set", metavar="NODES", help="comma-separated node names")
    pin.add_argument("--clear", action="store_true", help="back to registrations only")
    members.add_argument("--target", help=target_help)
    return parser


# -- errors and output -----------------------------------------------------------------------


def _fail(error: TimeSliceError) -> NoReturn:
    print(f"error: {error.kind.value}: {error.message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT if error.kind is ErrorKind.INVALID_ARGUMENT else EXIT_FAILURE)


def _out(line: str) -> None:
    print(line, flush=True)


# -- talking to the orchestrator -------------------------------------------------------------


async def _call_any(
    targets: Sequence[tuple[str, int]],
    call: Callable[[TimeSliceStub], Awaitable[T]],
    per_target_seconds: float = CALL_TIMEOUT,
) -> T:
    """Run ``call`` against the first replica that answers.

    A replica that cannot be reached (or says UNAVAILABLE) is skipped; any other answer,
    including a typed error, is authoritative. Each attempt has its own deadline.
    """
    problems: list[str] = []
    for host, port in targets:
        channel = Channel(host, port)
        try:
            async with asyncio.timeout(per_target_seconds):
                return await call(TimeSliceStub(channel))
        except GRPCError as exc:
            error = error_from_status(exc.status, exc.message)
            if not isinstance(error, Unavailable):
                raise error from None
            problems.append(f"{host}:{port}: {error.message}")
        except TimeoutError:
            problems.append(f"{host}:{port}: no answer within {per_target_seconds:g} s")
        except (OSError, StreamTerminatedError) as exc:
            problems.append(f"{host}:{port}: {exc}")
        finally:
            channel.close()
    if problems and all("no answer within" in p for p in problems):
        raise Timeout("no orchestrator answered: " + "; ".join(problems))
    raise Unavailable("no orchestrator reachable: " + "; ".join(problems))


@dataclass(frozen=True)
class _QueueView:
    job_id: str
    priority: int
    enqueued_at: float
    waiting_seconds: float | None


@dataclass(frozen=True)
class _SwitchView:
    switch_id: str
    epoch: int
    from_job_id: str
    to_job_id: str
    phase: str
    started_at: float
    elapsed_seconds: float | None


@dataclass(frozen=True)
class _StatusView:
    """What ``timeslice status GROUP`` shows, decoupled from the wire message."""

    group_id: str
    holder_job_id: str
    holder_epoch: int
    held_since: float
    held_for_seconds: float | None
    queue: list[_QueueView]
    nodes: dict[str, str]
    switch: _SwitchView | None
    faulted: dict[str, str]
    last_error: str
    switches: int
    driver_replica: str


def _since(t: float, now: float) -> float | None:
    return max(0.0, now - t) if t > 0 else None


def _phase_name(phase: SwitchPhase | int) -> str:
    try:
        name = SwitchPhase(phase).name
    except ValueError:
        return str(int(phase))
    return name.removeprefix("SWITCH_PHASE_").lower()


def status_view(status: GroupStatus, now: float) -> _StatusView:
    holding = bool(status.holder_job_id)
    switch = status.switch
    return _StatusView(
        group_id=status.group_id,
        holder_job_id=status.holder_job_id,
        holder_epoch=status.holder_epoch,
        held_since=status.held_since,
        held_for_seconds=_since(status.held_since, now) if holding else None,
        queue=[
            _QueueView(q.job_id, q.priority, q.enqueued_at, _since(q.enqueued_at, now))
            for q in sorted(status.queue, key=lambda q: q.revision)
        ],
        nodes={n.node: n.resident_job_id for n in status.nodes},
        switch=None
        if switch is None
        else _SwitchView(
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
    )


def _secs(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} s"


def format_status(view: _StatusView) -> str:
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
            lines.append(f"    {node}: {job or '(nothing resident)'}")
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
    lines.append(f"  last error: {view.last_error or 'none'}")
    lines.append(f"  switches:   {view.switches}")
    lines.append(f"  driver:     {view.driver_replica or 'none'}")
    return "\n".join(lines)


def format_group_line(g: GroupSummary) -> str:
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


async def _list_groups(targets: Sequence[tuple[str, int]]) -> list[GroupSummary]:
    response = await _call_any(
        targets, lambda stub: stub.list_groups(ListGroupsRequest(), timeout=CALL_TIMEOUT)
    )
    return sorted(response.groups, key=lambda g: g.group_id)


def _cmd_groups(args: argparse.Namespace) -> int:
    targets = parse_targets(args.target)
    groups = asyncio.run(_list_groups(targets))
    if args.json:
        _out(json.dumps([_summary_dict(g) for g in groups], indent=2))
    elif not groups:
        print("(no groups)", file=sys.stderr, flush=True)
    else:
        for g in groups:
            _out(format_group_line(g))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    if args.group is None:
        return _cmd_groups(args)
    group = validate_group_id(args.group)
    targets = parse_targets(args.target)
    status = asyncio.run(
        _call_any(
            targets,
            lambda stub: stub.get_group_status(
                GetGroupStatusRequest(group_id=group), timeout=CALL_TIMEOUT
            ),
        )
    )
    view = status_view(status, time.time())
    _out(json.dumps(asdict(view), indent=2) if args.json else format_status(view))
    return 0


def _cmd_yield(args: argparse.Namespace) -> int:
    group = validate_group_id(args.group)
    job = validate_job_id(args.job)
    targets = parse_targets(args.target)
    # An empty session_id is the operator yield: authorised by (job, epoch) alone.
    request = YieldRequest(session_id="", job_id=job, group_id=group, epoch=args.epoch)
    asyncio.run(_call_any(targets, lambda stub: stub.yield_(request, timeout=CALL_TIMEOUT)))
    _out("yielded")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    targets = parse_targets(args.target)

    async def status_of(group: str) -> GroupStatus:
        request = GetGroupStatusRequest(group_id=group)
        return await _call_any(
            targets, lambda stub: stub.get_group_status(request, timeout=CALL_TIMEOUT)
        )

    async def statuses() -> list[GroupStatus]:
        return [await status_of(g.group_id) for g in await _list_groups(targets)]

    found = asyncio.run(statuses())
    workloads = workloads_from(found)
    proposals = propose(workloads, cap=args.cap, switch_seconds=args.switch_seconds)
    if args.json:
        _out(
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
        _out(render(proposals, len({w.group for w in workloads})))
    return 0


def _cmd_members(args: argparse.Namespace) -> int:
    group = validate_group_id(args.group)
    nodes = [] if args.clear else [n.strip() for n in args.set.split(",") if n.strip()]
    for node in nodes:
        validate_node(node)
    targets = parse_targets(args.target)
    request = SetGroupMembersRequest(group_id=group, nodes=nodes)
    status = asyncio.run(
        _call_any(targets, lambda stub: stub.set_group_members(request, timeout=CALL_TIMEOUT))
    )
    pinned = ", ".join(status.static_members) or "(none: registrations only)"
    _out(f"{group}: pinned nodes {pinned}")
    return 0


class _Interrupted(BaseException):
    """SIGINT/SIGTERM arrived (a BaseException so that library code does not swallow it)."""


class _Stage(enum.Enum):
    """Where ``timeslice acquire`` is, which decides what a signal does."""

    WAITING = "waiting"
    HOLDING = "holding"
    FINISHING = "finishing"


def _cmd_acquire(args: argparse.Namespace) -> int:
    group = validate_group_id(args.group)
    job = validate_job_id(args.job)
    targets = [f"{h}:{p}" for h, p in parse_targets(args.target)]
    from timeslice import TimeSliceOrchestratorClient  # the SDK is only needed here

    stop = threading.Event()
    stage = _Stage.WAITING

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stage is _Stage.WAITING:
            # Unwinds the blocking acquire; the SDK's cancel path removes our queue entry.
            raise _Interrupted
        if stage is _Stage.HOLDING:
            stop.set()
        # FINISHING: the yield is under way; a second Ctrl-C must not cut it short.

    client = TimeSliceOrchestratorClient(targets, job_id=job)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            grant = client.acquire(group, timeout=args.timeout)
        except _Interrupted:
            raise Cancelled(f"interrupted while waiting for {group}") from None
        stage = _Stage.HOLDING
        _out(f"granted epoch={grant.epoch} waited={grant.waited_seconds:.3f}")
        stop.wait(timeout=args.hold)
        stage = _Stage.FINISHING
        client.yield_(group)
        _out("yielded")
    finally:
        stage = _Stage.FINISHING
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Ends the session: if we were interrupted between the grant and the yield, this is
        # what releases the hold.
        client.close()
    return 0


def _cmd_dev_cluster(args: argparse.Namespace) -> int:
    from timeslice.dev.cluster import ClusterError, LocalCluster
    from timeslice.dev.etcd import EtcdError

    etcd = parse_etcd(args.etcd) if args.etcd is not None else None
    shutting_down = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal shutting_down
        # The first signal unwinds whatever we are doing (starting or waiting); later ones
        # must not interrupt the orderly stop that follows.
        if not shutting_down:
            shutting_down = True
            raise _Interrupted

    try:
        cluster = LocalCluster(
            replicas=args.replicas,
            agents=args.agents,
            backend=args.backend,
            etcd_endpoint=etcd,
            prefix=args.prefix,
            session_ttl=args.session_ttl,
            base_dir=args.base_dir,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            cluster.start()
        except (ClusterError, EtcdError) as exc:
            raise Unavailable(f"the local cluster did not start: {exc}") from None
        _out(f"ready {cluster.target}")
        _out(f"export {TARGET_ENV}={cluster.target}")
        for node, path in cluster.agent_sockets.items():
            _out(f"agent {node}: export TIMESLICE_AGENT_SOCKET={path}")
        _out(f"etcd {cluster.etcd_endpoint} prefix {cluster.prefix}")
        kept = "" if args.base_dir is not None else " (removed on exit; --base-dir keeps them)"
        _out(f"logs {cluster.log_dir}{kept}")
        pids = " ".join(f"{name}={p.pid}" for name, p in cluster.processes.items())
        _out(f"pids {pids}")
        _out("stop with Ctrl-C (SIGINT) or SIGTERM")
        reported: set[str] = set()
        while True:
            time.sleep(0.5)
            for name, code in cluster.exited().items():
                if name not in reported:
                    reported.add(name)
                    print(
                        f"warning: {name} exited with status {code}; last log lines:\n"
                        f"{cluster.log_tail(name, 20)}",
                        file=sys.stderr,
                        flush=True,
                    )
    except _Interrupted:
        pass
    finally:
        shutting_down = True
        cluster.stop()
    _out("stopped")
    return 0


def _exec_service(name: str, argv: list[str]) -> NoReturn:
    module = _SERVICES[name]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``timeslice`` command. Returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Pass-through commands are handled before argparse so that every argument, --help
    # included, reaches the service untouched.
    if args_list and args_list[0] in _SERVICES:
        _exec_service(args_list[0], args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "groups": _cmd_groups,
        "status": _cmd_status,
        "yield": _cmd_yield,
        "members": _cmd_members,
        "plan": _cmd_plan,
        "acquire": _cmd_acquire,
        "dev": _cmd_dev_cluster,
    }
    try:
        return handlers[args.command](args)
    except TimeSliceError as exc:
        _fail(exc)
    except (KeyboardInterrupt, _Interrupted):
        _fail(Cancelled("interrupted"))


if __name__ == "__main__":
    sys.exit(main())
