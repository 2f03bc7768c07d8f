"""Which groups are known (docs/groups.md): served by a node, or created by an operator."""

from __future__ import annotations

from timeslice_orchestrator.grants import group_known, unknown_group_text
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import AgentRecord, WorkerRecord


def view(group: str, pinned: list[str] | None = None) -> GroupView:
    return GroupView(
        group, 1, True, None, [], None, None, None, 0, static_members=list(pinned or [])
    )


def agent(node: str, *groups: str) -> AgentRecord:
    workers = [WorkerRecord(job=f"j-{g}", group=g, pid=100 + i, state_bytes=0)
               for i, g in enumerate(groups)]  # fmt: skip
    return AgentRecord(node, "r0", "sim", True, 0.0, workers=workers)


def test_a_group_is_known_when_a_node_serves_it_or_an_operator_created_it() -> None:
    agents = {"n0": agent("n0", "trainer-group"), "n1": agent("n1", "sampler")}
    assert group_known(view("trainer-group"), "job-a", agents)  # a worker registered
    assert group_known(view("typo", ["n0"]), "job-a", agents)  # pinned nodes
    assert group_known(view("typo"), "", agents)  # an operator's meta record
    # Created by a job's acquire, served by nobody: still unknown, however often acquired.
    assert not group_known(view("trainer-grup"), "job-a", agents)
    assert not group_known(view("trainer-grup"), None, agents)
    assert not group_known(view("trainer-group"), "job-a", {})


def test_the_text_names_the_group_the_cause_and_the_fixes() -> None:
    text = unknown_group_text("trainer-grup")
    assert text.startswith("group trainer-grup is not known: no node serves it")
    assert "timeslice groups" in text and "timeslice members trainer-grup --set NODES" in text
