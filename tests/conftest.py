"""Shared fixtures: one real etcd per test worker, real local clusters per test, TLS by default.

Every test gets its own key prefix, so tests share the etcd server but never each other's state.

TLS is the default, as in a deployment: each worker makes one throw-away CA (``session_pki``),
clusters from ``cluster_factory`` serve mutual TLS with it (on a TLS etcd with client
certificates and auth), and every SDK client a test makes (in the test's process or as a
subprocess) finds the CA and the operator certificate in ``$TIMESLICE_TLS_*``. Plaintext is a
choice a test makes explicitly: ``cluster_factory(tls=False)``, ``insecure=True``,
``--insecure``, or a cluster's ``client_env``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from timeslice.tls import CA_ENV, CERT_ENV, INSECURE_ENV, KEY_ENV
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.dev.etcd import EtcdServer

# Variables that would choose plaintext for services or clients behind a test's back.
_PLAINTEXT = (INSECURE_ENV, "TIMESLICE_ORCHESTRATOR_INSECURE", "TIMESLICE_AGENT_INSECURE")


@pytest.fixture(scope="session")
def session_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """This worker's CA and certificates (node certificates are added as clusters need them)."""
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session", autouse=True)
def _tls_clients(session_pki: Pki) -> Iterator[None]:
    """Clients find the session's CA and the operator certificate (which may act as any job)
    in the environment; no variable chooses plaintext."""
    tls = {
        CA_ENV: str(session_pki.ca),
        CERT_ENV: str(session_pki.operator.cert),
        KEY_ENV: str(session_pki.operator.key),
    }
    saved = {k: os.environ.get(k) for k in (*tls, *_PLAINTEXT)}
    for key in _PLAINTEXT:
        os.environ.pop(key, None)
    os.environ.update(tls)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def plaintext_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's clients talk plaintext (``$TIMESLICE_INSECURE=1``, no TLS files)."""
    for key in (CA_ENV, CERT_ENV, KEY_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(INSECURE_ENV, "1")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A plaintext etcd without auth: store-level tests, and plaintext clusters."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def tls_etcd_server(
    tmp_path_factory: pytest.TempPathFactory, session_pki: Pki
) -> Iterator[EtcdServer]:
    """An etcd on ``session_pki``: client certificates required, auth on, the replicas' user
    limited to ``/timeslice/`` (what TLS clusters of the session share)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd-tls"), tls=session_pki)
    server.start()
    try:
        yield server
    finally:
        server.close()


ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def cluster_factory(
    request: pytest.FixtureRequest, session_pki: Pki, tmp_path: Path
) -> Iterator[ClusterFactory]:
    """Start LocalClusters on the session's etcd; all of them stop when the test ends.

    TLS unless the test passes ``tls=False``: the cluster uses ``session_pki`` and the TLS
    etcd (or, with ``etcd_endpoint=None``, a private TLS etcd), so the session's clients
    reach it as they are. A plaintext cluster shares the plaintext etcd; its clients need
    ``cluster.client_env`` or ``insecure=True``. ``etcd_members=3`` gives the cluster its own
    3-member etcd (``cluster.etcd_cluster``), every member named to each replica.
    """
    clusters: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        tls = kwargs.setdefault("tls", session_pki)
        if tls is True:  # the session's CA: its clients and its TLS etcd trust it
            tls = kwargs["tls"] = session_pki
        if kwargs.get("etcd_members", 1) > 1:
            kwargs.setdefault("etcd_endpoint", None)  # its own etcd cluster
        if "etcd_endpoint" not in kwargs:
            etcd = "tls_etcd_server" if tls else "etcd_server"
            server = request.getfixturevalue(etcd)
            assert isinstance(server, EtcdServer)
            kwargs["etcd_endpoint"] = server.endpoint
        kwargs.setdefault("base_dir", tmp_path / f"cluster{len(clusters)}")
        cluster = LocalCluster(**kwargs)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


# Folders in order of their tests' mean duration (CI's --durations): the longest start first,
# so that two workers end together on short unit tests instead of one finishing a soak alone.
_LONGEST_FIRST = (
    "faults",
    "multinode",
    "deploy",
    "compat",
    "integrations",
    "bench",
    "e2e",
    "integration",
    "dev",
    "sdk",
    "agent",
    "tracing",
    "fuzz",
    "unit",
)


_RANK = {folder: rank for rank, folder in enumerate(_LONGEST_FIRST)}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        folder = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        return _RANK.get(folder, len(_RANK))

    items.sort(key=rank)
