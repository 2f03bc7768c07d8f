"""What a parked storage needs to come back: its slots in host buffers, and the marks that
say whether the host copy is still current (the bookkeeping of :mod:`timeslice.offload`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from timeslice.errors import InvalidArgument

# Host offsets of storages are aligned like device allocations, which the copy engines favour.
ALIGN = 512


@dataclass(frozen=True)
class Piece:
    """One chunk copy: ``length`` bytes at ``start`` of a storage <-> a host slice."""

    start: int
    host: torch.Tensor  # a uint8 view into one host buffer; keeps it alive
    lane: int  # which of the CUDA streams carries the copy


@dataclass
class Slot:
    """A storage freed by an offload: what is needed to bring it back."""

    storage: torch.UntypedStorage
    nbytes: int
    pieces: list[Piece]  # empty for a discarded storage


@dataclass
class Parked:
    """The offloaded state of one tag."""

    slots: list[Slot]
    discarded: list[torch.Tensor]  # tracked tensors of a DISCARD tag, for ``recreate``


@dataclass
class Kept:
    """A restored tag's host copy, still current for every storage not written since.

    ``versions`` maps ``id(tensor)`` of each tracked tensor, as of the restore, to the tensor
    (weakly: a gradient dropped later must not be kept alive) and its version counter then.
    """

    slots: list[Slot]
    versions: dict[int, tuple[weakref.ref[torch.Tensor], int]]

    def written(self, tensors: list[torch.Tensor]) -> set[int]:
        """Keys of the storages some tensor wrote to since the restore, or may have: a
        tensor the restore did not see counts as a write."""
        keys: set[int] = set()
        for tensor in tensors:
            if tensor.device.type == "meta":
                continue
            seen = self.versions.get(id(tensor))
            if seen is None or seen[0]() is not tensor or seen[1] != tensor._version:
                keys.add(storage_key(tensor))
        return keys


def refuse_fixed(named: list[tuple[str, torch.Tensor]], what: str) -> None:
    """Refuse tensors whose storage can not be freed: better now than at the first switch.

    Such storages borrow their memory (a memory-mapped file, as ``from_pretrained`` loads
    safetensors on the CPU; numpy; ``torch.frombuffer``), so ``resize_`` can not free them.
    """
    fixed = []
    for name, tensor in named:
        if tensor.device.type == "meta" or tensor.layout is not torch.strided:
            continue  # nothing to move, or refused with its reason at the offload
        storage = tensor.untyped_storage()
        if storage.nbytes() and not storage.resizable():
            fixed.append(name)
    if fixed:
        shown = ", ".join(fixed[:8]) + (f" and {len(fixed) - 8} more" if len(fixed) > 8 else "")
        raise InvalidArgument(
            f"{what}: {shown}: the storage can not be resized, so it could not be offloaded "
            "(memory borrowed from a memory-mapped file, such as safetensors loaded on the "
            "CPU, or from numpy or torch.frombuffer); give it memory of its own first: a "
            "clone, or the module moved to a real device"
        )


def storage_key(tensor: torch.Tensor) -> int:
    key: int = tensor.untyped_storage()._cdata
    return key


def versions(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[weakref.ref[torch.Tensor], int]]:
    return {id(t): (weakref.ref(t), t._version) for t in tensors if t.device.type != "meta"}


def same_layout(slots: list[Slot], storages: list[torch.UntypedStorage]) -> bool:
    """Whether ``slots`` hold exactly ``storages``, in order, at their current sizes."""
    return len(slots) == len(storages) and all(
        slot.storage._cdata == storage._cdata and slot.nbytes == storage.nbytes()
        for slot, storage in zip(slots, storages, strict=True)
    )


def storages_of(tensors: Iterable[torch.Tensor], seen: set[int]) -> Iterator[torch.UntypedStorage]:
    """The distinct, allocated, non-meta storages of ``tensors`` not yet in ``seen``."""
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError) as exc:
            raise InvalidArgument(
                f"a {tensor.layout} tensor of shape {tuple(tensor.shape)} has no plain "
                f"storage to offload: {exc}"
            ) from exc
        key: int = storage._cdata
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        yield storage


def whole(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``: byte copies are exact for every dtype."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def bytes_of(storage: torch.UntypedStorage, piece: Piece) -> torch.Tensor:
    return whole(storage)[piece.start : piece.start + piece.host.numel()]


def lay_out(
    storages: list[torch.UntypedStorage],
    kept: list[torch.Tensor],
    *,
    chunk: int,
    lane: int,
    lanes: int,
) -> tuple[list[Slot], list[torch.Tensor]]:
    """Pack the storages one after another into host buffers of ``chunk`` bytes each.

    Equal, large buffers (rather than one per storage) keep the number of pinned
    allocations small and reusable: torch's pinned allocator rounds sizes up to a power
    of two, so a buffer per storage could cost up to twice the host memory.
    """
    # Only align when it can not leave a whole buffer empty.
    align = ALIGN if chunk % ALIGN == 0 else 1
    placed: list[tuple[torch.UntypedStorage, list[tuple[int, int, int, int]]]] = []
    offset = end = 0
    for storage in storages:
        nbytes = storage.nbytes()
        spans = []
        start = 0
        while start < nbytes:
            index, within = divmod(offset, chunk)
            length = min(nbytes - start, chunk - within)
            spans.append((start, index, within, length))
            start += length
            offset += length
        placed.append((storage, spans))
        end = offset
        offset = -(-offset // align) * align
    pin = torch.cuda.is_available() and any(s.device.type == "cuda" for s in storages)
    buffers: list[torch.Tensor] = []
    for index in range(-(-end // chunk)):
        need = min(chunk, end - index * chunk)
        old = kept[index] if index < len(kept) else None
        if old is not None and old.numel() >= need and (not pin or old.is_pinned()):
            buffers.append(old)
        else:
            buffers.append(torch.empty(need, dtype=torch.uint8, pin_memory=pin))
    slots = [
        Slot(
            storage,
            storage.nbytes(),
            [Piece(start, buffers[b][w : w + n], (lane + b) % lanes) for start, b, w, n in spans],
        )
        for storage, spans in placed
    ]
    return slots, buffers
