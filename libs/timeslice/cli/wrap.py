"""``timeslice run``: hold a group for the life of a command (platform-level phases, no code).

::

    timeslice run --group G --job J [--target T] [--timeout S] [--session-ttl S]
                  [--kill-after S] -- CMD [ARGS...]

For platforms that queue training and sampling as separate jobs: the wrapper acquires G as
job J, starts CMD with ``TIMESLICE_JOB_ID=J`` and ``TIMESLICE_GROUP=G`` added to its
environment (the labels the agent's process discovery reads), waits for it, and yields G once
CMD has exited, however it exited. ``--group`` and ``--job`` default to those same variables,
so in a pod already labelled for discovery ``timeslice run -- CMD`` is enough.

Exit status (see :data:`EXIT_NOT_STARTED` and friends):

- CMD's own exit status, passed through;
- ``128+N`` when CMD was killed by signal N (as a shell reports it), and when the wrapper got
  a terminating signal N while still waiting for G (CMD never started);
- ``125``: the wrapper could not acquire G (``--timeout`` passed, no orchestrator reachable,
  refused); CMD never started;
- ``126``/``127``: CMD could not be executed / was not found (checked before waiting for G);
- ``2``: bad input (no CMD, a malformed group or job id), as every ``timeslice`` command.

Signals: CMD runs in its own process group, and SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and
SIGUSR2 sent to the wrapper are forwarded to that whole group: the processes that hold devices
are often CMD's children (a launcher's workers, a shell script's python), and a terminal's
Ctrl-C reaches them once, through the wrapper, rather than twice. The first of SIGINT, SIGTERM,
SIGHUP or SIGQUIT also starts a ``--kill-after`` deadline, after which the group is
SIGKILLed: the wrapper yields and exits before the platform's own grace period ends. When CMD
exits, whatever it left running in its group is SIGKILLed before the yield, so nothing of the
job keeps running on devices it no longer holds. If the wrapper itself is SIGKILLed, its hold
lapses with its session (``--session-ttl``) and, on Linux, the kernel kills CMD
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

from timeslice.cli.base import (
    Commands,
    Interrupted,
    add_target_option,
    parse_targets,
    positive_float,
    report,
)
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TimeSliceError,
)
from timeslice.ids import validate_group_id, validate_job_id

__all__ = [
    "DEFAULT_KILL_AFTER",
    "DEFAULT_SESSION_TTL",
    "DEFAULT_TIMEOUT",
    "EXIT_CANNOT_EXECUTE",
    "EXIT_NOT_FOUND",
    "EXIT_NOT_STARTED",
    "GROUP_ENV",
    "JOB_ENV",
    "cmd_run",
    "register",
]

JOB_ENV = "TIMESLICE_JOB_ID"
GROUP_ENV = "TIMESLICE_GROUP"

EXIT_NOT_STARTED = 125
"""The wrapper could not acquire the group (timeout, unreachable, refused): CMD not started."""
EXIT_CANNOT_EXECUTE = 126
"""CMD exists but cannot be executed (as a shell reports it)."""
EXIT_NOT_FOUND = 127
"""CMD was not found (as a shell reports it)."""

DEFAULT_TIMEOUT = 3600.0
"""Seconds to wait for the group before giving up (exit 125)."""
DEFAULT_SESSION_TTL = 10.0
"""Seconds a dead wrapper's hold outlives it (the session lease; the SDK's default)."""
DEFAULT_KILL_AFTER = 10.0
"""Seconds CMD gets to exit after a forwarded terminating signal before it is SIGKILLed."""

_FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_TERMINATING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
# How often the wait for CMD looks at the kill deadline a signal may have set.
_POLL_SECONDS = 0.2
_PR_SET_PDEATHSIG = 1

_USAGE = "timeslice run --group G --job J -- CMD [ARGS...]"


def register(commands: Commands) -> None:
    """Add ``run``."""
    run = commands.add(
        "run",
        cmd_run,
        help="hold a group for the life of a command: acquire, run CMD, yield when it exits",
        description="Acquire GROUP as JOB, run CMD with TIMESLICE_JOB_ID and TIMESLICE_GROUP "
        "set, yield when CMD exits. Signals are forwarded to CMD's process group.",
        epilog="exit status: CMD's own; 128+N if CMD was killed by signal N (or the wrapper "
        "was, while waiting); 125 if the group could not be acquired (CMD not started); "
        "126/127 if CMD cannot be executed / is not found; 2 for bad input\n\n"
        "examples:\n"
        "  timeslice run --group trainer-group --job job-a -- python train.py --steps 100\n"
        "  TIMESLICE_GROUP=trainer-group TIMESLICE_JOB_ID=job-a timeslice run -- ./step.sh",
    )
    run.add_argument("--group", metavar="G", help=f"the group to hold (default: ${GROUP_ENV})")
    run.add_argument("--job", metavar="J", help=f"the job to hold it as (default: ${JOB_ENV})")
    add_target_option(run)
    run.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"give up waiting for the group after S s, exit {EXIT_NOT_STARTED} "
        f"(default: {DEFAULT_TIMEOUT:g})",
    )
    run.add_argument(
        "--session-ttl",
        type=positive_float,
        default=DEFAULT_SESSION_TTL,
        metavar="S",
        help="if the wrapper dies, its hold lapses after about S s "
        f"(default: {DEFAULT_SESSION_TTL:g})",
    )
    run.add_argument(
        "--kill-after",
        type=positive_float,
        default=DEFAULT_KILL_AFTER,
        metavar="S",
        help="SIGKILL CMD's process group S s after forwarding SIGINT/SIGTERM/SIGHUP/SIGQUIT "
        f"(default: {DEFAULT_KILL_AFTER:g})",
    )
    # dest is not "command": the subparsers store the command's name there.
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")


class _Stage(enum.Enum):
    """Where the wrapper is, which decides what a signal does."""

    WAITING = "waiting"  # for the group: a terminating signal cancels the acquire
    STARTING = "starting"  # group held, CMD not yet running: a terminating signal stops here
    RUNNING = "running"  # signals go to CMD's process group
    FINISHING = "finishing"  # CMD is gone, the yield is under way: signals are ignored


@dataclass
class _State:
    kill_after: float
    """Seconds CMD gets after a terminating signal."""
    stage: _Stage = _Stage.WAITING
    child: subprocess.Popen[bytes] | None = None
    stopped_by: int | None = None
    """The first terminating signal the wrapper got."""
    kill_at: float | None = None
    """When CMD's process group gets SIGKILL (monotonic), once a terminating signal came."""


