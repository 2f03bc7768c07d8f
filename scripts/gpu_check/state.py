"""A job's device state with content known in closed form, and an element-by-element check.

The state looks like a trainer's: one large parameter in an ``nn.Module`` and an Adam optimizer
whose state (``exp_avg``, ``exp_avg_sq``, ``step``) lives on the same device, so the ``app``
adapter moves it through its module and optimizer tracking. Each tensor's bytes, read as 32-bit
words, are a hash of (seed, tensor, word index), XOR-ed with a key of the *generation* (how many
in-place "optimizer steps" the job took). :meth:`TrainState.verify` regenerates that content
block by block, independently of the bytes under test, and compares every word: a restore that
loses, shifts or flips one byte is found and named (tensor, word, expected, actual). There is no
checksum that could be constant.

The words are raw bytes, never used as floats: NaN patterns do not matter. Integer arithmetic
is done in int64 and masked to 32 bits, so CPU and GPU generate the same words.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

WORD_BYTES = 4
BIG_TENSORS = 3  # parameter + two moments; ``step`` is one word more
NAMES = ("weight", "exp_avg", "exp_avg_sq", "step")
# Words per block: 64 MiB of state, int64 temporaries of 128 MiB (a few at a time).
BLOCK_WORDS = 1 << 24
_MASK = 0xFFFFFFFF
_MUL1 = 0x9E3779B1
_MUL2 = 0x85EBCA6B
_MUL3 = 0xC2B2AE35


class Weights(nn.Module):
    """A module holding one flat parameter (the bulk of a model's bytes)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)


@dataclass(frozen=True)
class Mismatch:
    """The first word that differs from the expected content."""

    tensor: str
    word: int
    expected: int
    actual: int
    generation: int

    def describe(self) -> str:
        return (
            f"{self.tensor} word {self.word}: expected 0x{self.expected & _MASK:08x}, "
            f"found 0x{self.actual & _MASK:08x} (generation {self.generation})"
        )


def generation_key(generation: int) -> int:
    """The 32-bit word every element is XOR-ed with at ``generation`` (0 at build)."""
    if generation == 0:
        return 0
    return ((generation * _MUL3) ^ (generation >> 3) ^ 0x5A5A5A5A) & _MASK | 1


def expected_words(seed: int, tensor: int, start: int, count: int, generation: int,
                   device: torch.device) -> torch.Tensor:  # fmt: skip
    """Words ``start .. start + count`` of tensor ``tensor`` (int32), from the closed form."""
    x = torch.arange(start, start + count, dtype=torch.int64, device=device)
    x = (x * _MUL1 + (seed * 0x1000193 + tensor * 0x27D4EB2F)) & _MASK
    x = ((x ^ (x >> 16)) * _MUL2) & _MASK
    x = ((x ^ (x >> 13)) * _MUL3) & _MASK
    x = x ^ (x >> 16) ^ generation_key(generation)
    # Two's complement into int32 without relying on an overflowing cast.
    return (x - ((x >> 31) & 1) * (1 << 32)).to(torch.int32)


def words_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words: a view sharing its storage and version counter."""
    return tensor.detach().reshape(-1).view(torch.int32)


@dataclass
class TrainState:
    """The module, the optimizer with its state, the tensors they hold, their generation."""

    module: Weights
    optimizer: torch.optim.Optimizer
    tensors: tuple[torch.Tensor, ...]
    seed: int
    generation: int = 0
    corrupted: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def verify(self) -> Mismatch | None:
        """Compare every word with the content regenerated for this generation."""
        found: Mismatch | None = None
        with torch.no_grad():
            for index, tensor in enumerate(self.tensors):
                found = _first_difference(self, index, words_of(tensor))
                if found is not None:
                    break
        _release_temporaries(self.tensors)
        return found

    def step(self) -> None:
        """An in-place "optimizer step": every word changes to the next generation's."""
        delta = generation_key(self.generation) ^ generation_key(self.generation + 1)
        signed = delta - (1 << 32) if delta >= 1 << 31 else delta
        with torch.no_grad():
            for tensor in self.tensors:
                words_of(tensor).bitwise_xor_(signed)
        self.generation += 1

    def corrupt_one_byte(self) -> str:
        """Flip one bit of one byte in the middle of the parameter (the self-test)."""
        raw = self.tensors[0].detach().reshape(-1).view(torch.uint8)
        at = raw.numel() // 2 + 1
        with torch.no_grad():
            raw[at : at + 1].bitwise_xor_(0x10)
        what = f"weight byte {at} (word {at // WORD_BYTES})"
        self.corrupted.append(what)
        return what


def _first_difference(state: TrainState, index: int, words: torch.Tensor) -> Mismatch | None:
    for start in range(0, words.numel(), BLOCK_WORDS):
        block = words[start : start + BLOCK_WORDS]
        expected = expected_words(
            state.seed, index, start, block.numel(), state.generation, block.device
        )
        if torch.equal(block, expected):
            continue
        offset = int(torch.nonzero(block != expected)[0].item())
        return Mismatch(
            tensor=NAMES[index],
            word=start + offset,
            expected=int(expected[offset].item()),
            actual=int(block[offset].item()),
            generation=state.generation,
        )
    return None


def _release_temporaries(tensors: tuple[torch.Tensor, ...]) -> None:
    if any(t.device.type == "cuda" for t in tensors):
        # The temporaries go back to the driver: the job's footprint stays its state.
        torch.cuda.empty_cache()


def build_state(device: torch.device, size_bytes: int, seed: int) -> TrainState:
    """About ``size_bytes`` of state on ``device`` with generation-0 content for ``seed``."""
    count = max(1, size_bytes // (BIG_TENSORS * WORD_BYTES))
    tensors = []
    with torch.no_grad():
        for index in range(BIG_TENSORS + 1):
            # Filled block by block in place: no temporary of the state's size.
            tensor = torch.empty(count if index < BIG_TENSORS else 1, dtype=torch.float32,
                                 device=device)  # fmt: skip
            words = words_of(tensor)
            for start in range(0, words.numel(), BLOCK_WORDS):
                n = min(BLOCK_WORDS, words.numel() - start)
                words[start : start + n] = expected_words(seed, index, start, n, 0, device)
            tensors.append(tensor)
    module = Weights(tensors[0])
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    # Adam's own state layout, as after a first step, without a gradient-sized temporary.
    optimizer.state[module.weight] = {
        "exp_avg": tensors[1], "exp_avg_sq": tensors[2], "step": tensors[3],
    }  # fmt: skip
    state = TrainState(module, optimizer, (module.weight, *tensors[1:]), seed)
    _release_temporaries(state.tensors)
    return state
