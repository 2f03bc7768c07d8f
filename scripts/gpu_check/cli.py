"""``python -m scripts.gpu_check``: the GPU check, one command, bounded in time.

1. Reads the machine (device memory from the device, host memory from the kernel) and prints
   the plan (:mod:`scripts.gpu_check.plan`): GiB per job, switches, time per backend, why.
   ``--print-plan --gpu-mib N --host-gib M`` prints the plan for such a machine and stops.
2. The driver smoke step (:mod:`scripts.gpu_check.smoke`, ``cuda`` only): a refused checkpoint
   API is one line, and the ``cuda`` backend is then failed without its long run.
3. The copy floor (:mod:`scripts.gpu_check.floor`): a plain pinned ``copy_`` of 4 GiB each way.
4. Per backend (``cuda``: the driver checkpoint API; ``app``: the PyTorch adapter;
   ``cuda-cli``: the ``cuda-checkpoint`` binary, on request), in its time share: a real etcd,
   orchestrator and agent, a trainer and a sampler job switching the group ``--switches``
   times, every restore compared word by word, NVML asked whether the switched-out job's
   memory was freed, bytes moved and skipped per switch, GB/s against the floor.

Under ``$OUT`` (``--out``, default ``./gpu-check-out``) it writes ``result.json``,
``result.md`` and ``logs.tar.gz``, nothing else. The last lines on stdout are the summary
table. Exit status: 1 when any backend failed (a switch missing, a restore mismatch, a failed
directive or job, NVML showing memory held) or the check broke; else 0. A backend NVML could
not verify is "unverified", never "passed".

``--device cpu`` runs the same flow on CPU tensors (``app`` backend only, no NVML): the
figures are then host memory copies, labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from scripts.gpu_check import REPO, report, verdict
from scripts.gpu_check.machine import machine_info
from scripts.gpu_check.plan import (
    DEFAULT_BUDGET_SECONDS,
    GIB,
    MIB,
    REPORT_SECONDS,
    Plan,
    format_plan,
    make_plan,
)
from scripts.gpu_check.runner import BackendSpec, Outcome, Settings, run_backend

# A backend given less than this could not even start its services and jobs: not run.
MIN_SLICE_SECONDS = 30.0
SMOKE_SECONDS = 30.0
FLOOR_SECONDS = 60.0
FLOOR_BYTES = {"cuda": 4 * GIB, "cpu": 64 * MIB}
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
    p.add_argument(
        "--size-gb", type=float, default=0.0,
        help="state per job, GiB (default: the plan's, from the device and host memory)",
    )  # fmt: skip
    p.add_argument("--switches", type=int, default=10, help="switches per backend (default 10)")
    p.add_argument(
        "--backends", default="cuda,app",
        help=f"comma-separated, in order, from {', '.join(BACKENDS)} (default: cuda,app)",
    )  # fmt: skip
    p.add_argument(
        "--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS,
        help="the whole run, probe to report; each backend gets its planned share "
        f"(default {DEFAULT_BUDGET_SECONDS:.0f}: 9 minutes less the wheel install)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="default: $OUT, else ./gpu-check-out")
    p.add_argument(
        "--keep-pinned", action=argparse.BooleanOptionalAction, default=True,
        help="app: the trainer keeps its pinned host copy between switches (the sampler "
        "always does); --no-keep-pinned frees it after each restore",
    )  # fmt: skip
    p.add_argument(
        "--no-nvml", action="store_true",
        help="jobs do not open NVML (the agent still uses it); a rerun's way to rule it out",
    )  # fmt: skip
    p.add_argument(
        "--app-residual-mib", type=int, default=2048,
        help="app: device memory a switched-out job may keep (its CUDA context), MiB",
    )  # fmt: skip
    p.add_argument(
        "--corrupt-after-restore", action="store_true",
        help="self-test: flip one byte of a restored tensor; the check must report the "
        "mismatch and exit non-zero",
    )  # fmt: skip
    p.add_argument("--print-plan", action="store_true", help="print the plan and stop")
    p.add_argument("--gpu-mib", type=int, default=0, help="--print-plan: device memory, MiB")
    p.add_argument("--host-gib", type=float, default=0.0, help="--print-plan: host memory, GiB")
    args = p.parse_args(argv)
    names = list(dict.fromkeys(n.strip() for n in args.backends.split(",") if n.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        p.error(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    if args.size_gb < 0 or args.switches < 1 or args.budget_seconds <= 0:
        p.error("--size-gb, --switches and --budget-seconds must be positive")
    if args.print_plan and args.device == "cuda" and not (args.gpu_mib > 0 < args.host_gib):
        p.error("--print-plan needs --gpu-mib and --host-gib")
    args.backend_names = names
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or "gpu-check-out")
    return args


def plan_for(args: argparse.Namespace, gpu_bytes: int, host_bytes: int) -> Plan:
    runnable = [n for n in args.backend_names if args.device == "cuda" or n == "app"]
    return make_plan(
        device=args.device,
        gpu_bytes=gpu_bytes if args.device == "cuda" else 0,
        host_bytes=host_bytes,
        backends=runnable or ["app"],
        switches=args.switches,
        budget_seconds=args.budget_seconds,
        size_override=int(args.size_gb * GIB),
    )


def device_bytes(machine: dict[str, Any]) -> int:
    """The first device's memory as the device reports it (NVML, else torch), or 0."""
    for device in machine.get("nvml", {}).get("devices", []):
        if device.get("memory_total_bytes"):
            return int(device["memory_total_bytes"])
    for device in machine.get("torch", {}).get("devices", []):
        if device.get("memory_bytes"):
            return int(device["memory_bytes"])
    return 0


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
    if device == "cuda" and not device_bytes(machine):
        return {"status": "failed", "findings": ["the device's memory size could not be read"]}
    return None


