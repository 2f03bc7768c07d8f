"""``timeslice orchestrator features show|enable|disable``: the deployment's features record.

What the deployment's replicas may do that a replica of an older version would misread
(store.handover; docs/operations.md, "Upgrades"). A new deployment starts with every feature
of the version that created it; one upgraded from an older version has none until an
operator runs ``enable`` once every replica runs this version or later, and ``disable``
before rolling back to an older one. Every action also counts the live holds an older
version would misread: a rollback waits, after ``disable``, until none is left. It talks
to etcd only, with the replicas' etcd options and their ``TIMESLICE_ORCHESTRATOR_*``
variables (``--etcd``, ``--prefix``, the etcd certificate), so it runs where a replica runs.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from timeslice.argv import OneLineParser
from timeslice.errors import TimeSliceError
from timeslice.tls import TlsFiles
from timeslice_orchestrator.config import ENV_PREFIX
from timeslice_orchestrator.store.etcd import EtcdClient, StoreError, parse_endpoints
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.handover import CURRENT_FEATURES
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import CorruptRecord, FeaturesRecord

ACTIONS = ("show", "enable", "disable")
_NAMED = 10  # groups named in the count of misread holds


@dataclass(frozen=True)
class Target:
    """Which deployment: its etcd and key prefix."""

    etcd: list[str]
    prefix: str
    etcd_tls: TlsFiles | None


def parse_args(argv: Sequence[str]) -> tuple[str, Target]:
    """The action and the deployment; exits with a usage error (2) on bad arguments."""
    p = OneLineParser(prog="timeslice orchestrator features", description=__doc__)
    p.add_argument("action", choices=ACTIONS)
    env = os.environ.get
    p.add_argument("--etcd", default=env(f"{ENV_PREFIX}ETCD", "127.0.0.1:2379"))
    p.add_argument("--prefix", default=env(f"{ENV_PREFIX}PREFIX", "/timeslice/default"))
    for name in ("ca", "cert", "key"):
        p.add_argument(f"--etcd-{name}", default=env(f"{ENV_PREFIX}ETCD_{name.upper()}") or None)
    p.add_argument(
        "--insecure",
        action="store_true",
        default=env(f"{ENV_PREFIX}INSECURE", "").strip().lower() in ("1", "true", "yes", "on"),
        help="allow a plaintext etcd (no --etcd-ca)",
    )
    a = p.parse_args(argv)
    try:
        etcd = parse_endpoints([a.etcd])
        tls = (
            None if a.etcd_ca is None and a.etcd_cert is None and a.etcd_key is None
            else TlsFiles(a.etcd_ca or "", a.etcd_cert, a.etcd_key)
        )  # fmt: skip
        prefix = Keyspace(a.prefix.rstrip("/")).prefix
    except (ValueError, TimeSliceError) as exc:
        p.error(str(exc))
    if tls is not None and not tls.ca:
        p.error("--etcd-cert and --etcd-key need --etcd-ca")
    if tls is None and not a.insecure:
        p.error("no TLS for etcd: give --etcd-ca/--etcd-cert/--etcd-key, or --insecure")
    return a.action, Target(etcd, prefix, tls)


def describe(record: FeaturesRecord | None) -> str:
    """One line per feature: its name and whether it is on."""
    shown = record if record is not None else FeaturesRecord()
    lines = [f"{name}: {'on' if on else 'off'}" for name, on in shown.switches().items()]
    if record is None:
        lines.append("(no features record: a deployment upgraded from an older version)")
    return "\n".join(lines)


def describe_misread(groups: Sequence[str], record: FeaturesRecord | None) -> str:
    """How many live holds a replica of an older version would misread, naming a few groups;
    with the feature off, when a rollback may go ahead."""
    named = ", ".join(sorted(groups)[:_NAMED]) + (", ..." if len(groups) > _NAMED else "")
    line = f"holds an older version would misread: {len(groups)}" + (
        f" ({named})" if groups else ""
    )
    if record is not None and record.one_transaction_hand_over:
        return line
    if groups:
        return line + "\n(each ends with its job's next yield: roll back once none is left)"
    return line + "\n(an older version may be started)"


async def apply(action: str, target: Target) -> str:
    """Carry out ``action`` on ``target``; returns what to print."""
    etcd = EtcdClient(target.etcd, tls=target.etcd_tls)
    try:
        store = GroupStore(etcd, Keyspace(target.prefix))
        if action == "enable":
            await store.set_features(CURRENT_FEATURES)
        elif action == "disable":
            await store.set_features(FeaturesRecord())
        stored = await store.features()
        record = stored.record if stored is not None else None
        misread = await store.misread_holds()
        return describe(record) + "\n" + describe_misread(misread, record)
    finally:
        await etcd.close()


def main(argv: Sequence[str]) -> int:
    action, target = parse_args(argv)
    try:
        print(asyncio.run(apply(action, target)))
    except CorruptRecord as exc:
        print(f"timeslice orchestrator features: the record is corrupt: {exc}", file=sys.stderr)
        print("  ('enable' or 'disable' writes it afresh)", file=sys.stderr)
        return 1
    except (StoreError, TimeoutError, OSError) as exc:
        print(f"timeslice orchestrator features: error: {exc}", file=sys.stderr)
        return 1
    return 0
