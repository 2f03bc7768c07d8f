"""The llm-d (v1alpha1) API keeps creating a group on first acquire, as the reference's users
asked, even on a replica that refuses unknown groups to timeslice.v1 clients (docs/groups.md).
"""

from __future__ import annotations

import pytest

from tests.compat.conftest import V1Factory
from tests.conftest import ClusterFactory
from tests.integration.etcdview import snapshot
from timeslice import AsyncTimeSliceClient
from timeslice.errors import NotFound


async def test_v1alpha1_creates_groups_on_first_acquire_on_a_strict_replica(
    cluster_factory: ClusterFactory, v1alpha1: V1Factory
) -> None:
    cluster = cluster_factory(tls=False, agents=0, orchestrator_args=["--strict-groups"])
    async with AsyncTimeSliceClient(cluster.target, job_id="v1", insecure=True) as v1:
        with pytest.raises(NotFound):
            await v1.acquire("brand-new", timeout=20)
    async with v1alpha1(cluster.target) as client:
        got = await client.ok("Acquire", job_id="a", group_id="brand-new")
        assert got["success"], got
        assert (await client.ok("ListGroups"))["group_ids"] == ["brand-new"]
        assert any("/groups/brand-new/" in key for key in await snapshot(cluster))
        yielded = await client.ok("Yield", job_id="a", group_id="brand-new")
        assert yielded["success"], yielded
