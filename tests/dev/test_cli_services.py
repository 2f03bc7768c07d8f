"""``timeslice orchestrator`` / ``timeslice agent`` (timeslice_tools.cli.services): the service
itself runs in the command's place, every argument passed through untouched (``--help``
included), as the container images start it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from timeslice_tools.cli.services import SERVICES

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_service_commands_exec_the_service_with_arguments_untouched() -> None:
    result = _run(*TIMESLICE, "orchestrator", "--help")
    assert result.returncode == 0
    assert "--listen" in result.stdout and "--replica-id" in result.stdout
    result = _run(*TIMESLICE, "orchestrator", "--no-such-flag")
    assert result.returncode == 2
    assert "--no-such-flag" in result.stderr


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_the_command_answers_exactly_as_the_module_does(name: str) -> None:
    through_cli = _run(*TIMESLICE, name, "--version")
    direct = _run(sys.executable, "-m", SERVICES[name], "--version")
    assert direct.returncode == 0, direct.stderr
    assert (through_cli.returncode, through_cli.stdout) == (0, direct.stdout)


def test_help_lists_the_service_commands() -> None:
    result = _run(*TIMESLICE, "--help")
    assert result.returncode == 0
    for name, module in SERVICES.items():
        assert f"run {module} in the foreground" in result.stdout, name
