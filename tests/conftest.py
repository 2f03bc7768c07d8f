"""Shared fixtures: one real etcd per test worker, real local clusters per test.

Every test gets its own key prefix, so tests share the etcd server but never each other's state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.dev.etcd import EtcdServer


@pytest.fixture(scope="session", autouse=True)
def _plaintext_unless_told() -> Iterator[None]:
    """Clients and services the tests start outside a TLS cluster talk in plaintext.

    Plaintext must be chosen explicitly (timeslice.tls); a TLS cluster's clients get their
    certificates from ``cluster.client_env`` or their arguments, which win over this.
    """
    saved = {k: os.environ.get(k) for k in _INSECURE}
    os.environ.update(dict.fromkeys(_INSECURE, "1"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_INSECURE = ("TIMESLICE_INSECURE", "TIMESLICE_ORCHESTRATOR_INSECURE", "TIMESLICE_AGENT_INSECURE")


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
