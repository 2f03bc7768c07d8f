"""``on_accelerators`` scopes (timeslice._scope) with a recording runner in place of the
client: acquire and yield around a block or a function (plain or async), the yield always
runs and never masks the body's error, a pool role is resolved at entry, and a scope pickles
as its client's. Scopes of real clients on a real cluster are in test_aio_client.py and
test_sync_client.py."""

from __future__ import annotations

import logging
import pickle

import pytest

from timeslice._scope import AcceleratorScope, _rebuild_scope
from timeslice._types import Grant
from timeslice.errors import InvalidArgument, NotHolder


class Runner:
    """Records every acquire and yield; ``yield_error`` makes yields fail."""

    job_id = "job-a"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.yield_error: Exception | None = None

    def _grant(self, group_id: str) -> Grant:
        return Grant(group_id, self.job_id, 3, 0.0, False, None, 0.0)

    def acquire_blocking(
        self, group_id: str, *, timeout: float | None = None, priority: int = 0
    ) -> Grant:
        self.calls.append(f"acquire {group_id} {timeout} {priority}")
        return self._grant(group_id)

    def yield_blocking(self, group_id: str) -> None:
        self.calls.append(f"yield {group_id}")
        if self.yield_error is not None:
            raise self.yield_error

    async def acquire(
        self, group_id: str, *, timeout: float | None = None, priority: int = 0
    ) -> Grant:
        return self.acquire_blocking(group_id, timeout=timeout, priority=priority)

    async def yield_(self, group_id: str) -> None:
        self.yield_blocking(group_id)


class Resolver:
    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def group_for(self, pool: str, role: str = "main") -> str:
        return self.group_for_blocking(pool, role)

    def group_for_blocking(self, pool: str, role: str = "main") -> str:
        self.asked.append((pool, role))
        return f"{pool}-{role}-group"


def test_a_block_holds_the_group_and_binds_the_grant() -> None:
    runner = Runner()
    with AcceleratorScope(runner, "g", 5.0, 2) as grant:
        assert grant.group_id == "g" and runner.calls == ["acquire g 5.0 2"]
    assert runner.calls == ["acquire g 5.0 2", "yield g"]


async def test_functions_plain_and_async_are_wrapped_and_keep_their_names() -> None:
    runner = Runner()
    scope = AcceleratorScope(runner, "g", None, 0)

    @scope
    def train(x: int) -> int:
        """Train."""
        runner.calls.append("train")
        return x + 1

    @scope
    async def rollout(x: int) -> int:
        runner.calls.append("rollout")
        return x * 2

    assert (train.__name__, train.__doc__) == ("train", "Train.")
    assert train(1) == 2 and train(2) == 3  # one scope, called many times
    assert await rollout(4) == 8
    assert runner.calls == ["acquire g None 0", "train", "yield g"] * 2 + [
        "acquire g None 0",
        "rollout",
        "yield g",
    ]


def test_a_generator_cannot_be_wrapped() -> None:
    def gen() -> object:
        yield 1

    with pytest.raises(InvalidArgument, match="cannot wrap generator function"):
        AcceleratorScope(Runner(), "g", None, 0)(gen)


def test_the_bodys_error_wins_over_a_failed_yield(caplog: pytest.LogCaptureFixture) -> None:
    runner = Runner()
    runner.yield_error = NotHolder("lost the hold")
    with pytest.raises(ValueError, match="the body"), caplog.at_level(logging.ERROR):
        with AcceleratorScope(runner, "g", None, 0):
            raise ValueError("the body")
    assert "yield of group g by job job-a failed after the body raised ValueError" in caplog.text
    # Without an error of the body, the failed yield is the error.
    with pytest.raises(NotHolder), AcceleratorScope(runner, "g", None, 0):
        pass


async def test_a_pool_role_is_resolved_at_entry() -> None:
    runner, resolver = Runner(), Resolver()
    scope = AcceleratorScope(runner, "", None, 0, pool="p", role="actor", resolver=resolver)
    assert scope.group_id == ""
    async with scope:
        pass
    with scope:
        pass
    assert resolver.asked == [("p", "actor")] * 2
    assert runner.calls == ["acquire p-actor-group None 0", "yield p-actor-group"] * 2
    assert "pool='p', role='actor'" in repr(scope)
    with pytest.raises(InvalidArgument, match="needs a client that resolves roles"):
        AcceleratorScope(runner, "", None, 0, pool="p")


class Owner:
    """A client that makes scopes: what a pickled scope is rebuilt from."""

    def on_accelerators(
        self,
        group_id: str | None = None,
        *,
        pool: str | None = None,
        role: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> AcceleratorScope:
        return AcceleratorScope(Runner(), group_id or "", timeout, priority, owner=self)


def test_a_scope_pickles_as_its_clients_and_only_with_one() -> None:
    owner = Owner()
    scope = AcceleratorScope(Runner(), "g", 9.0, 1, owner=owner)
    rebuild, args = scope.__reduce__()
    assert rebuild is _rebuild_scope and args == (owner, "g", 9.0, 1)
    with pytest.raises(TypeError, match="no client to be rebuilt from"):
        pickle.dumps(AcceleratorScope(Runner(), "g", None, 0))
