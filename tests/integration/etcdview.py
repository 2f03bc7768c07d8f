"""Read a deployment's keys straight from etcd, to check what a call changed (or did not)."""

from __future__ import annotations

from timeslice_orchestrator.store.etcd import EtcdClient


async def snapshot(endpoint: str, prefix: str) -> dict[str, tuple[bytes, int]]:
    """Every key under ``prefix`` with its value and mod revision."""
    client = EtcdClient([endpoint])
    try:
        _, kvs = await client.get_prefix(f"{prefix}/".encode())
        return {kv.key.decode(): (kv.value, kv.mod_revision) for kv in kvs}
    finally:
        await client.close()
