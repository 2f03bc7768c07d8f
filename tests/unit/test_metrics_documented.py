"""Every series the orchestrator and the agent export is in docs/metrics.md, and nothing else is.

The exported names come from the services' own Prometheus registries: a real ``Orchestrator``
(built, not started: its registry then holds every metric and every collector the app
registers, the per-group ones and the etcd batching ones included) and a real ``AgentMetrics``
(the agent's whole registry). Names are compared as a scrape shows them: counters with
``_total``. A series added to the code without a line in the doc fails here, as does a doc line
for a series that no longer exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from timeslice_agent.metrics import AgentMetrics
from timeslice_orchestrator.app import Orchestrator
from timeslice_orchestrator.config import parse_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _exposed(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names.add(family.name + suffix)
    return names


async def exported() -> set[str]:
    """Every series name a replica's and an agent's ``/metrics`` can show.

    Built on a running loop (the replica's etcd client opens grpc.aio channels, which take the
    running loop; without one they depend on what an earlier test left as the default)."""
    replica = Orchestrator(parse_args(["--etcd", "127.0.0.1:1", "--insecure"]))
    try:
        agent = AgentMetrics(node="node-0", backend="sim", emulated=True)
        return _exposed(replica.metrics.registry) | _exposed(agent.registry)
    finally:
        await replica.etcd.close()


def _expand(token: str) -> set[str]:
    """``timeslice_group_{grants,faults}_total{group}`` -> the two names, labels dropped."""
    token = re.sub(r"\{[^}]*\}$", "", token)  # the labels
    match = re.search(r"\{([^}]*)\}", token)
    if match is None:
        return {token}
    head, tail = token[: match.start()], token[match.end() :]
    return {n for part in match.group(1).split(",") for n in _expand(head + part.strip() + tail)}


def documented(text: str) -> set[str]:
    """The series named in the first column of the doc's tables."""
    names: set[str] = set()
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not line.lstrip().startswith("|"):
            continue
        for token in re.findall(r"`(timeslice_[^`]+)`", cells[1]):
            names |= _expand(token)
    return names


def test_brace_lists_and_labels_are_read_as_the_names_they_stand_for() -> None:
    doc = (
        "| `timeslice_group_{grants,faults}_total{group}` | counter | x |\n"
        "| `timeslice_waiters` | gauge | y, not `timeslice_other` |\n"
        "prose `timeslice_prose` is not a table row\n"
    )
    assert documented(doc) == {
        "timeslice_group_grants_total",
        "timeslice_group_faults_total",
        "timeslice_waiters",
    }


async def test_every_exported_series_is_documented_and_every_documented_one_exported() -> None:
    names = await exported()
    # The registries really were read: a replica's and an agent's best-known series are there.
    assert {"timeslice_grants_total", "timeslice_group_held", "timeslice_agent_jobs"} <= names
    doc = documented(DOC.read_text())
    assert not names - doc, f"exported but not in docs/metrics.md: {sorted(names - doc)}"
    assert not doc - names, f"in docs/metrics.md but not exported: {sorted(doc - names)}"
