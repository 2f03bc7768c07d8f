"""Command-line parsing shared by the services and the ``timeslice`` command: bad input fails
at start with one clear line (and exit status 2), not a usage dump."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``PROG: error: MESSAGE (see PROG --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
