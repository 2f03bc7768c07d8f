"""Shared fixtures: one real etcd per test worker, real local clusters per test.

Every test gets its own key prefix, so tests share the etcd server but never each other's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.dev.etcd import EtcdServer


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.close()


ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def cluster_factory(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[ClusterFactory]:
    """Start LocalClusters on the shared etcd; all of them stop when the test ends."""
    clusters: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        kwargs.setdefault("etcd_endpoint", etcd_server.endpoint)
        kwargs.setdefault("base_dir", tmp_path / f"cluster{len(clusters)}")
        cluster = LocalCluster(**kwargs)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
