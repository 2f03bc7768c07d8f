"""The adapters' hold of a group (timeslice.integrations._hold): taken once however often the
framework's hooks say a phase begins, given back once, every hold recorded with its times, and
two threads never both acquiring. The adapters on a real cluster are in test_trl_grpo.py and
test_verl.py; here the client is a recorder of the two calls a hold makes."""

from __future__ import annotations

import threading
import time

import pytest

from timeslice._types import Grant
from timeslice.errors import InvalidArgument, Timeout
from timeslice.integrations._hold import GroupHold


class Client:
    """Records acquire and yield_, in order; ``gate`` holds an acquire until it is set."""

    job_id = "job-a"

    def __init__(self, *, fail: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = fail

    def acquire(self, group_id: str, *, timeout: float | None = None) -> Grant:
        self.calls.append(f"acquire {group_id} {timeout}")
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return Grant(group_id, self.job_id, 7, 0.0, True, "job-b", 0.1)

    def yield_(self, group_id: str) -> None:
        self.calls.append(f"yield {group_id}")


def test_repeated_hooks_acquire_once_and_give_back_once() -> None:
    client = Client()
    grants: list[tuple[str, int]] = []
    hold = GroupHold(client, "g", timeout=30, on_grant=lambda why, g: grants.append((why, g.epoch)))
    hold.enter("generation")
    hold.enter("generation")  # gradient accumulation: the hook fires again
    assert hold.held
    hold.leave()
    hold.leave()
    assert not hold.held
    assert client.calls == ["acquire g 30", "yield g"]
    assert grants == [("generation", 7)]
    (first,) = hold.holds
    assert first.reason == "generation" and first.restored
    assert first.requested_at <= first.granted_at <= first.released_at


def test_a_block_outside_the_phases_holds_and_inside_one_is_a_no_op() -> None:
    client = Client()
    hold = GroupHold(client, "g")
    with hold.hold("saving"):
        assert hold.held
    assert not hold.held
    hold.enter("training")
    with hold.hold("saving"):
        pass
    assert hold.held, "a block inside a phase must not end the phase's hold"
    assert [h.reason for h in hold.holds] == ["saving", "training"]


def test_a_failed_acquire_holds_nothing_and_records_nothing() -> None:
    hold = GroupHold(Client(fail=Timeout("no grant within 1s")), "g", timeout=1)
    with pytest.raises(Timeout):
        hold.enter("step")
    assert not hold.held and hold.holds == []
    hold.leave()  # nothing to give back


def test_two_threads_never_both_acquire() -> None:
    client = Client()
    client.gate.clear()
    hold = GroupHold(client, "g")
    threads = [threading.Thread(target=hold.enter, args=("step",)) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while not client.calls and time.monotonic() < deadline:
        time.sleep(0.001)
    client.gate.set()
    for thread in threads:
        thread.join(10)
    assert client.calls == ["acquire g None"]
    assert len(hold.holds) == 1


def test_a_malformed_group_is_refused_before_any_call() -> None:
    client = Client()
    with pytest.raises(InvalidArgument):
        GroupHold(client, "not a group!")
    assert client.calls == []
