"""The node's fences (timeslice_agent.fencing): which directives are stale and why, told apart
by cause; what a previous run left is taken over; the wire form of the accepted epochs."""

from __future__ import annotations

from timeslice_agent.fencing import Fencing
from timeslice_proto.timeslice.v1 import GroupEpoch, StaleCause


def test_an_epoch_below_the_groups_highest_is_stale_and_equal_is_not() -> None:
    fencing = Fencing()
    assert fencing.stale("g", 1) is None  # a group never seen: anything goes
    fencing.accept("g", 5)
    # A switch's checkpoint and restore share one epoch: equal is accepted.
    assert fencing.stale("g", 5) is None
    assert fencing.stale("g", 6) is None
    stale = fencing.stale("g", 4)
    assert stale is not None and stale.cause is StaleCause.GROUP_EPOCH
    assert "epoch 5 was already accepted for group g" in stale.reason
    assert fencing.stale("other", 4) is None  # fences are per group


def test_a_node_fence_refuses_every_group_below_it() -> None:
    fencing = Fencing()
    fencing.accept("g", 3)
    assert fencing.adopt(10)
    assert fencing.revision == 10
    for group, epoch in (("g", 9), ("new", 1)):
        stale = fencing.stale(group, epoch)
        assert stale is not None and stale.cause is StaleCause.NODE_FENCED
        assert "fenced out at revision 10" in stale.reason
    assert fencing.stale("new", 10) is None
    # The node fence is checked first: a directive below both names the node's fence.
    fencing.accept("g", 12)
    stale = fencing.stale("g", 8)
    assert stale is not None and stale.cause is StaleCause.NODE_FENCED


def test_a_fence_only_moves_forward() -> None:
    fencing = Fencing()
    assert fencing.adopt(10)
    assert not fencing.adopt(10)
    assert not fencing.adopt(7)
    assert fencing.revision == 10


def test_what_a_previous_run_left_is_taken_over_and_copies_are_copies() -> None:
    fencing = Fencing()
    left = {"g": 4, "h": 2}
    fencing.load(left, 3)
    left["g"] = 0  # the caller's dict is not the fence's
    assert fencing.epochs == {"g": 4, "h": 2}
    assert fencing.revision == 3
    fencing.epochs["g"] = 0
    assert fencing.stale("g", 3) is not None
    assert fencing.epoch_list() == [
        GroupEpoch(group_id="g", epoch=4),
        GroupEpoch(group_id="h", epoch=2),
    ]