def cmd_run(args: argparse.Namespace) -> int:
    """``timeslice run --group G --job J -- CMD [ARGS...]``; returns the exit status."""
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise InvalidArgument(f"no command to run: {_USAGE}")
    group = validate_group_id(_required(args.group, GROUP_ENV, "--group"))
    job = validate_job_id(_required(args.job, JOB_ENV, "--job"))
    targets = [str(t) for t in parse_targets(args.target)]
    missing = _not_executable(command[0])
    if missing is not None:
        return missing

    state = _State(kill_after=args.kill_after)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        terminating = signum in _TERMINATING
        if terminating and state.stopped_by is None:
            state.stopped_by = signum
        if state.stage is _Stage.WAITING and terminating:
            # Unwinds the blocking acquire; the SDK's cancel path removes our queue entry.
            raise Interrupted
        if state.stage is _Stage.RUNNING and state.child is not None:
            _signal_group(state.child.pid, signum)
            if terminating and state.kill_at is None:
                state.kill_at = time.monotonic() + state.kill_after

    client = TimeSliceOrchestratorClient(targets, job_id=job, session_ttl=args.session_ttl)
    previous = {s: signal.signal(s, on_signal) for s in _FORWARDED}
    try:
        try:
            grant = client.acquire(group, timeout=args.timeout)
        except Interrupted:
            signum = state.stopped_by or signal.SIGINT
            name = signal.Signals(signum).name
            report(Cancelled(f"{name} while waiting for {group}; CMD not started"))
            return 128 + signum
        except TimeSliceError as exc:
            report(exc)
            return EXIT_NOT_STARTED
        state.stage = _Stage.STARTING
        _note(f"{job} holds {group} (epoch {grant.epoch}, waited {grant.waited_seconds:.3f} s)")
        status = _run_child(command, job, group, state)
        state.stage = _Stage.FINISHING
        _yield(client, group)
        return status
    finally:
        state.stage = _Stage.FINISHING
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Ends the session, which releases the hold if the yield failed or never ran.
        client.close()


