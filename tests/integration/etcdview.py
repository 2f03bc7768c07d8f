"""Read a deployment's keys straight from etcd, to check what a call changed (or did not)."""

from __future__ import annotations

from timeslice_orchestrator.store.etcd import EtcdClient
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import FeaturesRecord
from timeslice_tools.dev.cluster import LocalCluster


def etcd_client(cluster: LocalCluster, *, timeout: float = 5.0) -> EtcdClient:
    """A client of the cluster's etcd that reads and writes as its replicas do (their etcd
    certificate when the etcd has TLS)."""
    return EtcdClient([cluster.etcd_endpoint], tls=cluster.etcd_tls, timeout=timeout)


async def snapshot(cluster: LocalCluster) -> dict[str, tuple[bytes, int]]:
    """Every key under the cluster's prefix with its value and mod revision, but the beacon:
    a quiet replica writes it to check its watch (``Mirror.catch_up``), not a call."""
    prefix = cluster.prefix
    beacon = Keyspace(prefix).beacon()
    client = etcd_client(cluster)
    try:
        _, kvs = await client.get_prefix(f"{prefix}/".encode())
        return {kv.key.decode(): (kv.value, kv.mod_revision) for kv in kvs if kv.key != beacon}
    finally:
        await client.close()


async def set_features(cluster: LocalCluster, record: FeaturesRecord) -> None:
    """Write the deployment's features record, as ``python -m timeslice_orchestrator features``
    does (``FeaturesRecord()``: what a deployment upgraded from an older version has)."""
    client = etcd_client(cluster)
    try:
        await client.put(Keyspace(cluster.prefix).features(), record.encode())
    finally:
        await client.close()
