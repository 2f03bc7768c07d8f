"""A prefetch that fails is harmless: the waiter keeps its place, and it is not retried in a
tight loop while the same hold lasts.

In process: a real driver over a real etcd and mirror; the agents are a stub router that
answers each directive as the test says (the boundary the driver talks to).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import cast

import pytest

from tests.integration.groupstore import (
    driver,
    enqueue,
    new_holder,
    open_session,
    queued,
    resident_revision,
)
from tests.integration.polling import until
from timeslice_orchestrator.driver import SwitchDriver
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.reconcile import DriverConfig
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import Grant, GroupStore
from timeslice_orchestrator.store.records import (
    AgentRecord,
    GroupStats,
    ResidentRecord,
    WorkerRecord,
)
from timeslice_proto.timeslice.v1 import AckStatus, Directive, DirectiveAck, DirectiveKind

GB = 10**9


class _Agents:
    """Answers directives as ``answer`` says, and keeps every directive it was sent."""

    def __init__(self, answer: Callable[[Directive], AckStatus]) -> None:
        self._answer = answer
        self.sent: list[Directive] = []

    async def execute(self, node: str, directive: Directive, timeout: float) -> DirectiveAck:
        self.sent.append(directive)
        status = self._answer(directive)
        error = "" if status is AckStatus.OK else "refused by the test"
        return DirectiveAck(directive_id=directive.directive_id, status=status, error=error)

    async def fence(self, node: str, reason: str) -> None:
        raise AssertionError(f"nothing should be fenced ({node}: {reason})")

    def of(self, kind: DirectiveKind) -> list[Directive]:
        return [d for d in self.sent if d.kind == kind]


@asynccontextmanager
async def _held(
    store: GroupStore, agents: _Agents, resident: list[str]
) -> AsyncIterator[tuple[Mirror, SwitchDriver]]:
    """Group g held by a, with ``resident`` on node n0's devices (80 GB, 30 GB a job), b
    queued, and a prefetching driver running on the stub agents."""
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    switch_driver: SwitchDriver | None = None
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        auth = await driver(store)
        workers = [WorkerRecord(job, "g", 1, 30 * GB) for job in "abc"]
        agent = AgentRecord("n0", "r1", "sim", True, 1.0, workers, capacity_bytes=80 * GB)
        await store.publish_agent(agent, auth.lease, fence_revision=0)
        await enqueue(store, await open_session(store, "a"))
        a = await queued(store, "g", "a")
        epoch = await store.grant(
            auth,
            Grant(
                "g",
                a,
                new_holder(a),
                ResidentRecord({"n0": resident}),
                await resident_revision(store),
                GroupStats(grants=1),
            ),
        )
        assert epoch is not None
        await enqueue(store, await open_session(store, "b"))
        await until(lambda: mirror.group("g").queued("b") is not None)
        config = DriverConfig(replica_id=auth.replica_id, co_residency=True, prefetch=True)
        router = cast(DirectiveRouter, agents)
        switch_driver = SwitchDriver(store, mirror, router, Metrics(), config, auth.lease)
        switch_driver.start()
        yield mirror, switch_driver
    finally:
        if switch_driver is not None:
            await switch_driver.stop()
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


async def test_a_failed_prefetch_restore_leaves_the_waiter_queued(store: GroupStore) -> None:
    def answer(directive: Directive) -> AckStatus:
        return AckStatus.FAILED if directive.kind == DirectiveKind.RESTORE else AckStatus.OK

    agents = _Agents(answer)
    async with _held(store, agents, ["a"]) as (mirror, _):  # b fits beside a: nothing leaves
        await until(lambda: bool(agents.of(DirectiveKind.RESTORE)))
        # The prefetch's end as written (its failure noted), not merely no switch in view:
        # the mirror may not have shown the switch record yet.
        await until(
            lambda: mirror.group("g").switch is None and "b:" in mirror.group("g").stats.last_error
        )
        await queued(store, "g", "b")  # still in line: the switch will restore it
        assert await store.etcd.get(store.keys.fault("g", "b")) is None
        view = mirror.group("g")
        assert view.stats.faults == 0
        assert view.holder is not None and view.holder.record.job == "a"
        assert agents.of(DirectiveKind.RESTORE)[0].job_id == "b"


@pytest.mark.parametrize("refused", ["checkpoint", "restore"])
async def test_a_failing_prefetch_is_retried_at_the_backoffs_pace(
    store: GroupStore, refused: str
) -> None:
    def no(directive: Directive) -> bool:
        if refused == "checkpoint":
            return directive.kind == DirectiveKind.CHECKPOINT and directive.job_id == "c"
        return directive.kind == DirectiveKind.RESTORE and directive.job_id == "b"

    agents = _Agents(lambda d: AckStatus.FAILED if no(d) else AckStatus.OK)
    # b fits beside a only once c leaves; the agent refuses c's checkpoint (rolled back:
    # c stays) or b's restore (c is gone by then) every time.
    async with _held(store, agents, ["c", "a"]) as (mirror, _):
        await until(lambda: any(no(d) for d in agents.sent))
        await asyncio.sleep(1.5)
        tries = sum(no(d) for d in agents.sent)  # each prefetch is refused once
        assert tries <= 5, f"{tries} prefetches in 1.5 s"
        await until(lambda: mirror.group("g").switch is None)
        await queued(store, "g", "b")
        left = ["c", "a"] if refused == "checkpoint" else ["a"]
        assert mirror.group("g").residency().nodes == {"n0": left}


async def test_the_retries_of_a_waiter_that_left_are_forgotten(store: GroupStore) -> None:
    """A failed prefetch is remembered (to pace the next one) only while its waiter waits:
    a replica does not collect the retries of every waiter that ever left."""
    agents = _Agents(
        lambda d: AckStatus.FAILED if d.kind == DirectiveKind.RESTORE else AckStatus.OK
    )
    async with _held(store, agents, ["a"]) as (mirror, switch_driver):
        await until(lambda: bool(agents.of(DirectiveKind.RESTORE)))
        await until(lambda: mirror.group("g").switch is None)
        assert len(switch_driver.retries) == 1
        await store.etcd.delete(store.keys.queue_entry("g", "b"))  # b leaves the queue
        await until(lambda: not mirror.group("g").queue)
        await until(lambda: len(switch_driver.retries) == 0)
