"""``python -m timeslice_orchestrator features show|enable|disable [replica flags]``.

What the deployment's replicas may do that a replica of an older version would misread
(store.handover; docs/operations.md, "Upgrades"). A new deployment starts with every feature
of the version that created it; one upgraded from an older version has none until an
operator runs ``enable`` once every replica runs this version or later, and ``disable``
before rolling back to an older one. The command takes the replica's own flags and
environment (``--etcd``, ``--prefix``, etcd TLS), so it runs where a replica runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Sequence

from timeslice_orchestrator.config import OrchestratorConfig, parse_args
from timeslice_orchestrator.store.etcd import EtcdClient, StoreError
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.handover import CURRENT_FEATURES
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import FeaturesRecord

ACTIONS = ("show", "enable", "disable")
USAGE = f"usage: python -m timeslice_orchestrator features {{{','.join(ACTIONS)}}} [replica flags]"


def describe(record: FeaturesRecord | None) -> str:
    """One line per feature: its name and whether it is on."""
    shown = record if record is not None else FeaturesRecord()
    fields = dataclasses.fields(FeaturesRecord)
    lines = [f"{f.name}: {'on' if getattr(shown, f.name) else 'off'}" for f in fields]
    if record is None:
        lines.append("(no features record: a deployment upgraded from an older version)")
    return "\n".join(lines)


async def apply(action: str, config: OrchestratorConfig) -> str:
    """Carry out ``action`` on the deployment ``config`` names; returns what to print."""
    etcd = EtcdClient(config.etcd, tls=config.etcd_tls)
    try:
        store = GroupStore(etcd, Keyspace(config.prefix))
        if action == "enable":
            await store.set_features(CURRENT_FEATURES)
        elif action == "disable":
            await store.set_features(FeaturesRecord())
        stored = await store.features()
        return describe(stored.record if stored is not None else None)
    finally:
        await etcd.close()


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ACTIONS:
        print(USAGE, file=sys.stderr)
        return 2
    config = parse_args(argv[1:])
    try:
        print(asyncio.run(apply(argv[0], config)))
    except (StoreError, TimeoutError, OSError) as exc:
        print(f"timeslice orchestrator features: error: {exc}", file=sys.stderr)
        return 1
    return 0
