"""timeslice.offload.TorchOffloader with real torch on CPU: the device path minus CUDA streams."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import timeslice.offload as offload_mod
import timeslice.worker
from timeslice.errors import InvalidArgument
from timeslice.offload import OffloadMode, TorchOffloader
from timeslice.worker import HookResult

REPO = Path(__file__).resolve().parents[2]


class TinyLM(nn.Module):
    """An embedding tied to the output head, with a buffer: the usual LM shape in miniature."""

    scale: torch.Tensor

    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.norm(torch.relu(self.hidden(x))) * self.scale[1]
        logits: torch.Tensor = self.head(x)
        return logits


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors``, computed independently."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def assert_resident(*tensors: torch.Tensor) -> None:
    """Fail without printing the tensors: printing a released storage would crash."""
    gone = [i for i, t in enumerate(tensors) if released(t)]
    if gone:
        pytest.fail(f"tensors {gone} have no storage", pytrace=False)


def assert_same(tensors: list[torch.Tensor], clones: list[torch.Tensor]) -> None:
    assert len(tensors) == len(clones)
    assert_resident(*tensors)
    for t, c in zip(tensors, clones, strict=True):
        assert t.dtype == c.dtype and t.shape == c.shape
        assert torch.equal(t.detach(), c), (t, c)


def released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def train_step(model: TinyLM, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (4, 6), generator=gen)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    torch.autograd.backward(loss)
    opt.step()


class FailOn:
    """Wraps a function; raises on the ``nth`` call that ``match`` accepts."""

    def __init__(
        self, real: Callable[..., None], nth: int, match: Callable[..., bool] = lambda *a, **k: True
    ) -> None:
        self.real, self.nth, self.match, self.calls = real, nth, match, 0

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.match(*args, **kwargs):
            self.calls += 1
            if self.calls == self.nth:
                raise RuntimeError("injected failure")
        self.real(*args, **kwargs)


# ---------------------------------------------------------------------- round trips


def test_tied_module_round_trip_frees_storages_and_reports_bytes() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    tensors = module_tensors(model)
    before = snapshot(tensors)
    expected = storage_bytes(*tensors)  # the tied weight once
    offloader = TorchOffloader()
    offloader.add_module(model)
    assert offloader.device_bytes == expected

    assert offloader.offload() == expected
    assert all(released(t) for t in tensors)
    assert offloader.offloaded and offloader.offloaded_tags == {"default"}
    assert offloader.device_bytes == 0
    assert offloader.host_bytes >= expected

    assert offloader.restore() == expected
    assert_same(tensors, before)
    assert model.head.weight is model.embed.weight
    assert model.head.weight.untyped_storage().data_ptr() == (
        model.embed.weight.untyped_storage().data_ptr()
    )
    assert not offloader.offloaded and offloader.device_bytes == expected
    assert offloader.host_bytes == 0  # freed after restore by default


def test_stats_count_each_storage_once() -> None:
    model = TinyLM()
    offloader = TorchOffloader()
    offloader.add_module(model)
    offloader.add_tensors(model.embed.weight[3:5])  # a view of a tracked storage
    n_storages = len({t.untyped_storage()._cdata for t in module_tensors(model)})
    copied = offloader.offload()
    stats = offloader.last_stats
    assert stats is not None
    assert (stats.copied_bytes, stats.discarded_bytes, stats.storages) == (copied, 0, n_storages)
    offloader.restore()


def test_adam_state_round_trips_and_training_stays_bit_identical() -> None:
    torch.manual_seed(1)
    model = TinyLM()
    reference = TinyLM()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)

    offloader = TorchOffloader(chunk_bytes=1024)  # several host buffers
    offloader.add_module(model)
    offloader.add_optimizer(opt)

    for step in range(4):
        train_step(model, opt, seed=step)
        train_step(reference, ref_opt, seed=step)
        state = [v for s in opt.state.values() for v in s.values()]
        assert state, "Adam created its state"
        before = snapshot(state)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        expected = storage_bytes(*module_tensors(model), *grads, *state)
        moved = offloader.offload()
        assert moved == expected
        assert all(released(t) for t in state)
        assert all(released(p.grad) for p in model.parameters() if p.grad is not None)
        assert offloader.restore() == moved
        assert_same(state, before)

    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key
    # And one more step after the last restore still matches.
    train_step(model, opt, seed=99)
    train_step(reference, ref_opt, seed=99)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_views_and_non_contiguous_tensors() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    transposed = base.t()
    strided = base[1:5, ::3]
    offset_view = base.view(-1)[17:29]
    other = torch.randn(5, 7).t()[:, 1:]  # non-contiguous and offset, its own storage
    tensors = [base, transposed, strided, offset_view, other]
    before = snapshot(tensors)
    offloader = TorchOffloader()
    offloader.add_tensors(strided, offset_view, other)  # not base: the view brings it along

    expected = storage_bytes(base, other)
    assert offloader.offload() == expected
    assert released(base) and released(other)
    offloader.restore()
    assert_same(tensors, before)
    assert not transposed.is_contiguous() and transposed.data_ptr() == base.data_ptr()
    strided.fill_(-1)  # views still alias their base after a restore
    assert torch.equal(base[1:5, ::3], torch.full((4, 4), -1.0))


@pytest.mark.parametrize("chunk_bytes", [100, 1024, offload_mod.DEFAULT_CHUNK_BYTES])
def test_every_dtype_bit_exact(chunk_bytes: int) -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(37, generator=gen),
        torch.randn(3, 41, generator=gen).to(torch.bfloat16),
        torch.randn(23, generator=gen).to(torch.float16),
        torch.randint(-128, 128, (29,), generator=gen, dtype=torch.int8),
        torch.randint(-(2**62), 2**62, (13,), generator=gen, dtype=torch.int64),
        torch.rand(31, generator=gen) > 0.5,
        torch.randn(7, generator=gen, dtype=torch.complex64),
        torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
        torch.randn(700, generator=gen, dtype=torch.float64),  # 5600 bytes: spans buffers
    ]
    before = snapshot(tensors)
    offloader = TorchOffloader(chunk_bytes=chunk_bytes)
    offloader.add_tensors(*tensors)
    expected = storage_bytes(*tensors)
    assert offloader.offload() == expected
    assert all(released(t) for t in tensors)
    assert offloader.restore() == expected
    for t, c in zip(tensors, before, strict=True):
        assert_resident(t)
        # Compare raw bytes: NaN != NaN and -0.0 == 0.0 would hide differences.
        assert t.view(torch.uint8).tolist() == c.view(torch.uint8).tolist()


def test_meta_and_empty_storages_are_skipped() -> None:
    meta = torch.empty(1000, device="meta")
    empty = torch.empty(0)
    real = torch.ones(10)
    offloader = TorchOffloader()
    offloader.add_tensors(meta, empty, real)
    assert offloader.device_bytes == 40
    assert offloader.offload() == 40
    assert offloader.restore() == 40
    assert_resident(real)
    assert torch.equal(real, torch.ones(10))


def test_a_tag_with_nothing_allocated_is_not_offloaded() -> None:
    offloader = TorchOffloader()
    offloader.add_tensors(torch.empty(0))
    assert offloader.offload() == 0
    assert not offloader.offloaded
    assert offloader.last_stats is None


# ---------------------------------------------------------------------- tags


def test_tags_offload_only_the_named_state() -> None:
    base = nn.Linear(6, 6)
    lora = nn.Linear(6, 2, bias=False)
    base_before, lora_before = snapshot(module_tensors(base)), snapshot(module_tensors(lora))
    offloader = TorchOffloader()
    offloader.add_module(base)
    offloader.add_module(lora, tag="lora")
    assert offloader.tags == ("default", "lora")
    base_bytes = storage_bytes(*module_tensors(base))
    lora_bytes = storage_bytes(lora.weight)

    assert offloader.offload(tags="lora") == lora_bytes
    assert released(lora.weight)
    assert not any(released(t) for t in module_tensors(base))
    assert offloader.offloaded_tags == {"lora"}
    assert offloader.device_bytes == base_bytes

    # Offloading everything now moves only what is still on the device.
    assert offloader.offload() == base_bytes
    assert offloader.restore(tags=["default"]) == base_bytes
    assert_same(module_tensors(base), base_before)
    assert released(lora.weight)
    assert offloader.restore(tags=["lora", "default"]) == lora_bytes
    assert_same(module_tensors(lora), lora_before)


def test_discard_tag_frees_without_copy_and_restores_zeros() -> None:
    weights = torch.randn(16)
    kv = torch.randn(2, 4, 8)
    kv_bytes, weight_bytes = storage_bytes(kv), storage_bytes(weights)
    offloader = TorchOffloader()
    offloader.add_tensors(weights)
    offloader.add_tensors(kv, tag="kv")
    offloader.set_mode("kv", OffloadMode.DISCARD)

    assert offloader.offload() == weight_bytes  # kv not counted
    stats = offloader.last_stats
    assert stats is not None and stats.discarded_bytes == kv_bytes
    assert released(kv)
    assert weight_bytes <= offloader.host_bytes < kv_bytes + weight_bytes
    assert offloader.restore() == weight_bytes
    assert_resident(kv)
    assert kv.untyped_storage().nbytes() == kv_bytes
    assert torch.equal(kv, torch.zeros(2, 4, 8))


def test_discard_tag_calls_recreate() -> None:
    kv = torch.randn(3, 5)
    kv_view = kv[1]
    seen: list[tuple[torch.Tensor, list[float]]] = []

    def recreate(t: torch.Tensor) -> None:
        seen.append((t, t.flatten().tolist()))
        t.fill_(7.0)

    offloader = TorchOffloader()
    offloader.set_mode("kv", OffloadMode.DISCARD, recreate=recreate)
    offloader.add_tensors(kv, kv_view, tag="kv")
    assert offloader.offload("kv") == 0
    assert released(kv)
    assert offloader.restore("kv") == 0
    assert [id(t) for t, _ in seen] == [id(kv), id(kv_view)]
    assert seen[0][1] == [0.0] * 15  # re-allocated and zeroed before recreate
    assert_resident(kv)
    assert torch.equal(kv, torch.full((3, 5), 7.0))


def test_bad_arguments_are_refused() -> None:
    offloader = TorchOffloader()
    offloader.add_tensors(torch.ones(2))
    with pytest.raises(InvalidArgument, match="unknown tags"):
        offloader.offload(tags=["nope"])
    with pytest.raises(InvalidArgument, match="recreate"):
        offloader.set_mode("x", OffloadMode.OFFLOAD, recreate=lambda t: None)
    with pytest.raises(InvalidArgument):
        TorchOffloader(chunk_bytes=0)
    with pytest.raises(InvalidArgument):
        TorchOffloader(num_streams=0)
    offloader.offload()
    with pytest.raises(InvalidArgument, match="offloaded"):
        offloader.add_tensors(torch.ones(3))
    offloader.restore()
    offloader.add_tensors(torch.ones(3))


# ---------------------------------------------------------------------- failures


def test_copy_failure_midway_leaves_everything_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt, seed=0)
    tensors = [*module_tensors(model), *[v for s in opt.state.values() for v in s.values()]]
    before = snapshot(tensors)
    offloader = TorchOffloader()
    offloader.add_module(model)
    offloader.add_optimizer(opt)
    failing = FailOn(offload_mod._copy, nth=2)
    monkeypatch.setattr(offload_mod, "_copy", failing)

    with pytest.raises(RuntimeError, match="injected"):
        offloader.offload()
    assert failing.calls == 2
    assert_same(tensors, before)
    assert not offloader.offloaded and offloader.host_bytes == 0

    monkeypatch.undo()
    assert offloader.offload() > 0  # and it works afterwards
    offloader.restore()
    assert_same(tensors, before)


def test_free_failure_midway_brings_back_what_was_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.randn(10), torch.randn(20).to(torch.bfloat16), torch.arange(5)]
    before = snapshot(tensors)
    offloader = TorchOffloader()
    offloader.add_tensors(*tensors)
    failing = FailOn(offload_mod._resize, nth=3, match=lambda storage, nbytes: nbytes == 0)
    monkeypatch.setattr(offload_mod, "_resize", failing)

    with pytest.raises(RuntimeError, match="injected"):
        offloader.offload()
    assert_same(tensors, before)
    assert not offloader.offloaded


def test_non_resizable_storage_is_refused_before_anything_moves() -> None:
    # Optimizer state appears after add_optimizer (at the first step): the offload checks it.
    ours = torch.randn(8)
    param = nn.Parameter(torch.randn(4, dtype=torch.float64))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    offloader = TorchOffloader()
    offloader.add_tensors(ours)
    offloader.add_optimizer(optimizer)
    optimizer.state[param]["momentum_buffer"] = torch.from_numpy(np.arange(4.0))
    with pytest.raises(InvalidArgument, match="resized"):
        offloader.offload()
    assert_resident(ours)
    assert not offloader.offloaded


def _memory_mapped(path: Path, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors as ``from_pretrained`` loads safetensors on the CPU: mapped from the file."""
    torch.save(tensors, path)
    loaded: dict[str, torch.Tensor] = torch.load(path, mmap=True)
    return loaded