def _run_child(command: Sequence[str], job: str, group: str, state: _State) -> int:
    """Start CMD (unless a terminating signal came first), wait for it; its exit status."""
    if state.stopped_by is not None:
        _note(f"{signal.Signals(state.stopped_by).name} before CMD started; not starting it")
        return 128 + state.stopped_by
    try:
        # process_group=0: CMD leads a group of its own, which the forwarded signals reach.
        state.child = subprocess.Popen(
            command,
            env={**os.environ, JOB_ENV: job, GROUP_ENV: group},
            process_group=0,
            preexec_fn=_die_with_parent(),
        )
    except FileNotFoundError:
        report(NotFound(f"cannot run {command[0]}: command not found"))
        return EXIT_NOT_FOUND
    except OSError as exc:
        report(FailedPrecondition(f"cannot run {command[0]}: {exc.strerror or exc}"))
        return EXIT_CANNOT_EXECUTE
    state.stage = _Stage.RUNNING
    if state.stopped_by is not None:  # arrived while CMD was being started: not yet forwarded
        _signal_group(state.child.pid, state.stopped_by)
        state.kill_at = time.monotonic() + state.kill_after
    returncode = _wait(state.child, state)
    # Whatever CMD left behind in its group must not run on devices the job no longer holds.
    _signal_group(state.child.pid, signal.SIGKILL)
    return 128 - returncode if returncode < 0 else returncode


def _wait(child: subprocess.Popen[bytes], state: _State) -> int:
    """CMD's return code; SIGKILLs its group once ``state.kill_at`` has passed."""
    killed = False
    while True:
        try:
            return child.wait(timeout=_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            if not killed and state.kill_at is not None and time.monotonic() >= state.kill_at:
                _note(f"CMD still running {state.kill_after:g} s after a stop signal: killed")
                _signal_group(child.pid, signal.SIGKILL)
                killed = True


def _yield(client: TimeSliceOrchestratorClient, group: str) -> None:
    """Give the group back; a failure is reported, never allowed to replace CMD's status."""
    try:
        client.yield_(group)
    except TimeSliceError as exc:
        why = f"{exc.kind.value}: {exc.message}"
        _note(f"could not yield {group} ({why}); the hold ends with the session, now")
    else:
        _note(f"yielded {group}")


def _required(value: str | None, env: str, flag: str) -> str:
    value = value or os.environ.get(env, "")
    if not value:
        raise InvalidArgument(f"{flag} is required (or ${env}): {_USAGE}")
    return value


def _not_executable(program: str) -> int | None:
    """None if ``program`` can be executed; else reports why and returns the exit status.

    Checked before waiting for the group: a job must not queue (maybe for an hour) and make
    others wait only to find that its command does not exist.
    """
    if shutil.which(program) is not None:
        return None
    if os.sep in program and os.path.exists(program):
        report(FailedPrecondition(f"cannot run {program}: not an executable file"))
        return EXIT_CANNOT_EXECUTE
    report(NotFound(f"cannot run {program}: command not found"))
    return EXIT_NOT_FOUND


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone (or what is left of it is no longer ours)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL CMD if the wrapper dies (Linux only).

    Without it a SIGKILLed wrapper would leave CMD running on devices whose hold has lapsed
    and been granted to another job.
    """
    if not sys.platform.startswith("linux"):
        return None
    # Resolved before the fork: the child only makes the call (no imports, no lookups).
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the wrapper died before the call took effect
            os._exit(128 + sigkill)

    return preexec


def _note(message: str) -> None:
    """A line about the wrapper on stderr (stdout is CMD's alone)."""
    print(f"timeslice run: {message}", file=sys.stderr, flush=True)
