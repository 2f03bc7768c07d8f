"""Balanced profile, 2 jobs, default sim costs: scheduling options off vs on, one invocation.

PYTHONPATH=. python bench/scheduling_on_off.py   (writes bench/results/scheduling-on-off.json)
"""

import json

from bench.profiles import PROFILES
from bench.workload import run_profile

rows = []
baseline = None
for label, args in (
    ("default", []),
    ("co-residency", ["--co-residency"]),
    ("co-residency+prefetch", ["--co-residency", "--prefetch"]),
):
    r = run_profile(
        PROFILES["balanced"],
        2,
        time_scale=0.03,
        steps=12,
        cluster_kwargs={"orchestrator_args": args},
        baseline=baseline,
        label=label,
    )
    baseline = baseline or getattr(r, "baseline", None)
    duty = next(iter(r.duty.values()))
    rows.append(
        {
            "option": label,
            "duty": duty,
            "bound": r.analytic_bound,
            "slowdown": r.slowdown,
            "switches": getattr(r, "switches", None),
        }
    )
    print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open("bench/results/scheduling-on-off.json", "w"), indent=2)
