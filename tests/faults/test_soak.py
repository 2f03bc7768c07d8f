"""The CI-sized soak: 90 s of 6 jobs on 3 replicas and 2 agents with replica kills, etcd pauses
and agent pauses; any violation of an invariant (two-phase order included) fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import soak

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_soak_with_replica_kills_and_pauses(tmp_path: Path) -> None:
    # A private etcd (no etcd_endpoint): pausing the shared one would stall other tests.
    report = await soak(90, every=(10.0, 20.0), seed=7, base_dir=tmp_path)
    print(report)
    assert report.kills >= 2
    assert report.etcd_pauses >= 1
    assert report.agent_pauses >= 1
    assert report.violations == []
    assert report.job_errors == {}
    assert all(n >= 20 for n in report.phases_per_job.values()), report.phases_per_job
    assert report.switches > 50
    assert report.ok
