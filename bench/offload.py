"""The offloader next to its copy floor, in one process and one run.

    python -m bench.offload                       # 0.25 GiB of fp32 in 4 parameters, CPU
    python -m bench.offload --gib 4 --device cuda  # on a GPU machine
    python -m bench.offload --rounds 7 --json /tmp/offload.json

A switch's cost is the copy, so :class:`timeslice.offload.TorchOffloader` is held to what a
plain ``copy_`` of the same tensors costs on the same machine, measured in the same rounds:

* **offload floor**: ``copy_`` of each tensor into host buffers allocated (and, for CUDA
  tensors, pinned) before the clock starts;
* **restore floor**: re-allocating the freed storages (``resize_``) plus ``copy_`` back.

Against them, per round (the order rotates, so a drift of a shared host's speed hits all
alike), each offloader mode runs one offload and one restore of the same parameters:

* ``keep_pinned`` with ``skip_unchanged=False``: host buffers reused, every byte copied each
  time: the copy path itself (the target: at least 0.9 x the floor each way);
* default (``keep_pinned=False``): host buffers allocated (pinned, on CUDA) at each offload and
  released after each restore: the allocation is part of the offload, and ``pin_seconds``
  says how much of it;
* ``keep_pinned`` (``skip_unchanged`` on) of an unchanged module: nothing is copied out (the
  target: every byte skipped).

Each figure is the median over ``--rounds`` in GB/s (10^9 bytes) and as a ratio of the
floor. The offload ratio is given twice: the whole call (it also frees the device memory,
which the floor does not) and its copy phase alone (``CycleStats.copy_seconds``).

On CPU, 4 KiB pages make first touches and frees dominate both the floor and the offloader;
``THP_MEM_ALLOC_ENABLE=1`` (torch's transparent-huge-page allocation, set here before torch is
imported unless ``--no-thp``) takes most of that away for both. The machine and the setting
are printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
TARGET_RATIO = 0.9

if __name__ == "__main__" and "--no-thp" not in sys.argv:
    # Read once by torch's CPU allocator: it must be set before torch is imported.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench._common import machine_info  # noqa: E402
from timeslice.offload import TorchOffloader  # noqa: E402

MODES = ("floor", "keep_pinned", "default", "unchanged")


@dataclass(frozen=True)
class Sample:
    """One offload and one restore of the whole state by one mode."""

    mode: str
    out_seconds: float
    in_seconds: float
    out_copy_seconds: float
    pin_seconds: float
    copied_bytes: int
    skipped_bytes: int


@dataclass(frozen=True)
class Figure:
    """The median of a mode's samples."""

    mode: str
    out_gbps: float
    in_gbps: float
    out_copy_gbps: float
    out_ratio: float
    out_copy_ratio: float
    in_ratio: float
    pin_seconds: float
    copied_bytes: int
    skipped_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module(total_bytes: int, params: int, device: torch.device) -> nn.Module:
    module = nn.Module()
    per = total_bytes // params // 4
    gen = torch.Generator().manual_seed(0)
    for i in range(params):
        data = torch.randn(per, generator=gen).to(device)
        module.register_parameter(f"p{i}", nn.Parameter(data))
    return module


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat byte view of the tensor's storage, as the offloader copies it. Its own version
    counter: the floor's copies leave the parameters' counters alone, so they do not count
    as writes to the offloader measured beside it (they put back the same bytes)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _floor(module: nn.Module, host: list[torch.Tensor], device: torch.device) -> Sample:
    params = [p.detach() for p in module.parameters()]
    _sync(device)
    started = time.perf_counter()
    for h, p in zip(host, params, strict=True):
        h.copy_(_bytes(p), non_blocking=True)
    _sync(device)
    out = time.perf_counter() - started
    sizes = [p.untyped_storage().nbytes() for p in params]
    for p in params:
        p.untyped_storage().resize_(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    started = time.perf_counter()
    for h, p, n in zip(host, params, sizes, strict=True):
        p.untyped_storage().resize_(n)
        _bytes(p).copy_(h, non_blocking=True)
    _sync(device)
    back = time.perf_counter() - started
    return Sample("floor", out, back, out, 0.0, sum(sizes), 0)


def _cycle(mode: str, offloader: TorchOffloader) -> Sample:
    offloader.offload()
    out = offloader.last_stats
    offloader.restore()
    back = offloader.last_stats
    assert out is not None and back is not None
    return Sample(
        mode,
        out.seconds,
        back.seconds,
        out.copy_seconds,
        out.pin_seconds,
        out.copied_bytes,
        out.skipped_bytes,
    )


def run(gib: float, params: int, rounds: int, device_name: str) -> dict[str, Any]:
    """Measure every mode ``rounds`` times on the same parameters; returns the report."""
    device = torch.device(device_name)
    total = int(gib * GIB)
    module = _module(total, params, device)
    expected = [p.detach().clone().cpu() for p in module.parameters()]
    pin = device.type == "cuda"
    host = [
        torch.empty(p.untyped_storage().nbytes(), dtype=torch.uint8, pin_memory=pin)
        for p in module.parameters()
    ]
    for h in host:
        h.fill_(0)  # touched (and pinned) before any clock starts
    offloaders: dict[str, TorchOffloader] = {
        "keep_pinned": TorchOffloader(keep_pinned=True, skip_unchanged=False),
        "default": TorchOffloader(),
        "unchanged": TorchOffloader(keep_pinned=True),
    }
    for offloader in offloaders.values():
        offloader.add_module(module)
    # Warm-up: first touches, streams, kept buffers; the "unchanged" one gets its host copy.
    _floor(module, host, device)
    for mode, offloader in offloaders.items():
        _cycle(mode, offloader)
    runs: dict[str, list[Sample]] = {mode: [] for mode in MODES}
    for index in range(rounds):
        order = MODES[index % len(MODES) :] + MODES[: index % len(MODES)]
        for mode in order:
            sample = (
                _floor(module, host, device) if mode == "floor" else _cycle(mode, offloaders[mode])
            )
            runs[mode].append(sample)
    intact = all(
        torch.equal(p.detach().cpu(), e) for p, e in zip(module.parameters(), expected, strict=True)
    )
    figures = _figures(runs)
    keep, unchanged = figures["keep_pinned"], figures["unchanged"]
    return {
        "bench": "offload",
        "machine": {**machine_info(), "accelerator": _accelerator(device)},
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"),
        "device": device_name,
        "state_bytes": sum(p.untyped_storage().nbytes() for p in module.parameters()),
        "params": params,
        "rounds": rounds,
        "figures": {mode: asdict(f) for mode, f in figures.items()},
        "targets": {
            "offload >= 0.9x floor (keep_pinned)": keep.out_ratio >= TARGET_RATIO,
            "restore >= 0.9x floor (keep_pinned)": keep.in_ratio >= TARGET_RATIO,
            "unchanged module: every byte skipped": unchanged.copied_bytes == 0
            and unchanged.skipped_bytes == keep.copied_bytes,
            "bit-exact after every cycle": intact,
        },
    }


def _accelerator(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "none (CPU tensors: the 'device' copy is a host memory copy)"


def _figures(runs: dict[str, list[Sample]]) -> dict[str, Figure]:
    def median(mode: str, pick: Callable[[Sample], float]) -> float:
        return statistics.median(pick(s) for s in runs[mode])

    floor_out = median("floor", lambda s: s.out_seconds)
    floor_in = median("floor", lambda s: s.in_seconds)
    state = runs["floor"][0].copied_bytes
    figures = {}
    for mode in MODES:
        out = median(mode, lambda s: s.out_seconds)
        back = median(mode, lambda s: s.in_seconds)
        copy = median(mode, lambda s: s.out_copy_seconds)
        figures[mode] = Figure(
            mode=mode,
            out_gbps=state / out / 1e9,
            in_gbps=state / back / 1e9,
            out_copy_gbps=state / copy / 1e9 if copy > 0 else 0.0,
            out_ratio=floor_out / out,
            out_copy_ratio=floor_out / copy if copy > 0 else 0.0,
            in_ratio=floor_in / back,
            pin_seconds=median(mode, lambda s: s.pin_seconds),
            copied_bytes=int(median(mode, lambda s: s.copied_bytes)),
            skipped_bytes=int(median(mode, lambda s: s.skipped_bytes)),
        )
    return figures


def render(report: dict[str, Any]) -> str:
    """The report as a table, the targets last."""
    m = report["machine"]
    lines = [
        f"bench.offload: {report['state_bytes'] / GIB:.3f} GiB in {report['params']} "
        f"parameters on {report['device']}, median of {report['rounds']} rounds; "
        f"THP_MEM_ALLOC_ENABLE={report['thp_mem_alloc']}",
        f"machine: {m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('memory_gb')} GB, "
        f"{m['accelerator']}; commit {m.get('commit')}",
        "",
        "| mode | out GB/s | out x floor | out copy phase x floor | in GB/s | in x floor "
        "| host buffers s | copied MiB | skipped MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, f in report["figures"].items():
        lines.append(
            f"| {mode} | {f['out_gbps']:.2f} | {f['out_ratio']:.2f} | "
            f"{f['out_copy_ratio']:.2f} | {f['in_gbps']:.2f} | {f['in_ratio']:.2f} | "
            f"{f['pin_seconds']:.4f} | {f['copied_bytes'] / 2**20:.0f} | "
            f"{f['skipped_bytes'] / 2**20:.0f} |"
        )
    lines.append("")
    for name, met in report["targets"].items():
        lines.append(f"{'met' if met else 'MISSED'}: {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__)
    p.add_argument("--gib", type=float, default=0.25, help="state size, GiB (default 0.25)")
    p.add_argument("--params", type=int, default=4, help="parameters it is split into")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--no-thp", action="store_true", help="leave THP_MEM_ALLOC_ENABLE unset")
    args = p.parse_args(argv)
    if args.gib <= 0 or args.params < 1 or args.rounds < 1:
        p.error("--gib must be > 0, --params and --rounds >= 1")
    report = run(args.gib, args.params, args.rounds, args.device)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
