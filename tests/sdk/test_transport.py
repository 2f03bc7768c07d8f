"""The SDK's transport: which replica calls go to after failures."""

from __future__ import annotations

from timeslice._transport import Transport
from timeslice.targets import HostPort

R0, R1, R2 = HostPort("r0", 1), HostPort("r1", 2), HostPort("r2", 3)


def test_loops_that_saw_one_replica_fail_move_away_from_it_once() -> None:
    """The session's keepalive and an Acquire stream share the transport. Both see r0 fail
    (it paused); the second to report it must not move calls on again, back towards r0 in a
    pair of replicas, or past a healthy r1."""
    pair = Transport([R0, R1])
    pair.rotate(R0)  # the keepalive's call timed out on r0
    pair.rotate(R0)  # then the Acquire stream on r0 failed
    assert pair.current == R1

    three = Transport([R0, R1, R2])
    three.rotate(R0)
    three.rotate(R0)
    assert three.current == R1


def test_a_failure_of_the_current_replica_moves_on_round_robin() -> None:
    transport = Transport([R0, R1, R2])
    for failed, then in ((R0, R1), (R1, R2), (R2, R0)):
        transport.rotate(failed)
        assert transport.current == then
