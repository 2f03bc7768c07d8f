"""bench.offload on a small state: every mode measured, the skip and bit-exactness targets
judged from what really happened (timing targets are the benchmark's, not the test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import offload

REPO = Path(__file__).resolve().parents[2]


def test_every_mode_is_measured_against_the_floor() -> None:
    report = offload.run(gib=1 / 64, params=3, rounds=2, device_name="cpu")
    figures = report["figures"]
    assert list(figures) == list(offload.MODES)
    state = report["state_bytes"]
    assert state == (1 << 24) // 3 // 4 * 4 * 3
    for mode in ("floor", "keep_pinned", "default"):
        assert figures[mode]["copied_bytes"] == state and figures[mode]["skipped_bytes"] == 0
        assert figures[mode]["out_gbps"] > 0 and figures[mode]["in_gbps"] > 0
    assert figures["floor"]["out_ratio"] == figures["floor"]["in_ratio"] == 1.0
    assert figures["unchanged"]["copied_bytes"] == 0
    assert figures["unchanged"]["skipped_bytes"] == state
    targets = report["targets"]
    assert targets["unchanged module: every byte skipped"]
    assert targets["bit-exact after every cycle"]
    text = offload.render(report)
    assert text.splitlines()[-1].endswith("bit-exact after every cycle")


def test_command_line_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    argv = [sys.executable, "-m", "bench.offload", "--gib", "0.01", "--rounds", "1"]
    done = subprocess.run(
        [*argv, "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["thp_mem_alloc"] == "1" and report["machine"]["cpus"]
    assert "| keep_pinned |" in done.stdout