def test_borrowed_storages_are_refused_when_added_naming_them(tmp_path: Path) -> None:
    linear = nn.Linear(4, 4)
    model = nn.Sequential(linear, nn.LayerNorm(4))
    mapped = _memory_mapped(tmp_path / "w.pt", weight=torch.randn(4, 4))
    model.load_state_dict({**model.state_dict(), "0.weight": mapped["weight"]}, assign=True)
    offloader = TorchOffloader()
    with pytest.raises(InvalidArgument) as refused:
        offloader.add_module(model)
    message = str(refused.value)
    assert "parameter '0.weight'" in message and "resized" in message
    assert "0.bias" not in message and "1.weight" not in message
    assert offloader.tags == ()  # nothing tracked

    with pytest.raises(InvalidArgument, match=r"tensor 1 \(\(3,\), torch.float32\)"):
        offloader.add_tensors(torch.randn(2), torch.frombuffer(bytearray(12), dtype=torch.float32))
    assert offloader.tags == ()

    param = nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.randn(2)), param], momentum=0.9)
    optimizer.state[param]["momentum_buffer"] = torch.from_numpy(np.zeros(3, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="'momentum_buffer' of parameter 1"):
        offloader.add_optimizer(optimizer)

    # With memory of its own (a clone), the same model is accepted and moves.
    linear.weight = nn.Parameter(linear.weight.detach().clone())
    offloader.add_module(model)
    assert offloader.offload() > 0 and offloader.restore() > 0


@pytest.mark.parametrize("fail", ["allocate", "copy"])
def test_restore_failure_stays_offloaded_and_retry_works(
    monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    model = TinyLM()
    tensors = module_tensors(model)
    before = snapshot(tensors)
    offloader = TorchOffloader()
    offloader.add_module(model)
    moved = offloader.offload()
    host = offloader.host_bytes

    if fail == "allocate":
        failing = FailOn(offload_mod._resize, nth=3, match=lambda storage, nbytes: nbytes > 0)
        monkeypatch.setattr(offload_mod, "_resize", failing)
    else:
        monkeypatch.setattr(offload_mod, "_copy", FailOn(offload_mod._copy, nth=4))
    with pytest.raises(RuntimeError, match="injected"):
        offloader.restore()
    assert all(released(t) for t in tensors)
    assert offloader.offloaded and offloader.host_bytes == host
    assert offloader.device_bytes == 0

    monkeypatch.undo()
    assert offloader.restore() == moved
    assert_same(tensors, before)


def test_recreate_failure_frees_again() -> None:
    kv = torch.ones(4)

    def recreate(t: torch.Tensor) -> None:
        raise ValueError("no")

    offloader = TorchOffloader()
    offloader.add_tensors(kv, tag="kv")
    offloader.set_mode("kv", OffloadMode.DISCARD, recreate=recreate)
    offloader.offload()
    with pytest.raises(ValueError, match="no"):
        offloader.restore()
    assert released(kv) and offloader.offloaded_tags == {"kv"}


# ---------------------------------------------------------------------- cycles


def test_second_offload_and_restore_are_noops() -> None:
    t = torch.randn(12)
    before = t.clone()
    offloader = TorchOffloader()
    offloader.add_tensors(t)
    assert offloader.restore() == 0  # nothing offloaded yet
    assert offloader.offload() == 48
    assert offloader.offload() == 0
    assert released(t)
    assert offloader.restore() == 48
    assert offloader.restore() == 0
    assert_resident(t)
    assert torch.equal(t, before)


def test_keep_pinned_keeps_and_reuses_host_buffers() -> None:
    t = torch.randn(100)
    before = t.clone()
    offloader = TorchOffloader(keep_pinned=True, chunk_bytes=1024)
    offloader.add_tensors(t)
    offloader.offload()
    held = offloader.host_bytes
    assert held >= 400
    # The only look inside: which host buffers the tag holds.
    buffers = [b.data_ptr() for b in offloader._tags["default"].buffers]
    offloader.restore()
    assert offloader.host_bytes == held  # kept
    t.mul_(2)
    offloader.offload()
    assert [b.data_ptr() for b in offloader._tags["default"].buffers] == buffers  # reused
    offloader.restore()
    assert_resident(t)
    assert torch.equal(t, before * 2)
    assert offloader.release_host_buffers() == held
    assert offloader.host_bytes == 0


# ---------------------------------------------------------------------- host buffers


@pytest.mark.parametrize("keep_pinned", [False, True])
def test_restore_drops_every_host_buffer_reference_before_emptying_the_cache(
    monkeypatch: pytest.MonkeyPatch, keep_pinned: bool
) -> None:
    """torch's pinned cache frees only buffers nobody references: at the moment restore
    empties it, no reference to the parked buffers (or views into them) may be left."""
    model = TinyLM()
    offloader = TorchOffloader(chunk_bytes=256, keep_pinned=keep_pinned)
    offloader.add_module(model)
    offloader.offload()
    tag = offloader._tags["default"]  # the only look inside: the parked host memory
    assert tag.parked is not None
    refs = [weakref.ref(b) for b in tag.buffers]
    refs += [weakref.ref(p.host) for slot in tag.parked.slots for p in slot.pieces]
    assert len(refs) > len(tag.buffers) > 1
    del tag
    alive_at_empty: list[int] = []
    monkeypatch.setattr(
        offload_mod,
        "_empty_host_cache",
        lambda: alive_at_empty.append(sum(r() is not None for r in refs)),
    )
    offloader.restore()
    if keep_pinned:
        assert alive_at_empty == [] and all(r() is not None for r in refs)  # kept for reuse
        assert offloader.release_host_buffers() > 0
        assert alive_at_empty == [0]
    else:
        assert alive_at_empty == [0], "host buffers still referenced when the cache was emptied"
        assert offloader.host_bytes == 0
    assert all(r() is None for r in refs)


# ---------------------------------------------------------------------- skip unchanged


def _cycle(offloader: TorchOffloader) -> tuple[int, int]:
    """One offload (whose copied and skipped bytes are returned) and restore."""
    copied = offloader.offload()
    stats = offloader.last_stats
    assert stats is not None and stats.copied_bytes == copied
    offloader.restore()
    return copied, stats.skipped_bytes


def test_unchanged_state_is_released_without_a_copy_and_comes_back_bit_exact() -> None:
    model = TinyLM()
    total = storage_bytes(*module_tensors(model))
    offloader = TorchOffloader(keep_pinned=True, chunk_bytes=512)
    offloader.add_module(model)
    assert _cycle(offloader) == (total, 0)  # the first offload has no host copy yet
    before = snapshot(module_tensors(model))
    for _ in range(3):
        copied = offloader.offload()
        assert all(released(t) for t in module_tensors(model))
        stats = offloader.last_stats
        assert stats is not None and (copied, stats.skipped_bytes) == (0, total)
        assert stats.freed_bytes == total
        offloader.restore()
        assert_same(module_tensors(model), before)


def test_a_parameter_written_in_place_is_the_only_storage_copied() -> None:
    model = TinyLM()
    offloader = TorchOffloader(keep_pinned=True, chunk_bytes=512)
    offloader.add_module(model)
    _cycle(offloader)
    total = storage_bytes(*module_tensors(model))
    with torch.no_grad():
        model.hidden.bias.add_(1.0)
    expected = snapshot(module_tensors(model))
    bias = model.hidden.bias.untyped_storage().nbytes()
    assert _cycle(offloader) == (bias, total - bias)
    assert_same(module_tensors(model), expected)
    # Through a view, and through copy_ / load_state_dict: each bumps the counters.
    with torch.no_grad():
        model.norm.weight.view(-1)[0] = 7.0
    expected = snapshot(module_tensors(model))
    norm = model.norm.weight.untyped_storage().nbytes()
    assert _cycle(offloader) == (norm, total - norm)
    assert_same(module_tensors(model), expected)
    fresh = TinyLM()
    model.load_state_dict(fresh.state_dict())
    assert _cycle(offloader) == (total, 0)
    assert_same(module_tensors(model), snapshot(module_tensors(fresh)))


def test_optimizer_steps_are_copied_and_training_stays_bit_identical() -> None:
    torch.manual_seed(3)
    model, twin = TinyLM(), TinyLM()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    offloader = TorchOffloader(keep_pinned=True, chunk_bytes=1024)
    offloader.add_module(model)
    offloader.add_optimizer(opt)
    for step in range(4):
        train_step(model, opt, step)
        train_step(twin, twin_opt, step)
        copied, skipped = _cycle(offloader)
        assert copied > 0
        # Every parameter, gradient and Adam state changed: nothing may be skipped.
        assert skipped == 0
        # And the same state once more, untouched: nothing copied.
        assert _cycle(offloader)[0] == 0
    assert_same(module_tensors(model), snapshot(module_tensors(twin)))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], twin_opt.state[q][key])


