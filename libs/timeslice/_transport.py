"""Connections to orchestrator replicas: target parsing, error mapping and failover.

Every orchestrator replica answers every call, so the SDK keeps one lazily opened grpclib
channel per configured target, sticks to the one that last worked, and moves on to the next
one when a replica cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from timeslice.errors import (
    InvalidArgument,
    Timeout,
    TimeSliceError,
    Unavailable,
    error_from_status,
)
from timeslice_proto.timeslice.v1 import TimeSliceStub

log = logging.getLogger("timeslice.transport")

DEFAULT_TARGET = "localhost:50051"
DEFAULT_PORT = 50051

BACKOFF_INITIAL = 0.05
BACKOFF_MAX = 1.0

T = TypeVar("T")


# HTTP/2 pings find a replica that stopped answering (paused, partitioned) within a few seconds,
# so a waiting Acquire moves to another replica instead of waiting on a dead connection.
CHANNEL_CONFIG = Configuration(
    _keepalive_time=2.0,
    _keepalive_timeout=3.0,
    _keepalive_permit_without_calls=True,
)


@dataclass(frozen=True, slots=True)
class Target:
    """One orchestrator address: TCP host and port, or a unix socket path."""

    host: str | None = None
    port: int | None = None
    path: str | None = None

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        if self.host is not None and ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    def open_channel(self) -> Channel:
        """Create a channel for this target (must be called inside the loop that will use it)."""
        if self.path is not None:
            return Channel(path=self.path, config=CHANNEL_CONFIG)
        return Channel(host=self.host, port=self.port, config=CHANNEL_CONFIG)


def _parse_one(text: str) -> Target:
    item = text.strip()
    if not item:
        raise InvalidArgument("empty orchestrator target")
    if item.startswith("unix:"):
        path = item[len("unix:") :]
        # Accept both unix:/path and unix:///path (the gRPC URI forms).
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise InvalidArgument(f"unix target {item!r} needs an absolute path")
        return Target(path=path)
    host: str
    port_text: str | None
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise InvalidArgument(f"target {item!r}: unterminated '[' in IPv6 address")
        host = item[1:end]
        rest = item[end + 1 :]
        if rest and not rest.startswith(":"):
            raise InvalidArgument(f"target {item!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else None
    elif item.count(":") == 1:
        host, port_text = item.split(":")
    elif ":" in item:
        raise InvalidArgument(f"target {item!r}: write IPv6 addresses as [addr]:port")
    else:
        host, port_text = item, None
    if not host:
        raise InvalidArgument(f"target {item!r} has no host")
    if port_text is None:
        return Target(host=host, port=DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"target {item!r}: port must be a number from 1 to 65535")
    return Target(host=host, port=int(port_text))


def parse_targets(target: str | Sequence[str]) -> list[Target]:
    """Parse ``host:port``, a comma-separated list of them, or a sequence of them.

    ``[v6addr]:port`` and ``unix:/path`` are accepted too; a missing port means 50051.
    """
    items: list[str]
    if isinstance(target, str):
        items = target.split(",")
    else:
        items = []
        for entry in target:
            if not isinstance(entry, str):
                raise InvalidArgument(f"targets must be strings, got {type(entry).__name__}")
            items.extend(entry.split(","))
    targets = [_parse_one(item) for item in items]
    if not targets:
        raise InvalidArgument("no orchestrator target given")
    return targets


def map_error(exc: BaseException, where: object) -> TimeSliceError | None:
    """Translate a transport-level exception into the SDK's typed errors.

    Returns ``None`` for anything that is not a transport failure (the caller re-raises it).
    """
    if isinstance(exc, TimeSliceError):
        return exc
    if isinstance(exc, GRPCError):
        return error_from_status(exc.status, exc.message)
    # TimeoutError is an OSError subclass: test it before the connection errors.
    if isinstance(exc, TimeoutError):
        return Timeout(f"{where}: deadline exceeded")
    if isinstance(exc, OSError | StreamTerminatedError | ProtocolError):
        detail = str(exc) or type(exc).__name__
        return Unavailable(f"{where}: {detail}")
    return None


class Backoff:
    """Exponential backoff with jitter: 0.05 s doubling up to 1 s."""

    def __init__(self, initial: float = BACKOFF_INITIAL, maximum: float = BACKOFF_MAX) -> None:
        self._initial = initial
        self._maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self._initial

    def next_delay(self) -> float:
        """The delay before the next retry; full jitter over the upper half avoids herds."""
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        return random.uniform(delay / 2, delay)


def check_seconds(value: object, what: str, *, allow_none: bool = False) -> float | None:
    """Validate a duration argument: a finite number >= 0 (or ``None`` when allowed)."""
    if value is None:
        if allow_none:
            return None
        raise InvalidArgument(f"{what} must be a number of seconds, got None")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise InvalidArgument(f"{what} must be a finite number >= 0, got {value!r}")
    return seconds


class Transport:
    """Channels to every target, bound to the event loop that first uses them."""

    def __init__(self, targets: Sequence[Target]) -> None:
        if not targets:
            raise InvalidArgument("no orchestrator target given")
        self.targets = list(targets)
        self._channels: dict[int, Channel] = {}
        self._current = 0
        self._closed = False

    @property
    def current(self) -> Target:
        return self.targets[self._current]

    def rotate(self) -> None:
        """Move on to the next target after the current one failed."""
        self._current = (self._current + 1) % len(self.targets)

    def stub(self) -> tuple[Target, TimeSliceStub]:
        """The current target and a stub for it (opening its channel if needed)."""
        if self._closed:
            raise Unavailable("the client's connections were closed")
        channel = self._channels.get(self._current)
        if channel is None:
            channel = self.current.open_channel()
            self._channels[self._current] = channel
        return self.current, TimeSliceStub(channel)

    def close(self) -> None:
        """Close every open channel; later calls raise :class:`Unavailable`."""
        self._closed = True
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    async def unary(
        self,
        what: str,
        call: Callable[[TimeSliceStub, float], Awaitable[T]],
        *,
        budget: float,
        retry: bool = True,
    ) -> T:
        """Run one unary call, failing over to the next target on :class:`Unavailable`.

        ``call(stub, timeout)`` must pass ``timeout`` to the RPC. The whole call, retries and
        backoff included, takes at most ``budget`` seconds. With ``retry=False`` (calls that
        are not idempotent) the first failure is final.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        backoff = Backoff()
        tried: list[str] = []
        # With several replicas, one attempt may use only part of the budget: a replica that
        # hangs (paused, partitioned) must not eat all of it before we try the next one.
        share = budget if len(self.targets) < 2 or not retry else max(budget / 2, 0.2)
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Timeout(f"{what}: no answer within {budget:g}s")
            target, stub = self.stub()
            try:
                return await call(stub, min(remaining, share))
            except Exception as exc:
                error = map_error(exc, f"{what} via {target}")
                if error is None:
                    raise
                # Our own per-attempt deadline passed (not a typed timeout the server sent).
                hung = isinstance(exc, TimeoutError) and deadline - loop.time() > 0.05
                if not (isinstance(error, Unavailable) or hung) or not retry:
                    raise error from exc
                tried.append(str(error))
                log.debug("%s", error)
                self.rotate()
                delay = backoff.next_delay()
                if loop.time() + delay >= deadline:
                    raise Unavailable(
                        f"{what}: no orchestrator replica reachable within {budget:g}s "
                        f"(targets {', '.join(str(t) for t in self.targets)}; "
                        f"last error: {tried[-1]})"
                    ) from exc
                await asyncio.sleep(delay)
