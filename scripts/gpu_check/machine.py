"""Facts about the machine the check ran on: host, nvidia-smi, NVML, torch.

Every probe has a deadline and records its failure instead of raising: on a sandboxed
machine (gVisor, Firecracker) half of these may be missing, and that is itself a finding.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from scripts.gpu_check import REPO
from scripts.gpu_check.nvml import Nvml, NvmlMissing

COMMAND_SECONDS = 30.0
PROBE_SECONDS = 120.0
_SMI_FIELDS = "name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max"


def _run(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Exit status and output of ``argv`` (None and the reason when it could not finish)."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return done.returncode, (done.stdout + done.stderr).strip()


def host_info() -> dict[str, Any]:
    """Kernel, CPUs, memory, Python; ``/proc/version`` also tells gVisor apart."""
    uname = platform.uname()
    info: dict[str, Any] = {
        "hostname": uname.node,
        "kernel": f"{uname.system} {uname.release}",
        "machine": uname.machine,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    for name, path in (("proc_version", "/proc/version"), ("meminfo", "/proc/meminfo")):
        try:
            text = Path(path).read_text()
        except OSError as exc:
            info[name] = f"unreadable: {exc}"
            continue
        if name == "meminfo":
            values = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            for key in ("MemTotal", "MemAvailable"):
                if key in values:
                    info[f"{key.lower()}_bytes"] = int(values[key].split()[0]) * 1024
        else:
            info[name] = text.strip()
    return info


def nvidia_smi() -> dict[str, Any]:
    """The CSV query and the banner line with the CUDA version, as nvidia-smi prints them."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not on PATH"}
    code, query = _run(
        ["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader"], COMMAND_SECONDS
    )
    out: dict[str, Any] = {"query_fields": _SMI_FIELDS, "query": query, "exit_code": code}
    code, banner = _run(["nvidia-smi"], COMMAND_SECONDS)
    lines = [line for line in banner.splitlines() if "CUDA Version" in line]
    out["banner"] = lines[0].strip(" |") if lines else f"exit {code}: {banner[-300:]}"
    return out


def _nvml_facts() -> dict[str, Any]:
    try:
        with Nvml() as nvml:
            return nvml.machine()
    except NvmlMissing as exc:
        return {"error": str(exc)}
    except Exception as exc:  # a half-working NVML (sandbox): say what broke
        return {"error": f"{type(exc).__name__}: {exc}"}


def nvml_info(timeout: float = COMMAND_SECONDS) -> dict[str, Any]:
    """NVML's facts, from a daemon thread: a wedged driver call must not hang the check."""
    box: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: box.append(_nvml_facts()), daemon=True)
    thread.start()
    thread.join(timeout)
    return box[0] if box else {"error": f"NVML did not answer within {timeout:g} s"}


def torch_info(device: str) -> dict[str, Any]:
    """Run :mod:`scripts.gpu_check.probe` in a child process."""
    code, out = _run([sys.executable, "-m", "scripts.gpu_check.probe", device], PROBE_SECONDS)
    if code != 0:
        last = out.strip().splitlines()[-1] if out.strip() else "no output"
        return {"error": f"probe exited {code}: {last}"}
    try:
        result: dict[str, Any] = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"probe printed no JSON: {out[-2000:]}"}
    return result


def machine_info(device: str) -> dict[str, Any]:
    """Everything above, plus where ``cuda-checkpoint`` is (the cli path needs it)."""
    info: dict[str, Any] = {"host": host_info(), "torch": torch_info(device)}
    if device == "cuda":
        info["nvidia_smi"] = nvidia_smi()
        info["nvml"] = nvml_info()
    info["cuda_checkpoint_binary"] = shutil.which("cuda-checkpoint")
    return info