def _settings(args: argparse.Namespace, machine: dict[str, Any], plan: Plan,
              logs: Path) -> Settings:  # fmt: skip
    if args.device == "cpu":
        skip = "no NVML (CPU mode)"
    elif args.no_nvml:
        skip = "--no-nvml"
    else:
        error = machine.get("nvml", {}).get("error", "")
        skip = f"no NVML: {error}" if error else ""
    return Settings(
        device=args.device,
        size_bytes=plan.job_bytes,
        switches=args.switches,
        out=args.out,
        keep_pinned=args.keep_pinned,
        app_residual_mib=args.app_residual_mib,
        use_nvml=not skip,
        nvml_skip_reason=skip,
        logs=logs,
        corrupt_after_restore=args.corrupt_after_restore,
    )


def _child_json(module: str, argv: list[str], timeout: float, echo: bool) -> dict[str, Any]:
    """Run ``python -m module argv`` with a deadline; its last stdout line, as JSON."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, *argv], cwd=REPO, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        said = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        last = said.strip().splitlines()[-1:] or ["nothing printed"]
        return {"ok": False, "error": f"did not finish in {timeout:g} s; last: {last[0]}"}
    lines = done.stdout.strip().splitlines()
    if echo:
        for line in lines[:-1]:
            print(line, flush=True)
    try:
        value = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stdout + done.stderr).strip()[-500:]
        return {"ok": False, "error": f"exit {done.returncode}, no result: {tail}"}
    return value if isinstance(value, dict) else {"ok": False, "error": repr(value)}


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


def _pre_phase(args: argparse.Namespace, backends: dict[str, Any],
               runnable: list[str]) -> dict[str, Any]:  # fmt: skip
    """The smoke step (fails ``cuda`` up front when refused) and the copy floor."""
    pre: dict[str, Any] = {}
    if args.device == "cuda" and "cuda" in runnable:
        smoke = _child_json("scripts.gpu_check.smoke", [], SMOKE_SECONDS, echo=True)
        pre["smoke"] = smoke
        if not smoke.get("ok"):
            why = smoke.get("error") or (
                f"states {smoke.get('states')}, child {smoke.get('child_check')}"
            )
            print(f"[gpu-check smoke] FAILED: {why}", flush=True)
            backends["cuda"] = {"status": "failed", "findings": [f"driver smoke step: {why}"]}
            runnable.remove("cuda")
    floor = _child_json("scripts.gpu_check.floor", [args.device, str(FLOOR_BYTES[args.device])],
                        FLOOR_SECONDS, echo=False)  # fmt: skip
    pre["floor"] = floor
    if "error" in floor:
        print(f"[gpu-check] copy floor: {floor['error']}", flush=True)
    else:
        print(
            f"[gpu-check] copy floor ({floor['bytes'] / GIB:.2f} GiB, pinned={floor['pinned']}):"
            f" out {floor['out_gbps']:.1f} GB/s, in {floor['in_gbps']:.1f} GB/s",
            flush=True,
        )
    return pre


def run_all(args: argparse.Namespace, started: float, logs: Path) -> tuple[dict[str, Any], bool]:
    """Every backend in turn within the budget; the result document and whether the check
    itself broke."""
    deadline = started + args.budget_seconds
    machine = machine_info(args.device)
    print(_machine_line(machine), flush=True)
    plan = plan_for(args, device_bytes(machine), int(machine["host"].get("memtotal_bytes", 0)))
    print(format_plan(plan), flush=True)
    settings = _settings(args, machine, plan, logs)
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
    pre = _pre_phase(args, backends, runnable) if runnable else {}
    for position, name in enumerate(runnable):
        # The planned share of what is left: a backend that finishes early leaves its time
        # to the next ones.
        left = deadline - REPORT_SECONDS - time.time()
        weights = [plan.shares.get(n, 1.0) for n in runnable[position:]]
        end = time.time() + left * weights[0] / sum(weights)
        if end - time.time() < MIN_SLICE_SECONDS:
            backends[name] = {"status": "failed", "findings": ["the time budget ran out"]}
            continue
        backends[name], failed = _run_one(settings, name, end)
        broke = broke or failed
        if "switches" in backends[name]:
            backends[name]["targets"] = verdict.targets(name, backends[name], pre.get("floor", {}))
    ordered = {name: backends[name] for name in args.backend_names}
    return report.build(args, settings, machine, plan, pre, ordered, started), broke


def _archive(logs: Path, out: Path) -> None:
    """Every backend's logs in one file: only a few files come back from the machine."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    if args.print_plan:
        print(format_plan(plan_for(args, args.gpu_mib * MIB, int(args.host_gib * GIB))))
        return 0
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"[gpu-check] device {args.device}, {args.switches} switches, backends "
        f"{args.backend_names}, budget {args.budget_seconds:.0f} s, out {args.out}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-logs-") as tmp:
        logs = Path(tmp)
        try:
            result, broke = run_all(args, started, logs)
        except Exception:
            # A bug of the check: still leave a result that says so, then fail.
            trace = traceback.format_exc()
            print(trace, flush=True)
            report.write_broken(args.out, trace)
            _archive(logs, args.out)
            print("[gpu-check] the check itself broke; see result.md", flush=True)
            return 1
        report.write(args.out, result)
        _archive(logs, args.out)
    code = verdict.exit_status(result["backends"], broke=broke)
    # Last on stdout: the caller may see only the tail.
    print(report.summary_table(result, code), flush=True)
    return code
