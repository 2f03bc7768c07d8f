"""The switch plan: which nodes checkpoint and restore what, with members and co-residency."""

from __future__ import annotations

from tests.unit.views import GB, agent, agents, view
from timeslice_orchestrator.store.records import NodeStep
from timeslice_orchestrator.switch_plan import nodes_of, plan


def steps(*triples: tuple[str, str, str]) -> list[NodeStep]:
    return [NodeStep(node=n, evict=e, restore=r) for n, e, r in triples]


def test_nodes_of_are_the_nodes_with_a_worker_of_the_job_in_the_group() -> None:
    known = agents(
        agent("n2", {"a": GB, "b": GB}),
        agent("n1", {"a": GB}),
        agent("n3", {"b": GB}),
        agent("n4", {"a": GB}, group="other"),
    )
    assert nodes_of("g", "a", known) == ["n1", "n2"]
    assert nodes_of("g", "b", known) == ["n2", "n3"]
    assert nodes_of("other", "a", known) == ["n4"]
    assert nodes_of("g", "nobody", known) == []


def test_every_node_of_the_job_evicts_its_resident_and_restores_the_job() -> None:
    known = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB, "b": GB}))
    group = view(resident={"n1": ["a"], "n2": ["a"]})
    assert plan(group, "b", known) == steps(("n1", "a", "b"), ("n2", "a", "b"))


def test_nodes_where_the_job_is_resident_need_nothing() -> None:
    known = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB, "b": GB}))
    assert plan(view(resident={"n1": ["b"], "n2": ["b"]}), "b", known) == []
    assert plan(view(resident={"n1": ["b"], "n2": ["a"]}), "b", known) == steps(("n2", "a", "b"))


def test_an_empty_node_only_restores() -> None:
    known = agents(agent("n1", {"b": GB}), agent("n2", {"b": GB}))
    assert plan(view(resident={"n1": ["a"]}), "b", known) == steps(
        ("n1", "a", "b"), ("n2", "", "b")
    )
    assert plan(view(), "b", known) == steps(("n1", "", "b"), ("n2", "", "b"))


def test_nodes_where_the_job_has_no_worker_are_left_alone() -> None:
    known = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB}))
    group = view(resident={"n1": ["a"], "n2": ["a"]})
    assert plan(group, "b", known) == steps(("n1", "a", "b"))


def test_a_pinned_node_takes_part_even_without_a_worker_or_an_agent() -> None:
    known = agents(agent("n1", {"b": GB}), agent("n2", {"a": GB}))
    group = view(resident={"n1": ["a"], "n2": ["a"], "n9": ["a"]}, members=["n2", "n9"])
    assert plan(group, "b", known) == steps(("n1", "a", "b"), ("n2", "a", "b"), ("n9", "a", "b"))


def test_without_co_residency_every_other_job_leaves_least_recent_first() -> None:
    # Capacity for all of them, but co-residency is off: one job's state at a time.
    known = agents(agent("n1", {"a": GB, "b": GB, "c": GB}, capacity=10 * GB))
    group = view(resident={"n1": ["c", "a"]})
    assert plan(group, "b", known) == steps(("n1", "c", ""), ("n1", "a", "b"))


def test_co_residency_keeps_jobs_that_leave_room() -> None:
    known = agents(agent("n1", {"a": 2 * GB, "b": 3 * GB, "c": 4 * GB}, capacity=10 * GB))
    # a + c = 6 GB; b needs 3 GB of the 4 GB free: nothing leaves.
    group = view(resident={"n1": ["a", "c"]})
    assert plan(group, "b", known, co_residency=True) == steps(("n1", "", "b"))


