"""The history checkers, fed planted violations: each must be flagged, and a clean history
of the same shape must pass. A checker that regressed into a no-op would fail here."""

from __future__ import annotations

import pytest

from timeslice_agent.journal import JournalEntry
from timeslice_tools.history import (
    Attempt,
    Hold,
    check_fencing,
    check_fifo,
    check_mutual_exclusion,
    check_nothing_lost,
    check_two_phase,
    purpose,
)


def hold(job: str, epoch: int, ticket: int, granted: float, released: float) -> Hold:
    return Hold(job, "g", epoch, ticket, granted, released)


def entry(
    node: str,
    switch: str,
    what: str,
    job: str,
    epoch: int,
    started: float,
    finished: float,
    status: str = "ok",
    group: str = "g",
) -> JournalEntry:
    kind = "checkpoint" if what == "evict" else "restore"
    return JournalEntry(
        node=node,
        directive_id=f"{switch}-{what}-{node}-{job}",
        group=group,
        epoch=epoch,
        kind=kind,
        job=job,
        status=status,
        error="",
        bytes_moved=0,
        started_at=started,
        finished_at=finished,
    )


def switch(
    epoch: int, t: float, evict: str, restore: str, nodes: tuple[str, ...] = ("n0", "n1")
) -> list[JournalEntry]:
    """A clean switch: every node checkpoints ``evict``, then every node restores ``restore``."""
    sid = f"s{epoch}"
    return [entry(n, sid, "evict", evict, epoch, t, t + 1) for n in nodes] + [
        entry(n, sid, "restore", restore, epoch, t + 1.5, t + 2) for n in nodes
    ]


# -- mutual exclusion ------------------------------------------------------------------------


def test_mutual_exclusion_passes_disjoint_holds() -> None:
    check_mutual_exclusion([hold("a", 10, 5, 0, 1), hold("b", 20, 8, 1, 2)])


def test_mutual_exclusion_flags_an_overlap() -> None:
    with pytest.raises(AssertionError, match="granted at"):
        check_mutual_exclusion([hold("a", 10, 5, 0, 1.5), hold("b", 20, 8, 1, 2)])


def test_mutual_exclusion_flags_an_epoch_granted_twice() -> None:
    with pytest.raises(AssertionError, match="granted twice"):
        check_mutual_exclusion([hold("a", 10, 5, 0, 1), hold("b", 10, 8, 1, 2)])


def test_mutual_exclusion_flags_an_empty_history() -> None:
    with pytest.raises(AssertionError, match="vacuously"):
        check_mutual_exclusion([])


# -- fifo --------------------------------------------------------------------------------------


def test_fifo_passes_grants_in_ticket_order() -> None:
    check_fifo([hold("a", 10, 5, 0, 1), hold("b", 20, 8, 1, 2), hold("a", 30, 12, 2, 3)])


def test_fifo_flags_an_inversion() -> None:
    with pytest.raises(AssertionError, match=r"out of enqueue order: \[\('b', 8, 'a', 6\)\]"):
        check_fifo([hold("a", 10, 5, 0, 1), hold("b", 20, 8, 1, 2), hold("a", 30, 6, 2, 3)])


def test_fifo_flags_a_grant_without_a_ticket_as_such() -> None:
    with pytest.raises(AssertionError, match="without a ticket"):
        check_fifo([hold("a", 160, 150, 0, 1), hold("b", 170, 0, 1, 2)])


# -- fencing ---------------------------------------------------------------------------------


def test_fencing_passes_growing_epochs() -> None:
    check_fencing(switch(10, 0, "a", "b") + switch(20, 3, "b", "a"), nodes=["n0", "n1"])


def test_fencing_flags_a_stale_epoch_executed() -> None:
    stale = entry("n1", "s5", "restore", "a", 5, 6, 6.5)
    with pytest.raises(AssertionError, match=r"n1/g: executed s5-restore-n1-a \(epoch 5\)"):
        check_fencing([*switch(10, 0, "a", "b"), stale])


def test_fencing_ignores_a_stale_epoch_refused() -> None:
    refused = entry("n1", "s5", "restore", "a", 5, 6, 6.5, status="stale_epoch")
    check_fencing([*switch(10, 0, "a", "b"), refused])


def test_fencing_flags_an_empty_journal() -> None:
    with pytest.raises(AssertionError, match="vacuously"):
        check_fencing([])
    refused_only = [entry("n0", "s1", "evict", "a", 1, 0, 1, status="refused")]
    with pytest.raises(AssertionError, match="vacuously"):
        check_fencing(refused_only)


def test_fencing_flags_a_node_with_a_silent_journal() -> None:
    with pytest.raises(AssertionError, match=r"node\(s\) \['n2'\]"):
        check_fencing(switch(10, 0, "a", "b"), nodes=["n0", "n1", "n2"])


# -- two-phase -------------------------------------------------------------------------------


def test_two_phase_passes_clean_switches_and_counts_them() -> None:
    summary = check_two_phase(switch(10, 0, "a", "b") + switch(20, 3, "b", "a"))
    assert (summary.switches, summary.committed, summary.rolled_back) == (2, 2, 0)
    assert (summary.checkpoints, summary.restores) == (4, 4)


