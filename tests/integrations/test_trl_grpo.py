"""Real GRPO training (TRL's GRPOTrainer) time-sliced through the app backend, bit-identical.

End to end: ``python -m timeslice_tools.dev.rl`` (what ``make demo-rl`` runs, with fewer
steps) trains two jobs alone, then time-sliced on one group through a real etcd, orchestrator
and agent ``--backend app``, and compares every loss, reward, KL and parameter after every
step. One run covers both verdicts: job ``grpo-b`` gets one bit flipped after a grant
(``--corrupt``), so it must be reported at that step and tensor, while ``grpo-a`` beside it
must come out identical; the exit status is 1. The comparison itself is unit-tested below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from timeslice_tools.dev.rl.demo import first_difference, group_duty, journal_moves

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
CORRUPT_STEP = 2


def _run(steps: int, step: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job's result file with ``steps`` steps (``step`` overrides fields of step 1)."""
    rows = [
        {
            "step": i,
            "loss": 0.5 / i,
            "reward": 0.2,
            "kl": 0.01 * i,
            "params": {"w": f"w{i}", "b": f"b{i}"},
        }
        for i in range(1, steps + 1)
    ]
    if step is not None:
        rows[0] = {**rows[0], **step}
    return {"steps": rows, "final": {"w": f"w{steps}", "b": f"b{steps}"}, "holds": []}


def test_identical_runs_have_no_difference() -> None:
    assert first_difference("j", _run(3), _run(3)) is None


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"loss": 0.50001}, "loss"),
        ({"reward": 0.4}, "reward"),
        ({"kl": 0.02}, "kl"),
        ({"params": {"w": "w1", "b": "other"}}, "b"),
    ],
)
def test_the_first_difference_names_step_and_what(change: dict[str, Any], what: str) -> None:
    found = first_difference("j", _run(3), _run(3, change))
    assert found is not None and (found.job, found.step, found.what) == ("j", 1, what)
    assert f"job j: step 1, {what} differs" in str(found)


def test_missing_steps_and_final_parameters_are_differences() -> None:
    short = _run(2)
    found = first_difference("j", _run(3), short)
    assert found is not None and found.what == "steps" and (found.alone, found.sliced) == (3, 2)
    final = _run(3)
    final["final"] = {"w": "w3", "b": "changed"}
    found = first_difference("j", _run(3), final)
    assert found is not None and found.step == 0 and found.what == "b"
    assert "the final parameters" in str(found)


def test_journal_moves_counts_copied_bytes(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    rows = [
        {"kind": "checkpoint", "status": "ok", "bytes_moved": 100, "bytes_skipped": 40},
        {"kind": "checkpoint", "status": "failed", "bytes_moved": 100},
        {"kind": "restore", "status": "ok", "bytes_moved": 100},
        {"kind": "restore", "status": "ok", "bytes_moved": 0},
    ]
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    moves = journal_moves(journal)
    assert (moves.checkpoints, moves.restores, moves.bytes_out, moves.bytes_in) == (1, 1, 60, 100)


def test_group_duty_is_the_held_fraction_of_the_window() -> None:
    holds = [
        {
            "holds": [
                {"granted_at": 0.0, "released_at": 1.0},
                {"granted_at": 3.0, "released_at": 4.0},
            ]
        },
        {"holds": [{"granted_at": 1.0, "released_at": 2.0}]},
    ]
    duty, window = group_duty(holds)
    assert (duty, window.duration) == (0.75, 4.0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_grpo_jobs_train_bit_identically_and_a_flipped_bit_is_named(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "timeslice_tools.dev.rl", "--steps", str(STEPS),
        "--corrupt", f"grpo-b:{CORRUPT_STEP}", "--work", str(tmp_path / "work"), "--budget", "360",
    ]  # fmt: skip
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=400, env=dict(os.environ)
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr[-3000:]
    lines = out.strip().splitlines()
    assert (
        f"grpo-a: {STEPS} steps, loss, reward, KL and 21 parameters after every step bit-identical"
        in out
    )
    assert f"MISMATCH job grpo-b: step {CORRUPT_STEP}, model.embed_tokens.weight differs" in out
    assert lines[-1].startswith(f"training identical: NO (job grpo-b: step {CORRUPT_STEP}")
    # It really time-sliced: both jobs held the group, the agent moved their state.
    assert "group grpo-pool: duty cycle" in out
    switches = next(line for line in lines if line.strip().startswith("switches:"))
    checkpoints = int(switches.split()[1])
    assert checkpoints >= 1, switches
    results = {
        job: json.loads((tmp_path / "work" / "sliced" / f"{job}.json").read_text())
        for job in ("grpo-a", "grpo-b")
    }
    for job, result in results.items():
        assert result["mode"] == "time-sliced" and len(result["steps"]) == STEPS, job
        # A generation and a training phase per step, plus the final read.
        assert len(result["holds"]) == 2 * STEPS + 1, job
        assert result["state_bytes"] > 0