def test_co_residency_evicts_least_recently_restored_until_the_job_fits() -> None:
    known = agents(
        agent("n1", {"a": 3 * GB, "b": 4 * GB, "c": 3 * GB, "d": 3 * GB}, capacity=10 * GB)
    )
    # c, a, d = 9 GB resident (c restored longest ago); b needs 4 GB, 1 GB free: c leaves
    # (4 GB free) and that is enough.
    group = view(resident={"n1": ["c", "a", "d"]})
    assert plan(group, "b", known, co_residency=True) == steps(("n1", "c", "b"))
    # With 12 GB of b, two must leave, still least recently restored first.
    big = agents(
        agent("n1", {"a": 3 * GB, "b": 7 * GB, "c": 3 * GB, "d": 3 * GB}, capacity=10 * GB)
    )
    assert plan(group, "b", big, co_residency=True) == steps(("n1", "c", ""), ("n1", "a", "b"))


def test_co_residency_clears_the_node_when_the_job_does_not_fit_at_all() -> None:
    known = agents(agent("n1", {"a": GB, "b": 20 * GB}, capacity=10 * GB))
    group = view(resident={"n1": ["a"]})
    assert plan(group, "b", known, co_residency=True) == steps(("n1", "a", "b"))


def test_co_residency_needs_a_capacity_and_an_agent() -> None:
    group = view(resident={"n1": ["a"], "n2": ["a"]}, members=["n2"])
    # n1 reports no capacity (one job at a time); n2 has no agent at all.
    known = agents(agent("n1", {"a": GB, "b": GB}, capacity=0))
    assert plan(group, "b", known, co_residency=True) == steps(("n1", "a", "b"), ("n2", "a", "b"))
    # Without a capacity, one job's state at a time, even where the sizes would add up.
    free = agents(agent("n1", {"a": GB, "b": 0, "c": 0}, capacity=0))
    together = view(resident={"n1": ["a", "c"]})
    assert plan(together, "b", free, co_residency=True) == steps(("n1", "a", ""), ("n1", "c", "b"))


def test_unannounced_state_counts_as_the_agents_default_size() -> None:
    # b announces 0 bytes: the agent's default (8 GB) counts, which does not fit beside a.
    known = agents(agent("n1", {"a": 4 * GB, "b": 0}, capacity=10 * GB, default_bytes=8 * GB))
    group = view(resident={"n1": ["a"]})
    assert plan(group, "b", known, co_residency=True) == steps(("n1", "a", "b"))
    small = agents(agent("n1", {"a": 4 * GB, "b": 0}, capacity=10 * GB, default_bytes=GB))
    assert plan(group, "b", small, co_residency=True) == steps(("n1", "", "b"))


def test_a_prefetch_never_evicts_the_holder() -> None:
    known = agents(agent("n1", {"h": 4 * GB, "a": 3 * GB, "b": 4 * GB}, capacity=10 * GB))
    group = view(resident={"n1": ["h", "a"]})  # h restored longest ago, but it holds the group
    # Evicting a (not h) makes room: the holder is skipped over.
    assert plan(group, "b", known, co_residency=True, protect="h") == steps(("n1", "a", "b"))
    # Unprotected, the least recently restored (h) would have gone instead.
    assert plan(group, "b", known, co_residency=True) == steps(("n1", "h", "b"))


def test_a_prefetch_that_would_evict_the_holder_has_no_plan() -> None:
    known = agents(agent("n1", {"h": 4 * GB, "b": 8 * GB}, capacity=10 * GB))
    assert plan(view(resident={"n1": ["h"]}), "b", known, co_residency=True, protect="h") is None
    # Without capacity figures a prefetch is never possible beside the holder.
    plain = agents(agent("n1", {"h": GB, "b": GB}))
    assert plan(view(resident={"n1": ["h"]}), "b", plain, co_residency=True, protect="h") is None


def test_a_prefetch_of_a_job_already_resident_has_nothing_to_do() -> None:
    known = agents(agent("n1", {"h": GB, "b": GB}, capacity=10 * GB))
    assert plan(view(resident={"n1": ["b", "h"]}), "b", known, co_residency=True, protect="h") == []
