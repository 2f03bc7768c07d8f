"""The store's errors (store/etcd/errors.py): what a caller that catches the family gets. The
follower lists again on any MustRelist, so every way a watch or listing cannot go on must be
one; each carries what the caller needs to say why."""

from __future__ import annotations

import pytest

from timeslice_orchestrator.store.etcd.errors import (
    Compacted,
    EtcdRewound,
    LeaseExpired,
    MustRelist,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WatchTooLarge,
)


@pytest.mark.parametrize(
    "error", [Compacted(5), WatchCompacted(5), EtcdRewound("x"), WatchTooLarge("x")]
)
def test_every_reason_to_list_again_is_a_must_relist(error: StoreError) -> None:
    assert isinstance(error, MustRelist)


@pytest.mark.parametrize("error", [StoreUnavailable("x"), LeaseExpired("x")])
def test_an_outage_or_a_lost_lease_is_not_a_reason_to_list_again(error: StoreError) -> None:
    # An outage is retried where it happened; relisting would not help and costs a full read.
    assert isinstance(error, StoreError) and not isinstance(error, MustRelist)


def test_a_compaction_says_up_to_which_revision() -> None:
    error = WatchCompacted(1234)
    assert isinstance(error, Compacted)
    assert error.compact_revision == 1234
    assert str(error) == "revision compacted up to 1234"
