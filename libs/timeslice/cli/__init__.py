"""The ``timeslice`` operator commands, built on the SDK's transport.

::

    timeslice --version
    timeslice groups [--target T] [--json]
    timeslice status [GROUP] [--target T] [--json]
    timeslice plan [--target T] [--cap C] [--switch-seconds S] [--json]
    timeslice acquire GROUP --job J [--target T] [--timeout S] [--hold SECONDS] [--json]
    timeslice yield GROUP --job J --epoch E [--target T] [--json]
    timeslice members GROUP (--set NODES | --clear) [--target T] [--json]
    timeslice run --group G --job J [--target T] [--timeout S] -- CMD [ARGS...]

``python -m timeslice.cli`` runs these. The installed ``timeslice`` command
(:mod:`timeslice_tools.cli`) adds the development and service commands (``dev cluster``,
``orchestrator``, ``agent``) to the same parser.

One module per command group: :mod:`~timeslice.cli.status` (groups, status),
:mod:`~timeslice.cli.plan`, :mod:`~timeslice.cli.acquire`, :mod:`~timeslice.cli.admin`
(yield, members), :mod:`~timeslice.cli.wrap` (run: hold a group for the life of a command,
with its own exit statuses); :mod:`~timeslice.cli.base` holds what they share (parser, error format,
calls to the orchestrator). Errors go to stderr as ``error: <kind>: <message>`` (a JSON object
with ``--json``); the exit status says which failure it was (:class:`~timeslice.cli.base.ExitCode`:
2 bad input, 3 not found, 4 not holder, 5 timeout, 6 unreachable, 7 denied, 1 anything else).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from timeslice.cli import acquire, admin, place, plan, status, wrap
from timeslice.cli.base import Parser, Register, parse_targets, run
from timeslice.cli.base import build_parser as _build_parser
from timeslice.cli.status import format_group_line, format_status, status_view

__all__ = [
    "COMMANDS",
    "build_parser",
    "format_group_line",
    "format_status",
    "main",
    "parse_targets",
    "status_view",
]

COMMANDS: tuple[Register, ...] = (
    status.register,
    plan.register,
    acquire.register,
    wrap.register,
    admin.register,
    place.register,
)
"""The operator command groups, in the order ``--help`` lists them."""


def build_parser() -> Parser:
    """The parser of the operator commands (exposed for tests and docs)."""
    return _build_parser(COMMANDS)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the operator commands on ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    return run(sys.argv[1:] if argv is None else argv, COMMANDS, package="timeslice")
