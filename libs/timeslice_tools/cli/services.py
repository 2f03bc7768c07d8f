"""``timeslice orchestrator ARGS...`` / ``timeslice agent ARGS...``: run a service in the
foreground, exactly as ``python -m timeslice_orchestrator`` / ``-m timeslice_agent`` would
(the container images use this entry point)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from timeslice.cli.base import Commands

__all__ = ["SERVICES", "exec_service", "register"]

SERVICES = {"orchestrator": "timeslice_orchestrator", "agent": "timeslice_agent"}
"""Command name -> the module the command runs."""


def register(commands: Commands) -> None:
    """List the service commands in ``--help`` (``main`` runs them before parsing)."""
    for name, module in SERVICES.items():
        commands.add(
            name,
            None,
            help=f"run {module} in the foreground (arguments are passed through)",
            description=f"Replace this process with 'python -m {module}', every argument "
            "(--help included) passed to it untouched: the container images' entry point.",
            epilog=f"examples:\n  timeslice {name} --help\n  timeslice {name} --version",
            add_help=False,
        )


def exec_service(name: str, argv: list[str]) -> NoReturn:
    """Replace this process with service ``name``, its arguments untouched."""
    module = SERVICES[name]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
