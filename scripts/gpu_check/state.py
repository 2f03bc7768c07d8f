"""A job's device state with a known pattern, and a bit-exact checksum computed on the device.

The state looks like a trainer's: one large parameter tensor in an ``nn.Module`` and an Adam
optimizer whose state (``exp_avg``, ``exp_avg_sq``, ``step``) lives on the same device, so the
``app`` adapter moves it through its module and optimizer tracking. The parameter is filled
from a seeded generator and the moments are functions of it: the same seed gives the same
bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

FLOAT_BYTES = 4
TENSORS = 3  # parameter + two moments
# Words per checksum block: 64 MiB of state, with 128 MiB int64 temporaries (3 of them).
_BLOCK_WORDS = 1 << 24
_WEIGHT_SEED = 0x5EED


class Weights(nn.Module):
    """A module holding one flat parameter (the bulk of a model's bytes)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)


@dataclass
class TrainState:
    """The module, the optimizer with its state, and the tensors they hold."""

    module: Weights
    optimizer: torch.optim.Optimizer
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def digest(self) -> str:
        """The checksum of every byte of the state (see :func:`digest`)."""
        return digest(self.tensors)


def build_state(device: torch.device, size_bytes: int, seed: int) -> TrainState:
    """About ``size_bytes`` of state on ``device``: a parameter and Adam moments from ``seed``."""
    count = max(1, size_bytes // (TENSORS * FLOAT_BYTES))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        # In place: no temporary of the parameter's size.
        weight = torch.empty(count, dtype=torch.float32, device=device)
        weight.normal_(generator=generator)
        exp_avg = weight * 0.1
        exp_avg_sq = weight.square()
        step = torch.full((), float(seed), dtype=torch.float32, device=device)
    module = Weights(weight)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    # Adam's own state layout, as after a first step, without a gradient-sized temporary.
    optimizer.state[module.weight] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return TrainState(module, optimizer, (module.weight, exp_avg, exp_avg_sq, step))


def digest(tensors: tuple[torch.Tensor, ...]) -> str:
    """A SHA-256 over per-block checksums computed where the tensors live.

    Each tensor's bytes are read as 32-bit words; per block of words the device computes the
    plain sum and a sum weighted by fixed pseudo-random odd 64-bit weights (so swapped or
    shifted words change it too). Only the two sums per block travel to the host. The int64
    arithmetic wraps; that is fine because the result is only ever compared with the same
    computation on the same device.
    """
    h = hashlib.sha256()
    flat = [_words(t) for t in tensors]
    longest = max((w.numel() for w in flat), default=0)
    weights = _weights(flat[0].device, min(_BLOCK_WORDS, longest)) if flat else None
    with torch.no_grad():
        for tensor, words in zip(tensors, flat, strict=True):
            assert weights is not None
            sums = []
            for start in range(0, words.numel(), _BLOCK_WORDS):
                block = words[start : start + _BLOCK_WORDS].to(torch.int64)
                sums.append(block.sum())
                sums.append((block * weights[: block.numel()]).sum())
                del block
            h.update(f"{tensor.dtype}:{tuple(tensor.shape)}:".encode())
            # One device-to-host transfer per tensor, of two numbers per block.
            h.update(repr(torch.stack(sums).cpu().tolist()).encode())
    del flat, weights
    if any(t.device.type == "cuda" for t in tensors):
        # The temporaries go back to the driver: the job's footprint stays its state.
        torch.cuda.empty_cache()
    return h.hexdigest()


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (a view; a copy only for a ragged tail)."""
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    extra = (-raw.numel()) % 4
    if extra:
        raw = torch.cat([raw, torch.zeros(extra, dtype=torch.uint8, device=raw.device)])
    return raw.view(torch.int32)


def _weights(device: torch.device, count: int) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(_WEIGHT_SEED)
    weights = torch.randint(
        -(2**62), 2**62, (count,), generator=generator, dtype=torch.int64, device=device
    )
    return weights | 1
