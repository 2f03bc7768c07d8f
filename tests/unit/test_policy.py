"""Which waiter a group serves next: fifo, priority and fair share, on views of real records."""

from __future__ import annotations

import pytest

from tests.unit.views import view, waiter
from timeslice_orchestrator.policy import Policy, order
from timeslice_orchestrator.store.mirror import GroupView


def served(policy: Policy, group: GroupView) -> list[str]:
    return [q.job for q in order(policy, group)]


def test_policy_names_are_the_config_values() -> None:
    assert [Policy(v) for v in ("fifo", "priority", "fair")] == [
        Policy.FIFO,
        Policy.PRIORITY,
        Policy.FAIR,
    ]


def test_fifo_serves_in_enqueue_order_whatever_the_priorities() -> None:
    queue = [waiter("c", 30, priority=9), waiter("a", 10), waiter("b", 20, priority=5)]
    assert served(Policy.FIFO, view(queue)) == ["a", "b", "c"]


def test_priority_serves_the_highest_first_and_fifo_among_equals() -> None:
    queue = [
        waiter("early-low", 10, priority=1),
        waiter("late-high", 40, priority=5),
        waiter("early-high", 20, priority=5),
        waiter("negative", 5, priority=-3),
        waiter("mid", 30, priority=2),
    ]
    assert served(Policy.PRIORITY, view(queue)) == [
        "early-high",
        "late-high",
        "mid",
        "early-low",
        "negative",
    ]


def test_fair_share_serves_the_least_held_time_per_weight_first() -> None:
    queue = [
        waiter("heavy", 10, priority=1),  # 30 s / 1 = 30
        waiter("weighted", 20, priority=4),  # 40 s / 4 = 10
        waiter("light", 30, priority=1),  # 20 s / 1 = 20
    ]
    held = {"heavy": 30.0, "weighted": 40.0, "light": 20.0}
    assert served(Policy.FAIR, view(queue, held=held)) == ["weighted", "light", "heavy"]


def test_fair_share_counts_a_job_never_seen_as_zero_and_weights_at_least_one() -> None:
    queue = [
        waiter("zero", 10, priority=0),  # weight max(1, 0) = 1: 5 s
        waiter("one", 20, priority=1),  # weight 1: 7 s
        waiter("negative", 30, priority=-7),  # weight 1, not a negative share: 6 s
        waiter("new", 40),  # not in the ledger: 0 s
    ]
    held = {"zero": 5.0, "one": 7.0, "negative": 6.0}
    assert served(Policy.FAIR, view(queue, held=held)) == ["new", "zero", "negative", "one"]


def test_fair_share_is_fifo_among_equal_shares_and_without_a_ledger() -> None:
    queue = [waiter("b", 20, priority=2), waiter("a", 10, priority=1), waiter("c", 30)]
    # 4 s / 2 == 2 s / 1: the earlier entry first; c has 0 s.
    assert served(Policy.FAIR, view(queue, held={"a": 2.0, "b": 4.0})) == ["c", "a", "b"]
    assert served(Policy.FAIR, view(queue)) == ["a", "b", "c"]


@pytest.mark.parametrize("policy", list(Policy))
def test_order_leaves_the_view_alone_and_keeps_every_waiter(policy: Policy) -> None:
    group = view(
        [waiter("a", 10, priority=1), waiter("b", 20, priority=3), waiter("c", 30, priority=2)],
        held={"a": 9.0, "b": 1.0},
    )
    before = [q.job for q in group.queue]
    result = order(policy, group)
    assert sorted(q.job for q in result) == ["a", "b", "c"]
    assert [q.job for q in group.queue] == before
    assert result is not group.queue


@pytest.mark.parametrize("policy", list(Policy))
def test_an_empty_queue_orders_to_nothing(policy: Policy) -> None:
    assert order(policy, view([])) == []
