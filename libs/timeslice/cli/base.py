"""What every ``timeslice`` command is built from: the parser, errors, output, orchestrator calls.

A command group is a module with a ``register(commands)`` function that adds its subcommands
to a :class:`Commands` and names the handler of each. :func:`run` builds the parser from a list
of such functions, runs the chosen handler and turns errors into the CLI's error format.

Errors go to stderr as ``error: <kind>: <message>`` (with ``--json``, as one JSON object:
``{"error": kind, "message": ..., "exit_code": N}``); the exit status tells the failures a
script may act on apart (:class:`ExitCode`, mapped from the error's class by
:data:`EXIT_CODES`). ``run`` passes its command's status through and has codes of its own for
its failures (:mod:`timeslice.cli.wrap`).

Commands talk to the orchestrator through the SDK's transport (:func:`call`): every replica is
asked once, in order, and the first one that answers wins. They never open a session (an
operator looking at a group must not appear in it), except ``acquire`` and ``run``, which are
jobs.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, TypeVar

from timeslice._transport import ReplicasUnreachable, Transport
from timeslice.argv import VersionAction, version_line
from timeslice.errors import (
    Cancelled,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    Timeout,
    TimeSliceError,
    Unauthenticated,
    Unavailable,
)
from timeslice.ids import validate_job_id
from timeslice.targets import DEFAULT_TARGET, TARGET_ENV, Target, targets_from_env
from timeslice.tls import client_tls
from timeslice_proto.timeslice.v1 import TimeSliceStub

__all__ = [
    "CALL_TIMEOUT",
    "EXIT_BAD_INPUT",
    "EXIT_CODES",
    "EXIT_FAILURE",
    "OPERATOR_TOKEN_ENV",
    "OPERATOR_TOKEN_FILE_ENV",
    "Commands",
    "ExitCode",
    "Handler",
    "Interrupted",
    "Parser",
    "Register",
    "add_json_option",
    "add_operator_option",
    "add_target_option",
    "build_parser",
    "call",
    "count",
    "epoch",
    "exit_code",
    "fail",
    "non_negative_float",
    "operator_metadata",
    "out",
    "parse_targets",
    "positive_float",
    "print_json",
    "report",
    "run",
    "version_line",
]

CALL_TIMEOUT = 10.0
"""Seconds each orchestrator replica gets to answer one call."""


class ExitCode(enum.IntEnum):
    """The exit statuses of every ``timeslice`` command (``run`` adds its own: 125-127 and
    128+N, :mod:`timeslice.cli.wrap`). Documented in docs/dashboard.md ("timeslice in
    scripts"); scripts rely on the numbers."""

    OK = 0
    FAILURE = 1
    """Any other failure (a faulted group, a refused request, an interrupt, ...)."""
    USAGE = 2
    """Bad input: a flag, an ID, an address, a file (argparse's own status for usage)."""
    NOT_FOUND = 3
    """The group (or session) does not exist."""
    NOT_HOLDER = 4
    """The job does not hold the group under that epoch."""
    TIMEOUT = 5
    """A deadline passed (``--timeout`` of ``acquire``, or no replica answered in time)."""
    UNREACHABLE = 6
    """No orchestrator replica could be reached."""
    DENIED = 7
    """The caller may not do this, or did not prove who it is (token, certificate)."""


EXIT_CODES: tuple[tuple[type[TimeSliceError], ExitCode], ...] = (
    (InvalidArgument, ExitCode.USAGE),
    (NotFound, ExitCode.NOT_FOUND),
    (NotHolder, ExitCode.NOT_HOLDER),
    (Timeout, ExitCode.TIMEOUT),
    (Unavailable, ExitCode.UNREACHABLE),
    (PermissionDenied, ExitCode.DENIED),
    (Unauthenticated, ExitCode.DENIED),
)
"""Error class -> exit status, first match by ``isinstance``: a subclass (a more precise
connection error, say) exits as its base does. Any other error exits :attr:`ExitCode.FAILURE`."""

EXIT_FAILURE = ExitCode.FAILURE
EXIT_BAD_INPUT = ExitCode.USAGE

T = TypeVar("T")

Handler = Callable[[argparse.Namespace], int]
"""Runs one command; returns the exit status."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived (a BaseException so that library code does not swallow it)."""


# -- parsing ---------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with our error format (``error: invalid_argument: ...``, exit 2).

    Help keeps the line breaks of descriptions and epilogs (the examples are laid out).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        # One line, as every entry point fails at start (timeslice.argv).
        fail(InvalidArgument(f"{message} (see {self.prog} --help)"))


class Commands:
    """The subcommands of one ``timeslice`` parser, and the handler of each."""

    def __init__(self, parser: Parser) -> None:
        sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
        sub.required = True
        self._sub = sub
        self.handlers: dict[str, Handler] = {}

    def add(self, name: str, handler: Handler | None, **kwargs: object) -> Parser:
        """Add subcommand ``name``; ``kwargs`` go to ``add_parser`` (``help=``, ...).

        ``handler`` is ``None`` for commands the caller handles before parsing (the service
        pass-through commands of ``timeslice_tools``).
        """
        parser: Parser = self._sub.add_parser(name, **kwargs)  # type: ignore[arg-type]
        if handler is not None:
            self.handlers[name] = handler
        return parser


Register = Callable[[Commands], None]
"""A command group: adds its subcommands to a :class:`Commands`."""


def _exit_code_table() -> str:
    lines = ["exit status:"]
    for code in ExitCode:
        lines.append(f"  {int(code)}  {code.name.lower().replace('_', ' ')}")
    lines.append(
        "  (run: also CMD's own status, 125 not started, 126/127 CMD not executable/found)"
    )
    return "\n".join(lines)


def build_parser(
    groups: Sequence[Register], *, package: str = "timeslice"
) -> tuple[Parser, dict[str, Handler]]:
    """The ``timeslice`` parser with the subcommands of ``groups``, and their handlers.

    ``--version`` names the distribution that provides the import package ``package``.
    """
    parser = Parser(
        prog="timeslice",
        description="Co-operative accelerator time-slicing for RL post-training jobs.",
        epilog=f"{_exit_code_table()}\n\n'timeslice COMMAND --help' shows a command's "
        "options and an example.",
    )
    parser.add_argument("--version", action=VersionAction, package=package)
    commands = Commands(parser)
    for register in groups:
        register(commands)
    return parser, commands.handlers


def run(argv: Sequence[str], groups: Sequence[Register], *, package: str = "timeslice") -> int:
    """Parse ``argv``, run the chosen command, report errors; returns the exit status."""
    global _json_errors
    argv = list(argv)
    # Known before parsing, so that a usage error of a --json command is JSON too; the
    # arguments of `run`'s CMD (after "--") are CMD's, not ours.
    _json_errors = "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
    parser, handlers = build_parser(groups, package=package)
    args = parser.parse_args(argv)
    _json_errors = bool(getattr(args, "json", False))
    try:
        return handlers[args.command](args)
    except TimeSliceError as exc:
        fail(exc)
    except (KeyboardInterrupt, Interrupted):
        fail(Cancelled("interrupted"))


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def count(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    return parse


def epoch(text: str) -> int:
    """argparse type: a fencing token (1 to 2**64-1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 < value < 2**64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid epoch (1 to 2**64-1)")
    return value


def add_target_option(parser: argparse.ArgumentParser) -> None:
    """``--target``: the orchestrator address(es)."""
    parser.add_argument(
        "--target",
        help=f"orchestrator address(es), comma-separated (default: ${TARGET_ENV} or "
        f"{DEFAULT_TARGET})",
    )


OPERATOR_TOKEN_ENV = "TIMESLICE_OPERATOR_TOKEN"
OPERATOR_TOKEN_FILE_ENV = "TIMESLICE_OPERATOR_TOKEN_FILE"


def add_operator_option(parser: argparse.ArgumentParser) -> None:
    """``--token-file``: the operator token that commands changing a group must present."""
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"file with the operator token (default: ${OPERATOR_TOKEN_FILE_ENV}, or the token "
        f"itself in ${OPERATOR_TOKEN_ENV}); the orchestrator refuses operator commands without it",
    )


def operator_metadata(args: argparse.Namespace) -> dict[str, str]:
    """The gRPC metadata that proves an operator: ``authorization: Bearer <token>``.

    The token comes from ``--token-file``, else ``$TIMESLICE_OPERATOR_TOKEN_FILE``, else
    ``$TIMESLICE_OPERATOR_TOKEN`` (never a flag's value: it would show in ``ps``). No token: no
    metadata, and the orchestrator answers PERMISSION_DENIED.
    """
    path = args.token_file or os.environ.get(OPERATOR_TOKEN_FILE_ENV, "")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise InvalidArgument(f"cannot read the operator token file {path}: {exc}") from None
    else:
        token = os.environ.get(OPERATOR_TOKEN_ENV, "").strip()
    return {"authorization": f"Bearer {token}"} if token else {}


def parse_targets(text: str | None) -> list[Target]:
    """``--target`` (comma-separated; None: ``$TIMESLICE_TARGET`` or the default).

    The SDK's parser, with the port required: an operator names replicas exactly. TCP
    targets are ``(host, port)`` pairs; ``unix:/path`` is accepted as the SDK accepts it.
    """
    return targets_from_env(text, default_port=None)


# -- errors and output -----------------------------------------------------------------------


# Whether errors are printed as JSON: set by `run` from the command's --json.
_json_errors = False


def exit_code(error: TimeSliceError) -> ExitCode:
    """The exit status of a command that failed with ``error`` (:data:`EXIT_CODES`)."""
    for cls, code in EXIT_CODES:
        if isinstance(error, cls):
            return code
    return ExitCode.FAILURE


def report(error: TimeSliceError, code: int | None = None) -> None:
    """Print ``error`` in the CLI's format on stderr (for a command that chooses its own exit
    status, ``code``; default the one :func:`exit_code` gives)."""
    if _json_errors:
        document = {
            "error": error.kind.value,
            "message": error.message,
            "exit_code": int(exit_code(error) if code is None else code),
        }
        print(json.dumps(document), file=sys.stderr, flush=True)
    else:
        print(f"error: {error.kind.value}: {error.message}", file=sys.stderr, flush=True)


def fail(error: TimeSliceError) -> NoReturn:
    """Print ``error`` in the CLI's format and exit with its status (:data:`EXIT_CODES`)."""
    code = exit_code(error)
    report(error, code)
    raise SystemExit(int(code))


def out(line: str) -> None:
    """Print one line of a command's result on stdout, at once."""
    print(line, flush=True)


def print_json(value: object) -> None:
    """Print ``value`` as one JSON document on stdout (a command's ``--json`` result)."""
    out(json.dumps(value, indent=2))


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``: the result as JSON on stdout, and errors as one JSON object on stderr."""
    parser.add_argument(
        "--json",
        action="store_true",
        help='print the result as JSON; errors as {"error", "message", "exit_code"} on stderr',
    )


# -- talking to the orchestrator -------------------------------------------------------------


async def call(
    targets: Sequence[Target],
    what: str,
    rpc: Callable[[TimeSliceStub, float], Awaitable[T]],
) -> T:
    """Run one unary call on the first replica that answers.

    ``rpc(stub, timeout)`` must pass ``timeout`` to the call. Every replica is asked once, in
    order, each with :data:`CALL_TIMEOUT` seconds: a replica that cannot be reached (or says
    UNAVAILABLE) is skipped; any other answer, including a typed error, is authoritative.

    Raises:
        Unavailable: no replica could be reached (every replica's problem is listed).
        Timeout: no replica answered in time.
    """
    # TLS as the SDK: $TIMESLICE_TLS_CA/_CERT/_KEY, or plaintext by $TIMESLICE_INSECURE=1.
    transport = Transport(targets, client_tls(targets))
    try:
        return await transport.unary(
            what, rpc, budget=CALL_TIMEOUT * len(targets), attempts=len(targets)
        )
    except ReplicasUnreachable as exc:
        problems = "; ".join(str(error) for error in exc.problems.values())
        if all(isinstance(error, Timeout) for error in exc.problems.values()):
            raise Timeout(f"no orchestrator answered: {problems}") from None
        raise Unavailable(f"no orchestrator reachable: {problems}") from None
    finally:
        transport.close()


def job_of(args: argparse.Namespace) -> str:
    """``--job``, else ``$TIMESLICE_JOB_ID`` (as the SDK reads it)."""
    job = args.job or os.environ.get("TIMESLICE_JOB_ID")
    if not job:
        raise InvalidArgument("no job: pass --job J or set TIMESLICE_JOB_ID")
    return validate_job_id(job)
