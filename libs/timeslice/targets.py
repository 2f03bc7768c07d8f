"""Network addresses: the one ``HOST:PORT`` parser of the project.

The SDK, the ``timeslice`` command line, the agent's and the orchestrator's options all parse
addresses here, so every component accepts the same forms and reports the same errors:

- ``host:port``, where host is a DNS name or an IPv4 address;
- ``[v6addr]:port`` (brackets are required: a bare IPv6 address is ambiguous with a port);
- ``unix:/path`` or ``unix:///path`` (the gRPC forms), where the caller accepts unix sockets;
- a comma-separated list of any of these, or a sequence of such strings (empty items are
  skipped, so ``"a:1,"`` is one target).

Callers choose whether the port may be left out (the SDK defaults it to 50051), whether port 0
is allowed (listening addresses), and what a missing host means (``:8080`` = all interfaces).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from timeslice.errors import InvalidArgument

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TARGET",
    "TARGET_ENV",
    "HostPort",
    "Target",
    "UnixSocket",
    "parse_address",
    "parse_target",
    "parse_targets",
    "targets_from_env",
]

TARGET_ENV = "TIMESLICE_TARGET"
"""The environment variable clients read their orchestrator target(s) from."""
DEFAULT_PORT = 50051
"""The orchestrator's gRPC port, assumed where a client target leaves the port out."""
DEFAULT_TARGET = f"localhost:{DEFAULT_PORT}"
"""Where clients look for an orchestrator when nothing else is configured."""


class HostPort(NamedTuple):
    """A TCP address: a host (DNS name, IPv4 or IPv6 address, without brackets) and a port.

    A named tuple, so it also compares equal to the plain ``(host, port)`` pair.
    """

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class UnixSocket:
    """A unix socket path (absolute)."""

    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


Target: TypeAlias = HostPort | UnixSocket
"""One parsed address."""


def _bad(what: str, text: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{what} {text!r} is not HOST:PORT: {why}")


def parse_address(
    text: str,
    *,
    default_port: int | None = None,
    default_host: str | None = None,
    port_zero: bool = False,
    what: str = "address",
) -> HostPort:
    """Parse one ``host:port`` or ``[v6addr]:port``.

    Args:
        text: the address; surrounding whitespace is ignored.
        default_port: the port when ``text`` has none; ``None`` makes the port required.
        default_host: the host when ``text`` is just ``:port``; ``None`` makes it required.
        port_zero: accept port 0 (a listening address that lets the system pick).
        what: how error messages name the value ("target", "etcd endpoint", ...).

    Raises:
        InvalidArgument: the text is not such an address.
    """
    item = text.strip()
    if not item:
        raise _bad(what, text, "it is empty")
    port_text: str | None
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise _bad(what, text, "unterminated '[' in an IPv6 address")
        host, rest = item[1:end], item[end + 1 :]
        if rest and not rest.startswith(":"):
            raise _bad(what, text, "expected ':port' after ']'")
        port_text = rest[1:] if rest else None
    elif item.count(":") == 1:
        host, port_text = item.split(":")
    elif ":" in item:
        raise _bad(what, text, "write IPv6 addresses as [addr]:port")
    else:
        host, port_text = item, None
    if not host:
        if default_host is None:
            raise _bad(what, text, "no host")
        host = default_host
    if port_text is None:
        if default_port is None:
            raise _bad(what, text, "no port")
        return HostPort(host, default_port)
    if not port_text:
        raise _bad(what, text, "no port after ':'")
    low = 0 if port_zero else 1
    if not (port_text.isascii() and port_text.isdigit()) or not low <= int(port_text) <= 65535:
        raise _bad(what, text, f"the port must be a number from {low} to 65535")
    return HostPort(host, int(port_text))


def parse_target(
    text: str, *, default_port: int | None = DEFAULT_PORT, what: str = "target"
) -> Target:
    """Parse one client target: an address as :func:`parse_address` takes it, or ``unix:/path``.

    Raises:
        InvalidArgument: the text is neither.
    """
    item = text.strip()
    if item.startswith("unix:"):
        path = item[len("unix:") :]
        # Accept both unix:/path and unix:///path (the gRPC URI forms).
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise InvalidArgument(f"unix {what} {text!r} needs an absolute path")
        return UnixSocket(path)
    return parse_address(item, default_port=default_port, what=what)


def _items(value: str | Sequence[str]) -> list[str]:
    entries = [value] if isinstance(value, str) else list(value)
    items: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise InvalidArgument(f"targets must be strings, got {type(entry).__name__}")
        items.extend(part for part in entry.split(",") if part.strip())
    return items


def parse_targets(
    value: str | Sequence[str],
    *,
    default_port: int | None = DEFAULT_PORT,
    unix: bool = True,
    what: str = "target",
) -> list[Target]:
    """Parse a comma-separated list of targets, or a sequence of such lists, in order.

    With ``unix=False`` only TCP addresses are accepted (the result holds only
    :class:`HostPort`). Raises :class:`InvalidArgument` for a malformed item or when no
    target is given at all.
    """
    items = _items(value)
    if not items:
        raise InvalidArgument(f"{what} {value!r} names no address")
    if unix:
        return [parse_target(item, default_port=default_port, what=what) for item in items]
    return [parse_address(item, default_port=default_port, what=what) for item in items]


def targets_from_env(
    value: str | Sequence[str] | None, *, default_port: int | None = DEFAULT_PORT
) -> list[Target]:
    """:func:`parse_targets` of ``value``; ``None``: ``$TIMESLICE_TARGET``, else the default."""
    if value is None:
        value = os.environ.get(TARGET_ENV) or DEFAULT_TARGET
    return parse_targets(value, default_port=default_port)
