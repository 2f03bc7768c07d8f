"""Command-line parsing shared by the services and the ``timeslice`` command: bad input fails
at start with one clear line (and exit status 2), not a usage dump."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Sequence
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``PROG: error: MESSAGE (see PROG --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version_line(package: str) -> str:
    """``timeslice <version> (<distribution>)``: the installed distribution that provides the
    import package ``package`` (``timeslice-sdk``, ``-services``, ``-tools`` or the workspace),
    from its metadata."""
    for name in importlib.metadata.packages_distributions().get(package, []):
        try:
            return f"timeslice {importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "timeslice (version unknown: not installed as a distribution)"


class VersionAction(argparse.Action):
    """``--version`` printing :func:`version_line` of ``package``; the metadata is read only
    when asked (it scans every installed distribution, which no other start should pay for)."""

    def __init__(self, option_strings: Sequence[str], dest: str, package: str) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, nargs=0, help="print the version and exit"
        )
        self._package = package

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(version_line(self._package), flush=True)
        parser.exit(0)
