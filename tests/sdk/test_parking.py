"""The offloader's bookkeeping (timeslice._parking) with real CPU torch: how storages are packed
into host buffers, which storages an offload takes, which tensors cannot be freed, and when a
kept host copy is stale. The offload itself is in tests/sdk/test_offload.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from timeslice._parking import (
    ALIGN,
    Kept,
    lay_out,
    refuse_fixed,
    same_layout,
    storage_key,
    storages_of,
    versions,
)
from timeslice.errors import InvalidArgument


def _storage(nbytes: int) -> torch.UntypedStorage:
    return torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()


def test_storages_are_packed_aligned_into_equal_buffers_across_lanes() -> None:
    a, b = _storage(700), _storage(1500)
    slots, buffers = lay_out([a, b], [], chunk=1024, lane=1, lanes=2)
    # a: bytes 0-699 of buffer 0; b starts at the next 512-byte boundary (1024), buffer 1.
    assert [buf.numel() for buf in buffers] == [1024, 1024, 1024 + 1500 - 2048]
    assert [(p.start, p.host.numel(), p.lane) for p in slots[0].pieces] == [(0, 700, 1)]
    assert [(p.start, p.host.numel(), p.lane) for p in slots[1].pieces] == [
        (0, 1024, 0),
        (1024, 476, 1),
    ]
    assert [s.nbytes for s in slots] == [700, 1500]
    assert slots[1].pieces[0].host.data_ptr() == buffers[1].data_ptr()
    assert ALIGN == 512


def test_buffers_big_enough_are_reused_and_an_odd_chunk_is_not_aligned() -> None:
    _, buffers = lay_out([_storage(100)], [], chunk=1000, lane=0, lanes=1)
    again, reused = lay_out([_storage(60), _storage(40)], buffers, chunk=1000, lane=0, lanes=1)
    assert reused[0] is buffers[0]  # same host memory: no new allocation per switch
    # 1000 is not a multiple of the alignment: pieces follow each other byte for byte.
    assert again[1].pieces[0].host.data_ptr() == buffers[0].data_ptr() + 60
    _, grown = lay_out([_storage(2000)], buffers, chunk=4096, lane=0, lanes=1)
    assert grown[0] is not buffers[0] and grown[0].numel() == 2000


def test_an_offload_takes_each_allocated_storage_once() -> None:
    base = torch.zeros(8)
    view = base[2:]  # shares base's storage
    empty = torch.zeros(0)
    meta = torch.zeros(4, device="meta")
    other = torch.ones(3)
    seen: set[int] = set()
    found = list(storages_of([base, view, empty, meta, other], seen))
    assert [s.nbytes() for s in found] == [32, 12]
    assert seen == {storage_key(base), storage_key(other)}
    assert list(storages_of([view], seen)) == []  # already taken by an earlier call
    slots, _ = lay_out(found, [], chunk=64, lane=0, lanes=1)
    assert same_layout(slots, found)
    assert not same_layout(slots, found[:1])
    other.untyped_storage().resize_(0)
    assert not same_layout(slots, found)  # a storage resized since: laid out afresh


def test_a_tensor_whose_memory_is_borrowed_is_refused_by_name() -> None:
    own = torch.zeros(4)
    borrowed = torch.from_numpy(np.zeros(4, dtype=np.float32))
    refuse_fixed([("own", own), ("meta", torch.zeros(4, device="meta"))], "module")
    with pytest.raises(InvalidArgument, match=r"module: w\.borrowed: the storage can not"):
        refuse_fixed([("own", own), ("w.borrowed", borrowed)], "module")


def test_a_kept_copy_is_stale_for_what_was_written_or_not_seen_at_the_restore() -> None:
    untouched, written = torch.zeros(4), torch.zeros(4)
    kept = Kept([], versions([untouched, written]))
    written.add_(1)  # an in-place write bumps the version counter
    unseen = torch.zeros(2)
    stale = kept.written([untouched, written, unseen, torch.zeros(1, device="meta")])
    assert stale == {storage_key(written), storage_key(unseen)}
