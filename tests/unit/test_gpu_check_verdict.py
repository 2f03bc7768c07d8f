"""How the GPU check judges a backend and reports it (scripts/gpu_check/verdict.py, report.py)."""

from __future__ import annotations

from typing import Any

import torch

from scripts.gpu_check import analysis, report, verdict
from scripts.gpu_check.state import build_state

GIB = 1 << 30


def _event(job: int, hold: int, **extra: Any) -> analysis.HoldEvent:
    data = {
        "hold": hold,
        "switched": hold > 0 or job == 1,
        "checksum_ok": True,
        "checksum_seconds": 0.1,
        "nvml_own_bytes": 40 * GIB,
        "nvml_peer_bytes": 0,
    }
    return analysis.HoldEvent(job, {**data, **extra})  # fmt: skip


def _figures(events: list[analysis.HoldEvent], *, nvml_skip: str = "") -> dict[str, Any]:
    return {
        "switches": {
            "target": 2,
            "observed": sum(1 for e in events if e["switched"]),
            "holds": len(events),
        },
        "checksums": analysis.checksums(events),
        "nvml": analysis.nvml_check(events, skipped=nvml_skip, limit_bytes=0),
        "journal": analysis.journal_moves([], {"app-job-0", "app-job-1"}),
    }


GOOD = [_event(0, 0), _event(1, 0), _event(0, 1)]


def test_all_good_with_nvml_passes() -> None:
    figures = _figures(GOOD)
    found = verdict.findings(figures, switches=2)
    assert found == []
    assert verdict.status(found, figures["nvml"]["status"], device="cuda") == "passed"


def test_nvml_inconclusive_or_skipped_is_never_a_pass() -> None:
    blind = [_event(e.job, e["hold"], nvml_own_bytes=0) for e in GOOD]
    figures = _figures(blind)
    assert figures["nvml"]["status"].startswith("inconclusive")
    found = verdict.findings(figures, switches=2)
    assert verdict.status(found, figures["nvml"]["status"], device="cuda") == "unverified"
    skipped = _figures(GOOD, nvml_skip="--no-nvml")
    assert verdict.status([], skipped["nvml"]["status"], device="cuda") == "unverified"
    assert verdict.exit_status({"cuda": {"status": "unverified"}}) == 0


def test_a_planted_mismatch_fails_and_is_named() -> None:
    bad = [*GOOD[:2], _event(0, 1, checksum_ok=False, mismatch="weight word 7: expected ...")]
    figures = _figures(bad)
    found = verdict.findings(figures, switches=2)
    assert any("MISMATCH" in f and "weight word 7" in f for f in found)
    assert verdict.status(found, figures["nvml"]["status"], device="cuda") == "failed"
    backends = {"cuda": {"status": "failed"}, "app": {"status": "passed"}}
    assert verdict.exit_status(backends) == 1


def test_a_real_one_byte_flip_is_found_by_the_state_check() -> None:
    state = build_state(torch.device("cpu"), 1 << 20, seed=3)
    assert state.verify() is None
    where = state.corrupt_one_byte()
    mismatch = state.verify()
    assert mismatch is not None and mismatch.tensor == "weight"
    assert f"word {mismatch.word}" in where


def test_memory_held_by_the_switched_out_job_fails() -> None:
    held = [_event(e.job, e["hold"], nvml_peer_bytes=GIB) for e in GOOD]
    figures = _figures(held)
    found = verdict.findings(figures, switches=2)
    assert figures["nvml"]["status"] == "failed" and any("NVML" in f for f in found)


def test_missing_switches_and_failed_directives_fail() -> None:
    figures = _figures(GOOD[:2])
    figures["journal"] = analysis.journal_moves(
        [{"kind": "checkpoint", "job": "app-job-0", "status": "failed", "error": "boom",
          "epoch": 3, "bytes_moved": 0, "started_at": 0.0, "finished_at": 1.0}],
        {"app-job-0"},
    )  # fmt: skip
    found = verdict.findings(figures, switches=2)
    assert any("only 1 of 2 switches" in f for f in found)
    assert any("checkpoint FAILED" in f and "boom" in f for f in found)


def test_the_summary_table_ends_with_the_exit_status() -> None:
    figures = _figures(GOOD)
    result = {
        "mode": "gpu", "seconds": 12.0, "plan": {"job_gib": 47.8},
        "floor": {"out_gbps": 20.0, "in_gbps": 22.0},
        "smoke": {"ok": True, "states": [["lock", "locked"]], "child_check": "ok"},
        "backends": {
            "cuda": {"status": "passed", "findings": [], **figures,
                     "targets": {"out_gbps": 10.0, "out_x_floor": 0.5}},
            "app": {"status": "failed", "findings": ["restore MISMATCH: job 0 hold 1: x"]},
        },
    }  # fmt: skip
    lines = report.summary_table(result, 1).splitlines()
    assert lines[-1].startswith("[gpu-check] exit status 1")
    assert any(line.startswith("cuda") and "passed" in line and "0.50x" in line for line in lines)
    assert any("restore MISMATCH" in line for line in lines)
    assert any(line.startswith("smoke") for line in lines)
