"""``on_accelerators``: hold a group for the duration of a function or a ``with`` block."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, TypeVar, cast

from timeslice._types import Grant
from timeslice.errors import InvalidArgument

log = logging.getLogger("timeslice")

F = TypeVar("F", bound=Callable[..., Any])


class ScopeRunner(Protocol):
    """What a scope needs to acquire and yield from sync and async code.

    :class:`timeslice.runner.ClientRunner` (``client.runner``) provides it.
    """

    @property
    def job_id(self) -> str: ...

    def acquire_blocking(
        self, group_id: str, *, timeout: float | None = None, priority: int = 0
    ) -> Grant: ...

    def yield_blocking(self, group_id: str) -> None: ...

    async def acquire(
        self, group_id: str, *, timeout: float | None = None, priority: int = 0
    ) -> Grant: ...

    async def yield_(self, group_id: str) -> None: ...


class ScopeOwner(Protocol):
    """A client that makes scopes (both clients): what a pickled scope is rebuilt from."""

    def on_accelerators(
        self,
        group_id: str | None = None,
        *,
        pool: str | None = None,
        role: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> AcceleratorScope: ...


class RoleResolver(Protocol):
    """The group of a role in a placement pool (the asyncio client: ``group_for``), from
    async code and from blocking code; cached by the client for its life."""

    async def group_for(self, pool: str, role: str = "main") -> str: ...

    def group_for_blocking(self, pool: str, role: str = "main") -> str: ...


def _rebuild_scope(
    owner: ScopeOwner,
    group_id: str,
    timeout: float | None,
    priority: int,
    pool: str | None = None,
    role: str | None = None,
) -> AcceleratorScope:
    if pool is not None:
        return owner.on_accelerators(pool=pool, role=role, timeout=timeout, priority=priority)
    return owner.on_accelerators(group_id, timeout=timeout, priority=priority)


class AcceleratorScope:
    """Runs code between ``acquire`` and ``yield_`` of one group.

    Returned by ``client.on_accelerators(group_id)``. Use it as a decorator on a plain or an
    ``async`` function (the wrapper keeps the function's name, docstring and kind), or as a
    ``with`` / ``async with`` block, which binds the :class:`~timeslice.Grant`::

        @client.on_accelerators(group_id="trainer-group")
        def train_phase(model, batch): ...

        async with client.on_accelerators("trainer-group") as grant: ...

    The yield always runs, in a ``finally``. If the body raised, a failing yield is logged and
    the body's exception is the one that propagates. The scope holds no per-entry state, so
    one decorated function may be called many times; two overlapping holds of the same group
    by the same client are refused with :class:`~timeslice.errors.AlreadyExists`.

    A scope of a role in a placement pool (``on_accelerators(pool=..., role=...)``) asks the
    orchestrator for the role's group at its first entry (docs/placement.md); the client keeps
    the answer for its life, so every entry acquires and yields that same group.
    """

    def __init__(
        self,
        runner: ScopeRunner,
        group_id: str,
        timeout: float | None,
        priority: int,
        *,
        owner: ScopeOwner | None = None,
        pool: str | None = None,
        role: str = "main",
        resolver: RoleResolver | None = None,
    ) -> None:
        if pool is not None and resolver is None:
            raise InvalidArgument("a scope of a pool role needs a client that resolves roles")
        self._runner = runner
        self.group_id = group_id
        """The group; for a pool role, "" until the first entry resolved it."""
        self.pool = pool
        self.role = role
        self._resolver = resolver
        self.timeout = timeout
        self.priority = priority
        # The client that made this scope: a pickled scope (a decorated function sent to a
        # Ray task or actor) is rebuilt as the same scope of that client's copy.
        self._owner = owner

    def __reduce__(self) -> tuple[Any, ...]:
        if self._owner is None:
            raise TypeError("this AcceleratorScope has no client to be rebuilt from")
        args = (self._owner, self.group_id, self.timeout, self.priority)
        if self.pool is not None:
            return (_rebuild_scope, (*args, self.pool, self.role))
        return (_rebuild_scope, args)

    def __repr__(self) -> str:
        where = f"group_id={self.group_id!r}"
        if self.pool is not None:
            where = f"pool={self.pool!r}, role={self.role!r}, {where}"
        return (
            f"AcceleratorScope(job_id={self._runner.job_id!r}, {where}, "
            f"timeout={self.timeout!r}, priority={self.priority})"
        )

    def _group_blocking(self) -> str:
        if self._resolver is not None and self.pool is not None:
            self.group_id = self._resolver.group_for_blocking(self.pool, self.role)
        return self.group_id

    async def _group(self) -> str:
        if self._resolver is not None and self.pool is not None:
            self.group_id = await self._resolver.group_for(self.pool, self.role)
        return self.group_id

    def __call__(self, fn: F) -> F:
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            # A generator would hold the group across arbitrary suspensions by its consumer.
            raise InvalidArgument(
                f"on_accelerators cannot wrap generator function {fn.__qualname__}; "
                "use `with client.on_accelerators(...)` inside it instead"
            )
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with self:
                    return await fn(*args, **kwargs)

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return cast(F, wrapper)

    def __enter__(self) -> Grant:
        return self._runner.acquire_blocking(
            self._group_blocking(), timeout=self.timeout, priority=self.priority
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._runner.yield_blocking(self.group_id)
        except Exception as yield_error:
            if exc is None:
                raise
            self._log_masked(yield_error, exc)

    async def __aenter__(self) -> Grant:
        return await self._runner.acquire(
            await self._group(), timeout=self.timeout, priority=self.priority
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._runner.yield_(self.group_id)
        except Exception as yield_error:
            if exc is None:
                raise
            self._log_masked(yield_error, exc)

    def _log_masked(self, yield_error: Exception, body_error: BaseException) -> None:
        log.error(
            "yield of group %s by job %s failed after the body raised %s; "
            "re-raising the body's exception",
            self.group_id,
            self._runner.job_id,
            type(body_error).__name__,
            exc_info=yield_error,
        )
