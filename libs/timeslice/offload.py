"""PyTorch adapter for the ``app`` backend: a worker moves its own torch state off the device.

:class:`TorchOffloader` tracks modules (parameters, their gradients and buffers), optimizers
(their ``state`` tensors, looked up at each offload because optimizers create state lazily at
their first step) and loose tensors. :meth:`TorchOffloader.offload` copies every device
storage they use into host memory (pinned when the storage is on CUDA) and then frees it;
:meth:`TorchOffloader.restore` re-allocates each storage and copies the bytes back::

    from timeslice.offload import TorchOffloader

    offloader = TorchOffloader()
    offloader.add_module(model)
    offloader.add_optimizer(optimizer)
    registration = offloader.register("trainer-group")   # hooks: offload / restore

How it works, and what follows from it:

* It works on storages, not tensors, deduplicated by storage identity: tied weights, views,
  non-contiguous tensors and every dtype move as raw bytes, and come back bit-exact into the
  *same* storage objects (``untyped_storage().resize_(0)`` to free, ``resize_(nbytes)`` and a
  copy to restore). Every tensor, view, optimizer and other Python reference stays valid.
* Because the storages are freed and re-allocated, their device addresses change across a
  cycle: captured CUDA graphs and raw data pointers (``data_ptr()`` handed to a C library)
  do **not** survive an offload/restore. A mechanism that keeps the virtual addresses (CUDA
  virtual memory management, as the ``torch-memory-saver`` package on PyPI does) would; it
  could sit behind this same interface, but is not implemented here.
* Copies run in chunks of at most ``chunk_bytes`` spread over ``num_streams`` CUDA streams.
  All copies finish before any device storage is freed, so a failed offload changes nothing;
  a failed restore frees again what it re-allocated and stays offloaded, so it can be retried.
* Each tracked object carries a tag; each tag has an :class:`OffloadMode`. ``DISCARD`` tags
  (a KV cache, say) are freed without a copy and come back zeroed (then handed to an
  optional ``recreate`` callback). ``offload`` / ``restore`` can act on chosen tags only.
* A storage shared by two tags moves with the tag offloaded first. Storages that are already
  empty (size 0) or on the ``meta`` device are skipped.
* With ``keep_pinned`` the host copy outlives the restore, so a storage that was not written
  since its last restore (a sampler's weights between weight syncs, a frozen base under LoRA)
  is freed on the next offload *without* copying it out again; only the written ones are
  copied. "Not written" is read from torch's version counters of every tracked tensor on the
  storage (each in-place op, ``copy_``, ``load_state_dict`` and optimizer step bumps them),
  never guessed. Writes torch does not count are invisible to them: through ``tensor.data``
  (a new counter each time), through raw pointers (a custom kernel or library handed
  ``data_ptr()``), or through a tensor the offloader does not track that shares the storage.
  Code that writes so calls :meth:`TorchOffloader.mark_written` before the next offload, or
  turns the skip off with ``skip_unchanged=False``.

The same code runs on CPU tensors (the tests do): there the "device" copy is a plain,
synchronous copy into a separate host buffer. ``torch`` is an optional dependency
(``timeslice-sdk[torch]``); ``import timeslice`` does not import this module.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from timeslice import worker
from timeslice._parking import (
    Kept,
    Parked,
    Slot,
    bytes_of,
    lay_out,
    refuse_fixed,
    same_layout,
    storage_key,
    storages_of,
    versions,
    whole,
)
from timeslice.errors import InvalidArgument

log = logging.getLogger("timeslice.offload")

DEFAULT_TAG = "default"
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
DEFAULT_NUM_STREAMS = 4

RecreateFn = Callable[[torch.Tensor], None]
"""Re-fills a discarded tensor after its storage came back (zeroed) on restore."""


class OffloadMode(enum.Enum):
    """What happens to a tag's storages on offload."""

    OFFLOAD = "offload"
    """Copied to host memory, freed, and copied back on restore."""
    DISCARD = "discard"
    """Freed without a copy; on restore re-allocated, zeroed and passed to ``recreate``."""


