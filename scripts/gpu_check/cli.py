"""``python -m scripts.gpu_check``: the GPU check, one command, bounded in time.

Per backend under test (``cuda``: the driver checkpoint API; ``app``: the PyTorch adapter;
``cuda-cli``: the ``cuda-checkpoint`` binary, only where it is on ``PATH``) it starts a real
etcd, orchestrator and agent, runs two PyTorch jobs of ``--size-gb`` GiB each that switch the
group ``--switches`` times, checks every restore bit-exact and, with NVML, that the switched-out
job holds no device memory, and measures checkpoint / restore throughput. Results go to
``$OUT/result.json`` and ``$OUT/result.md`` (``--out`` or ``$OUT``, default ``./gpu-check-out``).

What the machine refuses is recorded as a finding and the check goes on; the exit status is
0 when the check ran, 1 only when the check itself broke (its traceback is in the result).

``--device cpu`` runs the same flow on CPU tensors (``app`` backend only, no NVML): the
figures are then host memory copies, labelled so.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path
from typing import Any

from scripts.gpu_check import report
from scripts.gpu_check.machine import machine_info
from scripts.gpu_check.runner import BackendSpec, Outcome, Settings, run_backend

GIB = 1 << 30
REPORT_SECONDS = 5.0
# A backend given less than this could not even start its services and jobs: skipped.
MIN_SLICE_SECONDS = 30.0
BACKENDS = {
    "cuda": BackendSpec(
        "cuda", "cuda", ("--cuda-path", "driver"),
        "whole-process checkpoint through the driver API (cuda-bindings, in the agent)",
    ),
    "app": BackendSpec(
        "app", "app", (), "the jobs' own offload/restore hooks (timeslice.offload.TorchOffloader)"
    ),
    "cuda-cli": BackendSpec(
        "cuda-cli", "cuda", ("--cuda-path", "cli"),
        "whole-process checkpoint through the cuda-checkpoint binary",
    ),
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size-gb", type=float, default=40.0, help="state per job, GiB (default 40)")
    p.add_argument("--switches", type=int, default=10, help="switches per backend (default 10)")
    p.add_argument(
        "--backends", default="cuda,app,cuda-cli",
        help=f"comma-separated, in order, from {', '.join(BACKENDS)} (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--budget-seconds", type=float, default=460.0,
        help="the whole run, setup to report; each backend gets a slice (default 460)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="default: $OUT, else ./gpu-check-out")
    p.add_argument(
        "--keep-pinned", action="store_true",
        help="app: keep the adapter's pinned host buffers between switches (default: free them)",
    )  # fmt: skip
    p.add_argument(
        "--no-nvml", action="store_true",
        help="jobs do not open NVML (the agent still uses it); a rerun's way to rule it out",
    )  # fmt: skip
    p.add_argument(
        "--app-residual-mib", type=int, default=2048,
        help="app: device memory a switched-out job may keep (its CUDA context), MiB",
    )  # fmt: skip
    args = p.parse_args(argv)
    names = list(dict.fromkeys(n.strip() for n in args.backends.split(",") if n.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        p.error(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    if args.size_gb <= 0 or args.switches < 1 or args.budget_seconds <= 0:
        p.error("--size-gb, --switches and --budget-seconds must be positive")
    args.backend_names = names
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or "gpu-check-out")
    return args


def not_runnable(name: str, device: str, machine: dict[str, Any]) -> dict[str, Any] | None:
    """The result of a backend that cannot run here (skipped, or failed up front), or None."""
    if device == "cpu" and name != "app":
        return {"status": "skipped", "reason": "needs --device cuda"}
    if name == "cuda-cli" and not machine.get("cuda_checkpoint_binary"):
        return {"status": "skipped", "reason": "cuda-checkpoint is not on PATH"}
    cuda_error = machine["torch"].get("cuda_error") or machine["torch"].get("error")
    if device == "cuda" and cuda_error:
        # Not a skip: the machine was meant to have a usable GPU.
        return {"status": "failed", "findings": [f"torch cannot use the GPU: {cuda_error}"]}
    return None


def _settings(args: argparse.Namespace, machine: dict[str, Any]) -> Settings:
    if args.device == "cpu":
        skip = "no NVML (CPU mode)"
    elif args.no_nvml:
        skip = "--no-nvml"
    else:
        error = machine.get("nvml", {}).get("error", "")
        skip = f"no NVML: {error}" if error else ""
    return Settings(
        device=args.device,
        size_bytes=int(args.size_gb * GIB),
        switches=args.switches,
        out=args.out,
        keep_pinned=args.keep_pinned,
        app_residual_mib=args.app_residual_mib,
        use_nvml=not skip,
        nvml_skip_reason=skip,
    )


def _run_one(settings: Settings, name: str, deadline: float) -> tuple[dict[str, Any], bool]:
    """One backend's result, and whether the check itself broke while running it."""
    try:
        outcome: Outcome = run_backend(settings, BACKENDS[name], deadline)
    except Exception as exc:
        return {"status": "error", "findings": [f"the check broke: {exc!r}"],
                "traceback": traceback.format_exc()}, True  # fmt: skip
    return {"description": BACKENDS[name].description, **outcome.to_json()}, False


def _machine_line(machine: dict[str, Any]) -> str:
    nvml, torch_info = machine.get("nvml", {}), machine["torch"]
    gpus = [d.get("name") for d in nvml.get("devices", [])]
    return (
        f"[gpu-check] machine: GPUs {gpus or nvml.get('error', 'none')}, driver "
        f"{nvml.get('driver_version', '-')}, CUDA {nvml.get('cuda_driver_version', '-')}, torch "
        f"{torch_info.get('torch_version', torch_info.get('error'))}"
    )


def run_all(args: argparse.Namespace, started: float) -> tuple[dict[str, Any], bool]:
    """Every backend in turn within the budget; the result document and whether the check
    itself broke."""
    deadline = started + args.budget_seconds
    machine = machine_info(args.device)
    print(_machine_line(machine), flush=True)
    settings = _settings(args, machine)
    backends: dict[str, Any] = {}
    broke = False
    runnable = []
    for name in args.backend_names:
        refused = not_runnable(name, args.device, machine)
        if refused is None:
            runnable.append(name)
        else:
            backends[name] = refused
            why = refused.get("reason") or "; ".join(refused["findings"])
            print(f"[gpu-check {name}] {refused['status']}: {why}", flush=True)
    for position, name in enumerate(runnable):
        left = len(runnable) - position
        # An even share of what is left: a backend that finishes early leaves time to the next.
        end = time.time() + (deadline - REPORT_SECONDS - time.time()) / left
        if end - time.time() < MIN_SLICE_SECONDS:
            backends[name] = {"status": "skipped", "reason": "the time budget ran out"}
            continue
        backends[name], failed = _run_one(settings, name, end)
        broke = broke or failed
    ordered = {name: backends[name] for name in args.backend_names}
    return report.build(args, settings, machine, ordered, started), broke


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"[gpu-check] device {args.device}, {args.size_gb:g} GiB per job, "
        f"{args.switches} switches, backends {args.backend_names}, out {args.out}",
        flush=True,
    )
    try:
        result, broke = run_all(args, started)
    except Exception:
        # A bug of the check: still leave a result that says so, then fail.
        trace = traceback.format_exc()
        print(trace, flush=True)
        report.write_broken(args.out, trace)
        return 1
    report.write(args.out, result)
    print(report.summary_line(result), flush=True)
    return 1 if broke else 0
