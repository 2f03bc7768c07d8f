"""Summarise the recovery times the fault tests recorded (p50/p99 per scenario).

.venv/bin/pytest tests/faults -n auto && python scripts/faultreport.py
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else ".timeslice/fault-recovery.jsonl")
    runs: dict[str, list[float]] = defaultdict(list)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        runs[record["scenario"]].append(float(record["seconds"]))
    print(f"{'scenario':44} {'runs':>4} {'p50 s':>7} {'p99 s':>7} {'max s':>7}")
    for scenario, values in sorted(runs.items()):
        print(
            f"{scenario:44} {len(values):4d} {percentile(values, 0.5):7.2f} "
            f"{percentile(values, 0.99):7.2f} {max(values):7.2f}"
        )


if __name__ == "__main__":
    main()