def test_writes_the_counters_can_not_see_need_mark_written() -> None:
    t = torch.zeros(64)
    offloader = TorchOffloader(keep_pinned=True)
    offloader.add_tensors(t)
    _cycle(offloader)
    t.data.fill_(5.0)  # .data has a counter of its own: torch counts nothing on ``t``
    offloader.mark_written()
    assert _cycle(offloader) == (256, 0)
    assert torch.equal(t, torch.full((64,), 5.0))


def test_skip_unchanged_off_copies_everything_every_time() -> None:
    model = TinyLM()
    total = storage_bytes(*module_tensors(model))
    offloader = TorchOffloader(keep_pinned=True, skip_unchanged=False)
    offloader.add_module(model)
    for _ in range(3):
        assert _cycle(offloader) == (total, 0)


def test_without_keep_pinned_nothing_is_skipped() -> None:
    model = TinyLM()
    total = storage_bytes(*module_tensors(model))
    offloader = TorchOffloader()
    offloader.add_module(model)
    for _ in range(2):
        assert _cycle(offloader) == (total, 0)


def test_new_state_since_the_restore_lays_the_host_copy_out_again() -> None:
    model = TinyLM()
    offloader = TorchOffloader(keep_pinned=True, chunk_bytes=256)
    offloader.add_module(model)
    _cycle(offloader)
    # Gradients appear: new storages, a new layout; everything is copied, bit-exact.
    torch.autograd.backward(model(torch.tensor([[1, 2, 3]])).sum())
    expected = snapshot(module_tensors(model))
    grads = snapshot([p.grad for p in model.parameters() if p.grad is not None])
    total = storage_bytes(
        *module_tensors(model), *[p.grad for p in model.parameters() if p.grad is not None]
    )
    assert _cycle(offloader) == (total, 0)
    assert_same(module_tensors(model), expected)
    assert_same([p.grad for p in model.parameters() if p.grad is not None], grads)
    # Gradients dropped: the layout changes again (fewer storages).
    model.zero_grad(set_to_none=True)
    assert _cycle(offloader)[1] == 0
    assert_same(module_tensors(model), expected)


