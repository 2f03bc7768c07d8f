"""The ``timeslice`` command: the SDK's operator commands plus the development and service ones.

::

    timeslice dev cluster [--replicas N] [--agents M] [--backend sim|freeze|app|cuda] ...
    timeslice orchestrator ARGS...        # exec python -m timeslice_orchestrator ARGS
    timeslice agent ARGS...               # exec python -m timeslice_agent ARGS
    timeslice groups | status | plan | acquire | run | yield | members ...   # timeslice.cli
    timeslice top [--once] [--json] [--target T]   # every group, live; q quits
    timeslice --version

The operator commands live in the SDK (:mod:`timeslice.cli`), which a job installs; this
package adds :mod:`~timeslice_tools.cli.dev` and :mod:`~timeslice_tools.cli.services`, which
only developers and the service images need. Errors and exit statuses are those of
:mod:`timeslice.cli.base` (:class:`~timeslice.cli.base.ExitCode`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from timeslice.cli import COMMANDS as OPERATOR_COMMANDS
from timeslice.cli import format_group_line, format_status, parse_targets, status_view
from timeslice.cli.base import Parser, Register, run
from timeslice.cli.base import build_parser as _build_parser
from timeslice_tools.cli import dev, services, top
from timeslice_tools.cli.dev import parse_etcd

__all__ = [
    "COMMANDS",
    "build_parser",
    "format_group_line",
    "format_status",
    "main",
    "parse_etcd",
    "parse_targets",
    "status_view",
]

COMMANDS: tuple[Register, ...] = (
    dev.register,
    services.register,
    *OPERATOR_COMMANDS,
    top.register,
)
"""Every command group of ``timeslice``, in the order ``--help`` lists them."""

# --version names the distribution that ships this command (timeslice-tools, or the workspace).
_PACKAGE = "timeslice_tools"


def build_parser() -> Parser:
    """The full ``timeslice`` argument parser (exposed for tests and docs)."""
    return _build_parser(COMMANDS, package=_PACKAGE)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``timeslice`` command. Returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Pass-through commands are handled before argparse so that every argument, --help
    # included, reaches the service untouched.
    if args and args[0] in services.SERVICES:
        services.exec_service(args[0], args[1:])
    return run(args, COMMANDS, package=_PACKAGE)