def test_two_phase_flags_an_early_restore() -> None:
    entries = switch(10, 0, "a", "b")
    entries[3] = entry("n1", "s10", "restore", "b", 10, 0.5, 2)  # before n0/n1 checkpointed
    with pytest.raises(AssertionError, match="before the last checkpoint finished"):
        check_two_phase(entries)


def test_two_phase_flags_a_restore_after_a_refused_checkpoint() -> None:
    entries = switch(20, 3, "b", "a")
    entries[1] = entry("n1", "s20", "evict", "b", 20, 3, 4, status="refused")
    with pytest.raises(AssertionError, match=r"checkpoints did not succeed.*'n1', 'refused'"):
        check_two_phase(switch(10, 0, "a", "b") + entries)


def test_two_phase_flags_a_restore_after_a_failed_checkpoint() -> None:
    entries = switch(10, 0, "a", "b")
    entries[0] = entry("n0", "s10", "evict", "a", 10, 0, 1, status="failed")
    with pytest.raises(AssertionError, match="checkpoints did not succeed"):
        check_two_phase(entries)


def test_two_phase_flags_a_skipped_checkpoint() -> None:
    # b is on both nodes after epoch 10; epoch 20 restores a on n1 without checkpointing b.
    later = [e for e in switch(20, 3, "b", "a") if not (e.node == "n1" and e.kind == "checkpoint")]
    with pytest.raises(AssertionError, match=r"n1/g: a restored .* over b.*skipped checkpoint"):
        check_two_phase(switch(10, 0, "a", "b") + later)


def test_two_phase_flags_restores_with_no_checkpoint_at_all() -> None:
    restores_only = [e for e in switch(20, 3, "b", "a") if e.kind == "restore"]
    with pytest.raises(AssertionError, match="skipped checkpoint"):
        check_two_phase(switch(10, 0, "a", "b") + restores_only)


def test_two_phase_accepts_a_rollback_in_the_switch_epoch() -> None:
    # n1's checkpoint fails; n0's evicted job is put back under the same epoch.
    entries = [
        *switch(10, 0, "a", "b"),
        entry("n0", "s20", "evict", "b", 20, 3, 4),
        entry("n1", "s20", "evict", "b", 20, 3, 4.5, status="failed"),
        entry("n0", "s20", "rollback", "b", 20, 5, 6),
        entry("n1", "s20", "rollback", "b", 20, 5, 6),
    ]
    summary = check_two_phase(entries)
    assert (summary.switches, summary.committed, summary.rolled_back) == (2, 1, 1)
    # Then the retry, in a new epoch, completes.
    check_two_phase(entries + switch(30, 7, "b", "a"))


def test_two_phase_flags_a_switch_that_restores_and_rolls_back() -> None:
    entries = [*switch(10, 0, "a", "b"), entry("n0", "s10", "rollback", "a", 10, 3, 4)]
    with pytest.raises(AssertionError, match="both restored its waiter and rolled back"):
        check_two_phase(entries)


def test_two_phase_flags_a_rollback_before_its_checkpoint_finished() -> None:
    entries = [
        entry("n0", "s20", "evict", "b", 20, 3, 5),
        entry("n1", "s20", "evict", "b", 20, 3, 3.5, status="failed"),
        entry("n0", "s20", "rollback", "b", 20, 4, 6),
    ]
    with pytest.raises(AssertionError, match="rollback of b on n0 started"):
        check_two_phase(entries)


def test_two_phase_takes_a_directive_refused_while_shutting_down_then_executed() -> None:
    entries = switch(10, 0, "a", "b")
    entries.append(entry("n1", "s10", "evict", "a", 10, -1, -0.5, status="refused"))
    check_two_phase(entries)


def test_purpose_is_read_from_the_directive_id() -> None:
    assert purpose(entry("node-1", "abc123", "rollback", "job-a", 1, 0, 1)) == "rollback"
    assert purpose(entry("node-1", "abc123", "evict", "job-a", 1, 0, 1)) == "evict"
    assert purpose(entry("node-1", "abc123", "restore", "job-a", 1, 0, 1)) == "restore"


# -- nothing lost ------------------------------------------------------------------------------


def test_nothing_lost_passes_when_every_job_got_its_grants() -> None:
    attempts = [Attempt("a", "g", 0, 1), Attempt("b", "g", 0, 2), Attempt("b", "g", 3, None, "x")]
    check_nothing_lost(attempts, {"a": 1, "b": 1})


def test_nothing_lost_flags_a_starved_waiter() -> None:
    attempts = [Attempt("a", "g", 0, 1), Attempt("a", "g", 2, 3), Attempt("b", "g", 0, None, "T")]
    with pytest.raises(AssertionError, match=r"short of grants.*'b': \(0, 1\)"):
        check_nothing_lost(attempts, {"a": 2, "b": 1})


def test_nothing_lost_flags_an_attempt_left_hanging() -> None:
    attempts = [Attempt("a", "g", 0, 1), Attempt("b", "g", 0, None)]
    with pytest.raises(AssertionError, match="left hanging"):
        check_nothing_lost(attempts, {"a": 1})