def test_hook_reports_freed_and_skipped_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyLM()
    total = storage_bytes(*module_tensors(model))
    offloader = TorchOffloader(keep_pinned=True)
    offloader.add_module(model)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(timeslice.worker, "register", lambda g, **kw: calls.append(kw))
    offloader.register("g")
    checkpoint, restore = calls[0]["on_checkpoint"], calls[0]["on_restore"]
    assert checkpoint() == HookResult(bytes_moved=total, bytes_skipped=0)
    # The kept host buffers are reported: the agent need not find that memory again.
    kept = offloader.host_bytes
    assert kept >= total
    assert restore() == HookResult(bytes_moved=total, host_bytes_kept=kept)
    assert checkpoint() == HookResult(bytes_moved=total, bytes_skipped=total)
    assert checkpoint() == HookResult(bytes_moved=0)  # already offloaded: nothing moved
    restore()


def test_cycle_stats_split_the_time() -> None:
    offloader = TorchOffloader()
    offloader.add_tensors(torch.randn(1 << 16))
    offloader.offload()
    out = offloader.last_stats
    assert out is not None and 0 < out.copy_seconds <= out.seconds
    assert 0 <= out.pin_seconds <= out.seconds
    offloader.restore()
    back = offloader.last_stats
    assert back is not None and 0 < back.copy_seconds <= back.seconds


