"""How the services declare their options: the one helper of the orchestrator and the agent.

Private to the services (the SDK itself never imports it) and standard library only, so the
services can share it without the SDK depending on them. Every option ``--some-name`` is also
the environment variable ``<PREFIX>SOME_NAME`` (the command line wins), goes in a titled group
of one concern so that ``--help`` reads in sections, as etcd's does, and states its default.
Units follow one convention, :data:`UNITS`, printed under every service's help.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from timeslice.argv import OneLineParser, VersionAction

log = logging.getLogger(__name__)

UNITS = (
    "Units: a duration is in seconds and a size in bytes, unless the option's name ends in "
    "its unit: -ms (milliseconds), -mib (2^20 bytes), -gb (10^9 bytes), -gbps (10^9 bytes a "
    "second: bytes, not bits). A rate is per second."
)
EMULATION = "emulation and tests (not for production)"
"""The title of the group that holds emulation (``--sim-*``) and test knobs."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")


def log_level(text: str) -> str:
    """A logging level name, any case; raises ValueError naming the choices otherwise."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level {text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def argtype(func: Callable[[str], object]) -> Callable[[str], object]:
    """Adapt a converter raising ValueError (InvalidArgument is one) to one argparse reports
    as its own one-line error."""

    def convert(text: str) -> object:
        try:
            return func(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(func, "__name__", "value")
    return convert


class ServiceOptions:
    """A service's parser: groups of options whose defaults come from the environment."""

    def __init__(
        self,
        prog: str,
        description: str,
        env_prefix: str,
        environ: Mapping[str, str],
        *,
        legacy_prefix: str = "",
    ) -> None:
        self.env_prefix = env_prefix
        self._environ = environ
        # Variables named before the one scheme (<legacy_prefix><OPTION>) of the options that
        # ask for it: still read, with a warning, so no deployment breaks.
        self._legacy_prefix = legacy_prefix
        self.parser = OneLineParser(
            prog=prog,
            description=f"{description} Every option may also be set with the environment "
            f"variable {env_prefix}<OPTION> (--some-name: {env_prefix}SOME_NAME); the command "
            "line wins.",
            epilog=UNITS,
        )
        # "timeslice orchestrator" is the module timeslice_orchestrator, and so on.
        self.parser.add_argument("--version", action=VersionAction, package=prog.replace(" ", "_"))

    def env_name(self, flag: str) -> str:
        """The environment variable of ``flag``."""
        return self.env_prefix + flag.lstrip("-").replace("-", "_").upper()

    def env(self, flag: str, *, legacy: bool = False) -> str | None:
        """The value of ``flag``'s variable in the environment, or None."""
        value = self._environ.get(self.env_name(flag))
        if value is not None or not legacy or not self._legacy_prefix:
            return value
        old = self._legacy_prefix + flag.lstrip("-").replace("-", "_").upper()
        value = self._environ.get(old)
        if value is not None:
            log.warning("%s is deprecated: use %s", old, self.env_name(flag))
        return value

    def group(self, title: str, description: str | None = None) -> OptionGroup:
        """A titled section of ``--help``."""
        return OptionGroup(self, self.parser.add_argument_group(title, description))

    def parse(self, argv: Sequence[str] | None) -> argparse.Namespace:
        return self.parser.parse_args(argv)

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and one line (``PROG: error: MESSAGE (see PROG --help)``)."""
        self.parser.error(message)


class OptionGroup:
    """One titled group of a :class:`ServiceOptions`."""

    def __init__(self, options: ServiceOptions, group: argparse._ArgumentGroup) -> None:
        self._options = options
        self._group = group

    def option(
        self,
        flag: str,
        default: str | None,
        help: str,
        *,
        legacy_env: bool = False,
        show_default: bool = True,
        **kwargs: object,
    ) -> None:
        """An option taking a value; ``default`` is text, parsed by ``type`` as the command
        line would be, so a bad value from the environment fails the start the same way."""
        env = self._options.env(flag, legacy=legacy_env)
        self._group.add_argument(
            flag,
            default=default if env is None else env,
            help=self._help(help, default if show_default else None, flag),
            **kwargs,  # type: ignore[arg-type]
        )

    def switch(
        self, flag: str, help: str, *, negatable: bool = False, legacy_env: bool = False
    ) -> None:
        """An on/off option, off unless given (or its variable is 1, true, yes or on);
        ``negatable`` adds ``--no-<name>`` to turn it off over the environment."""
        env = self._options.env(flag, legacy=legacy_env)
        self._group.add_argument(
            flag,
            action=argparse.BooleanOptionalAction if negatable else "store_true",
            default=env is not None and env.strip().lower() in _TRUE,
            help=self._help(help, None, flag),
        )

    def repeated(self, flag: str, help: str, *, metavar: str) -> None:
        """An option given any number of times (a list; no environment variable)."""
        self._group.add_argument(
            flag, action="append", default=[], metavar=metavar, help=f"{help}; repeatable"
        )

    def log_level(self) -> None:
        """``--log-level``, the same on every service."""
        self.option(
            "--log-level",
            "INFO",
            f"least severe log records written: {', '.join(LOG_LEVELS)} (any case)",
            type=argtype(log_level),
            metavar="LEVEL",
        )

    def _help(self, text: str, default: str | None, flag: str) -> str:
        shown = f" (default {default})" if default else ""
        # argparse formats help with %: a literal percent sign must be doubled.
        return f"{text}{shown} [env {self._options.env_name(flag)}]".replace("%", "%%")