@dataclass(frozen=True)
class CycleStats:
    """What the last :meth:`TorchOffloader.offload` or :meth:`TorchOffloader.restore` did."""

    copied_bytes: int
    """Device bytes copied out (offload) or back in (restore); what the call returned."""
    discarded_bytes: int
    """Device bytes of ``DISCARD`` tags freed (offload) or re-allocated and zeroed (restore)."""
    storages: int
    """Storages freed or re-allocated."""
    seconds: float
    """The whole call."""
    skipped_bytes: int = 0
    """Offload only: device bytes freed without a copy because the kept host copy was still
    current (``keep_pinned``; see the module docstring)."""
    pin_seconds: float = 0.0
    """Offload only, of ``seconds``: laying out and allocating the host buffers (for CUDA
    state, pinning them: slow for many GiB, and what ``keep_pinned`` saves)."""
    copy_seconds: float = 0.0
    """Of ``seconds``: the copies, from the first issued to the last finished."""

    @property
    def freed_bytes(self) -> int:
        """Offload: the tracked bytes the call took off the device, copied or not."""
        return self.copied_bytes + self.skipped_bytes + self.discarded_bytes


@dataclass
class _Tag:
    mode: OffloadMode = OffloadMode.OFFLOAD
    recreate: RecreateFn | None = None
    modules: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)  # host buffers (uint8)
    parked: Parked | None = None
    kept: Kept | None = None  # after a restore with keep_pinned and skip_unchanged

    def collect(self) -> Iterator[torch.Tensor]:
        """Every tensor of the tag as of now (optimizer state and gradients come and go)."""
        for module in self.modules:
            for param in module.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from module.buffers()
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        yield value
        yield from self.tensors


@dataclass
class _Plan:
    """One tag's part of an offload in progress: nothing is committed before it succeeds."""

    name: str
    tag: _Tag
    slots: list[Slot]
    buffers: list[torch.Tensor]
    discarded: list[torch.Tensor]
    to_copy: list[Slot]  # the slots whose bytes go out; the rest are discarded or current


@dataclass(frozen=True)
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    device: torch.device  # the non-host side
    lane: int