def test_concurrent_hooks_move_the_state_once(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(64)
    offloader = TorchOffloader()
    offloader.add_tensors(t)
    results: list[int] = []
    lock = threading.Lock()
    # The race made certain: a call that reaches the copy waits there for the others, and
    # once copied for them again (so none frees a storage another still reads). With the
    # offloader's lock the others are held at the lock: the first waits out the timeout and
    # moves the state alone. Without it, every call planned the same copy and all move it.
    overlap = threading.Barrier(4, timeout=1.0)
    copy = offloader._run

    def copy_when_overlapping(copies: list[Any]) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            overlap.wait()
        copy(copies)
        with contextlib.suppress(threading.BrokenBarrierError):
            overlap.wait()

    monkeypatch.setattr(offloader, "_run", copy_when_overlapping)

    def run() -> None:
        moved = offloader.offload()
        with lock:
            results.append(moved)

    threads = [threading.Thread(target=run) for _ in range(overlap.parties)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 0, 0, 256]


def test_register_wires_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(4, 4)
    offloader = TorchOffloader()
    offloader.add_module(model)
    calls: list[dict[str, Any]] = []

    def fake_register(group_id: str, **kwargs: Any) -> str:
        calls.append({"group_id": group_id, **kwargs})
        return "registration"

    monkeypatch.setattr(timeslice.worker, "register", fake_register)
    assert offloader.register("g", job_id="j") == "registration"  # type: ignore[comparison-overlap]
    (call,) = calls
    assert call["group_id"] == "g" and call["job_id"] == "j"
    assert call["state_bytes"] == storage_bytes(*module_tensors(model)) == 80
    assert call["on_checkpoint"]() == HookResult(bytes_moved=80) and released(model.weight)
    assert call["on_restore"]() == HookResult(bytes_moved=80)
    assert_resident(model.weight)

    offloader.register("g", state_bytes=5)
    assert calls[1]["state_bytes"] == 5


def test_import_timeslice_does_not_import_torch() -> None:
    code = "import sys, timeslice; assert 'torch' not in sys.modules, 'torch imported'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("libs", "services"))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
