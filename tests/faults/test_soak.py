"""The CI-sized soak: 90 s of 6 jobs on 3 replicas and 2 agents with random replica kills."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import soak
from timeslice_tools.dev.etcd import EtcdServer

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_soak_with_replica_kills(etcd_server: EtcdServer, tmp_path: Path) -> None:
    report = await soak(
        90, every=(20.0, 40.0), seed=7, etcd_endpoint=etcd_server.endpoint, base_dir=tmp_path
    )
    print(report)
    assert report.kills >= 2
    assert report.violations == []
    assert report.job_errors == {}
    assert all(n >= 20 for n in report.phases_per_job.values()), report.phases_per_job
    assert report.switches > 50