class TorchOffloader:
    """Moves a worker's torch state off the device and back (see the module docstring).

    Args:
        chunk_bytes: the largest single copy, and the size of each host buffer.
        num_streams: CUDA streams the chunk copies are spread over (per device).
        keep_pinned: keep the host buffers after a restore and reuse them on the next
            offload. That saves re-pinning (slow, for many GiB) on every cycle, and copying out
            again what was not written since the restore, at the cost of holding the host
            memory all the time. By default they are freed after a restore.
        skip_unchanged: with ``keep_pinned``, free a storage not written since its last
            restore without copying it out again (default); see the module docstring for
            the writes this can not see.

    All methods are thread-safe: one lock serialises them, so the agent's hooks (which run in
    a worker thread) can not interleave with each other or with the trainer's own calls.
    """

    def __init__(
        self,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_streams: int = DEFAULT_NUM_STREAMS,
        keep_pinned: bool = False,
        skip_unchanged: bool = True,
    ) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise InvalidArgument(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
        if isinstance(num_streams, bool) or not isinstance(num_streams, int) or num_streams < 1:
            raise InvalidArgument(f"num_streams must be an int >= 1, got {num_streams!r}")
        self.chunk_bytes = chunk_bytes
        self.num_streams = num_streams
        self.keep_pinned = keep_pinned
        self.skip_unchanged = skip_unchanged
        self._lock = threading.RLock()  # the agent hook reads last_stats under it too
        self._tags: dict[str, _Tag] = {}
        self._streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
        self._last: CycleStats | None = None

    # ------------------------------------------------------------------ tracking

    def add_module(self, module: nn.Module, *, tag: str = DEFAULT_TAG) -> None:
        """Track a module's parameters (and their ``.grad``) and buffers under ``tag``."""
        if not isinstance(module, nn.Module):
            raise InvalidArgument(f"expected a torch.nn.Module, got {type(module).__name__}")
        named: list[tuple[str, torch.Tensor]] = []
        for name, param in module.named_parameters():
            named.append((f"parameter {name!r}", param))
            if param.grad is not None:
                named.append((f"gradient of {name!r}", param.grad))
        named += [(f"buffer {name!r}", buffer) for name, buffer in module.named_buffers()]
        refuse_fixed(named, f"module {type(module).__name__}")
        with self._lock:
            self._open(tag).modules.append(module)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, *, tag: str = DEFAULT_TAG) -> None:
        """Track an optimizer's ``state`` tensors under ``tag`` (not its parameters: track the
        module for those)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgument(
                f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        # Its state appears at its first step, later: _plan checks that part again.
        index = {
            id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        }
        refuse_fixed(
            [
                (f"state {key!r} of parameter {index.get(id(param), '?')}", value)
                for param, state in optimizer.state.items()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            ],
            f"optimizer {type(optimizer).__name__}",
        )
        with self._lock:
            self._open(tag).optimizers.append(optimizer)

    def add_tensors(self, *tensors: torch.Tensor, tag: str = DEFAULT_TAG) -> None:
        """Track loose tensors under ``tag``; a view brings its whole storage along."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise InvalidArgument(f"expected torch.Tensor, got {type(tensor).__name__}")
        refuse_fixed(
            [(f"tensor {i} ({tuple(t.shape)}, {t.dtype})", t) for i, t in enumerate(tensors)],
            "add_tensors",
        )
        with self._lock:
            self._open(tag).tensors.extend(tensors)

    def set_mode(self, tag: str, mode: OffloadMode, *, recreate: RecreateFn | None = None) -> None:
        """Set what offload does with ``tag`` (default :attr:`OffloadMode.OFFLOAD`).

        ``recreate`` (``DISCARD`` only) is called on restore with each tracked tensor of the
        tag, after its storage was re-allocated and zeroed.
        """
        if not isinstance(mode, OffloadMode):
            raise InvalidArgument(f"mode must be an OffloadMode, got {mode!r}")
        if recreate is not None and mode is not OffloadMode.DISCARD:
            raise InvalidArgument("recreate only applies to OffloadMode.DISCARD")
        if recreate is not None and not callable(recreate):
            raise InvalidArgument(f"recreate must be callable, got {recreate!r}")
        with self._lock:
            state = self._open(tag)
            state.mode = mode
            state.recreate = recreate
            if mode is OffloadMode.DISCARD:
                state.buffers = []  # nothing will be copied

    # ------------------------------------------------------------------ state

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag known so far, in the order first used."""
        with self._lock:
            return tuple(self._tags)

    @property
    def offloaded_tags(self) -> frozenset[str]:
        """The tags currently offloaded."""
        with self._lock:
            return frozenset(name for name, tag in self._tags.items() if tag.parked is not None)

    @property
    def offloaded(self) -> bool:
        """True while any tag is offloaded."""
        return bool(self.offloaded_tags)

    @property
    def device_bytes(self) -> int:
        """Bytes of the tracked storages now allocated (each shared storage counted once)."""
        with self._lock:
            seen: set[int] = set()
            total = 0
            for tag in self._tags.values():
                for storage in storages_of(tag.collect(), seen):
                    total += storage.nbytes()
            return total

    @property
    def host_bytes(self) -> int:
        """Bytes of host buffers held: the parked copies, plus kept buffers (``keep_pinned``)."""
        with self._lock:
            return sum(b.numel() for tag in self._tags.values() for b in tag.buffers)

    @property
    def last_stats(self) -> CycleStats | None:
        """What the last offload or restore that moved anything did; ``None`` before."""
        with self._lock:
            return self._last

    def release_host_buffers(self) -> int:
        """Free the host buffers kept (``keep_pinned``) by tags that are not offloaded.

        Returns the bytes released.
        """
        with self._lock:
            released = 0
            for tag in self._tags.values():
                if tag.parked is None:
                    released += sum(b.numel() for b in tag.buffers)
                    tag.buffers = []
                    tag.kept = None  # its slots are views into those buffers
            if released:
                _empty_host_cache()
            return released

    def mark_written(self, tags: str | Iterable[str] | None = None) -> None:
        """Declare that the state of ``tags`` (default: all) was written in a way torch's
        version counters do not see (``tensor.data``, raw pointers): the next offload copies
        all of it out again. Only matters with ``keep_pinned`` and ``skip_unchanged``."""
        with self._lock:
            for name in self._select(tags):
                self._tags[name].kept = None

    # ------------------------------------------------------------------ offload / restore

    def offload(self, tags: str | Iterable[str] | None = None) -> int:
        """Move the state of ``tags`` (default: all) off the device.

        Copies every ``OFFLOAD`` storage to host memory, waits for the copies, then frees
        those storages and the ``DISCARD`` ones. Tags already offloaded are left alone, so a
        second call is a no-op returning 0. On failure nothing is freed and the error is
        re-raised.

        Returns:
            The device bytes copied to the host. Bytes freed without a copy (``DISCARD``) are
            not included; :attr:`last_stats` has them as ``discarded_bytes``.
        """
        with self._lock:
            started = time.perf_counter()
            pending = [n for n in self._select(tags) if self._tags[n].parked is None]
            # A tag with nothing allocated stays as it is (not "offloaded").
            plans = [plan for plan in self._plan(pending) if plan.slots]
            if not plans:
                return 0
            pinned = time.perf_counter()
            self._run(
                [
                    _Copy(
                        dst=piece.host,
                        src=bytes_of(slot.storage, piece),
                        device=slot.storage.device,
                        lane=piece.lane,
                    )
                    for plan in plans
                    for slot in plan.to_copy
                    for piece in slot.pieces
                ]
            )  # a failure here leaves every storage as it was
            copied = time.perf_counter()
            # Storages with a host copy go first: if freeing fails half-way, those can be
            # brought back unchanged.
            order = sorted((s for p in plans for s in p.slots), key=lambda s: not s.pieces)
            freed: list[Slot] = []
            try:
                for slot in order:
                    _resize(slot.storage, 0)
                    freed.append(slot)
            except BaseException:
                # Unreachable for resizable storages (checked above), but should it happen: put
                # back what was freed (copied ones unchanged; discarded ones come back zeroed).
                self._bring_back(freed, [])
                raise
            for plan in plans:
                plan.tag.parked = Parked(plan.slots, plan.discarded)
                plan.tag.buffers = plan.buffers
                plan.tag.kept = None
            if any(slot.storage.device.type == "cuda" for slot in order):
                # Hand the freed blocks back to the driver, or other processes can not use them.
                torch.cuda.empty_cache()
            sent = sum(slot.nbytes for plan in plans for slot in plan.to_copy)
            stats = self._stats(
                order,
                started,
                copied_bytes=sent,
                pin_seconds=pinned - started,
                copy_seconds=copied - pinned,
            )
            return self._record("offloaded", [p.name for p in plans], stats)

    def restore(self, tags: str | Iterable[str] | None = None) -> int:
        """Bring the state of ``tags`` (default: all) back to the device, bit-exact.

        Each storage is re-allocated in place and its bytes copied back (``DISCARD`` tags:
        zeroed, then ``recreate``). Tags not offloaded are left alone, so a second call is a
        no-op returning 0. On failure whatever was re-allocated is freed again, the tags stay
        offloaded (a retry can succeed) and the error is re-raised.

        Returns:
            The device bytes copied back from the host.
        """
        with self._lock:
            started = time.perf_counter()
            names = [n for n in self._select(tags) if self._tags[n].parked is not None]
            if not names:
                return 0
            slots: list[Slot] = []
            recreates: list[tuple[RecreateFn, list[torch.Tensor]]] = []
            for name in names:
                tag = self._tags[name]
                assert tag.parked is not None
                slots.extend(tag.parked.slots)
                if tag.recreate is not None:
                    recreates.append((tag.recreate, tag.parked.discarded))
            copy_seconds = self._bring_back(slots, recreates)
            copied = sum(slot.nbytes for slot in slots if slot.pieces)
            stats = self._stats(slots, started, copied_bytes=copied, copy_seconds=copy_seconds)
            # Drop every reference to the host buffers before emptying torch's pinned cache:
            # a buffer still referenced (through a slot's piece) is not freed by it, and once
            # dropped later it would sit pinned in the cache for good.
            del slots, recreates
            released = False
            for name in names:
                tag = self._tags[name]
                parked, tag.parked = tag.parked, None
                assert parked is not None
                if self.keep_pinned and self.skip_unchanged and tag.mode is OffloadMode.OFFLOAD:
                    tag.kept = Kept(parked.slots, versions(tag.collect()))
                elif not self.keep_pinned:
                    released = released or bool(tag.buffers)
                    tag.buffers = []
                del parked
            if released:
                _empty_host_cache()
            return self._record("restored", names, stats)

    def register(
        self,
        group_id: str,
        *,
        job_id: str | None = None,
        pid: int | None = None,
        state_bytes: int | None = None,
        socket: str | None = None,
        acquirer: bool = False,
        timeout: float = 10.0,
    ) -> worker.WorkerRegistration:
        """Register this process with the node agent, with :meth:`offload` / :meth:`restore`
        as its checkpoint / restore hooks.

        ``state_bytes`` defaults to :attr:`device_bytes` now; the other arguments are those of
        :func:`timeslice.worker.register`.
        """
        return worker.register(
            group_id,
            job_id=job_id,
            pid=pid,
            state_bytes=self.device_bytes if state_bytes is None else state_bytes,
            socket=socket,
            on_checkpoint=self._offload_hook,
            on_restore=self._restore_hook,
            acquirer=acquirer,
            timeout=timeout,
        )

    def _offload_hook(self) -> worker.HookResult:
        """The agent's checkpoint hook: everything freed counts as moved off the device, and
        what was freed without a copy is reported as skipped."""
        with self._lock:
            before = self._last
            self.offload()
            stats = self._last
        if stats is None or stats is before:
            return worker.HookResult(bytes_moved=0)
        return worker.HookResult(
            bytes_moved=stats.copied_bytes + stats.skipped_bytes,
            bytes_skipped=stats.skipped_bytes,
        )

    def _restore_hook(self) -> worker.HookResult:
        with self._lock:
            restored = self.restore()
            # The buffers kept (keep_pinned) take the next offload: no new host memory.
            return worker.HookResult(bytes_moved=restored, host_bytes_kept=self.host_bytes)

    def __repr__(self) -> str:
        return (
            f"TorchOffloader(tags={list(self.tags)!r}, offloaded={sorted(self.offloaded_tags)!r}, "
            f"chunk_bytes={self.chunk_bytes}, num_streams={self.num_streams}, "
            f"keep_pinned={self.keep_pinned}, skip_unchanged={self.skip_unchanged})"
        )

    # ------------------------------------------------------------------ internals

    def _open(self, tag: str) -> _Tag:
        if not isinstance(tag, str) or not tag:
            raise InvalidArgument(f"tag must be a non-empty str, got {tag!r}")
        state = self._tags.setdefault(tag, _Tag())
        if state.parked is not None:
            # The parked record would not cover the new objects, nor could restore undo it.
            raise InvalidArgument(f"tag {tag!r} is offloaded; restore it before changing it")
        return state

    def _select(self, tags: str | Iterable[str] | None) -> list[str]:
        if tags is None:
            return list(self._tags)
        names = [tags] if isinstance(tags, str) else list(dict.fromkeys(tags))
        unknown = [n for n in names if n not in self._tags]
        if unknown:
            raise InvalidArgument(f"unknown tags {unknown!r}; known: {list(self._tags)!r}")
        return names

    def _plan(self, names: list[str]) -> list[_Plan]:
        """Lay out the host copies of the tags' storages; allocates host buffers only."""
        seen: set[int] = set()
        plans: list[_Plan] = []
        lane = 0
        for name in names:
            tag = self._tags[name]
            tensors = list(tag.collect())
            storages = list(storages_of(tensors, seen))
            for storage in storages:
                if not storage.resizable():
                    raise InvalidArgument(
                        f"tag {name!r}: a {storage.nbytes()}-byte storage on {storage.device} "
                        "can not be resized (memory borrowed from numpy or DLPack?), so it "
                        "can not be offloaded"
                    )
            if tag.mode is OffloadMode.DISCARD:
                keys = {s._cdata for s in storages}
                mine = {id(t): t for t in tensors if storage_key(t) in keys}
                discarded = list(mine.values())
                slots = [Slot(s, s.nbytes(), []) for s in storages]
                plans.append(_Plan(name, tag, slots, [], discarded, []))
                continue
            kept = tag.kept
            if kept is not None and same_layout(kept.slots, storages):
                # The host copy of the last restore is laid out for exactly these storages:
                # copy out only the ones written since.
                written = kept.written(tensors)
                to_copy = [slot for slot in kept.slots if slot.storage._cdata in written]
                plans.append(_Plan(name, tag, kept.slots, tag.buffers, [], to_copy))
                continue
            slots, buffers = lay_out(
                storages, tag.buffers, chunk=self.chunk_bytes, lane=lane, lanes=self.num_streams
            )
            lane += len(buffers)
            plans.append(_Plan(name, tag, slots, buffers, [], slots))
        return plans

    def _bring_back(
        self, slots: list[Slot], recreates: list[tuple[RecreateFn, list[torch.Tensor]]]
    ) -> float:
        """Re-allocate the slots' storages and fill them; on failure free them again.

        Returns the seconds the copies took (allocation and zeroing not included).
        """
        allocated: list[Slot] = []
        try:
            for slot in slots:
                _resize(slot.storage, slot.nbytes)
                allocated.append(slot)
            started = time.perf_counter()
            self._run(
                [
                    _Copy(
                        dst=bytes_of(slot.storage, piece),
                        src=piece.host,
                        device=slot.storage.device,
                        lane=piece.lane,
                    )
                    for slot in slots
                    for piece in slot.pieces
                ]
            )
            copy_seconds = time.perf_counter() - started
            with torch.no_grad():
                for slot in slots:
                    if not slot.pieces:
                        whole(slot.storage).zero_()
                for recreate, tensors in recreates:
                    for tensor in tensors:
                        recreate(tensor)
            for device in {slot.storage.device for slot in slots} - {torch.device("cpu")}:
                if device.type == "cuda":
                    # Zeroing and recreate ran on this thread's stream; the job may use another.
                    torch.cuda.synchronize(device)
            return copy_seconds
        except BaseException:
            for slot in allocated:
                try:
                    _resize(slot.storage, 0)
                except Exception:  # keep going: the others must be freed too
                    log.exception("could not free a %d-byte storage again", slot.nbytes)
            if any(slot.storage.device.type == "cuda" for slot in allocated):
                torch.cuda.empty_cache()
            raise

    def _run(self, copies: list[_Copy]) -> None:
        """Run the copies and wait for all of them, also when one fails."""
        used: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
        try:
            with torch.no_grad():
                for copy in copies:
                    if copy.device.type != "cuda":
                        _copy(copy.dst, copy.src, non_blocking=False)
                        continue
                    key = (copy.device, copy.lane)
                    if key not in used:
                        if all(device != copy.device for device, _ in used):
                            # Hooks run in their own thread while the job is paused: whatever
                            # any of its streams still has queued on these storages (or, on
                            # restore, on the memory just allocated) must finish first.
                            torch.cuda.synchronize(copy.device)
                        used[key] = self._stream(key)
                    with torch.cuda.stream(used[key]):
                        _copy(copy.dst, copy.src, non_blocking=True)
        finally:
            # Nothing may be freed, nor a failure reported, while a copy is still in flight.
            for stream in used.values():
                stream.synchronize()

    def _stream(self, key: tuple[torch.device, int]) -> torch.cuda.Stream:
        stream = self._streams.get(key)
        if stream is None:
            # torch leaves Stream's constructor untyped.
            stream = torch.cuda.Stream(key[0])  # type: ignore[no-untyped-call]
            self._streams[key] = stream
        return stream

    @staticmethod
    def _stats(
        slots: list[Slot],
        started: float,
        *,
        copied_bytes: int,
        pin_seconds: float = 0.0,
        copy_seconds: float = 0.0,
    ) -> CycleStats:
        """What a cycle over ``slots`` did: those with a host copy and not among the
        ``copied_bytes`` were skipped; those without one were discarded."""
        with_copy = sum(slot.nbytes for slot in slots if slot.pieces)
        return CycleStats(
            copied_bytes=copied_bytes,
            discarded_bytes=sum(slot.nbytes for slot in slots if not slot.pieces),
            storages=len(slots),
            seconds=time.perf_counter() - started,
            skipped_bytes=with_copy - copied_bytes,
            pin_seconds=pin_seconds,
            copy_seconds=copy_seconds,
        )

    def _record(self, verb: str, names: list[str], stats: CycleStats) -> int:
        """Record and log a completed cycle; returns the bytes copied."""
        self._last = stats
        log.info(
            "%s tags %s: %d bytes copied, %d skipped (host copy current), %d discarded, "
            "%d storages in %.3fs (host buffers %.3fs, copies %.3fs)",
            verb,
            names,
            stats.copied_bytes,
            stats.skipped_bytes,
            stats.discarded_bytes,
            stats.storages,
            stats.seconds,
            stats.pin_seconds,
            stats.copy_seconds,
        )
        return stats.copied_bytes


def _copy(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
    """One chunk copy (a function of its own so tests can make it fail)."""
    dst.copy_(src, non_blocking=non_blocking)


def _resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Free (``nbytes=0``) or re-allocate a storage in place (tests make this fail)."""
    storage.resize_(nbytes)


def _empty_host_cache() -> None:
    # torch caches freed pinned buffers for reuse; without this "freed" host memory stays
    # pinned in this process. The call is missing from CPU-only builds.
    if torch.cuda.is_available():
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()
