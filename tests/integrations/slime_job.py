"""One Slime-like RL job: replays Slime's phase sequence through the real SlimePhaseCallback.

Usage: ``python -m tests.integrations.slime_job MODE STEPS OUT`` with the callback's
environment variables set (the orchestrator's TLS ones too). MODE ``sync``: each step is
generate, offload, train, onload, weight_sync; ``async``: generate, train, weight_sync, with
an eval at the end. Writes one JSON line per lock held: group, epoch, ticket and the wall
times just after the phase began and just before it ended. The last phase (a train) is
never ended: the callback must give its lock back at exit.
"""

from __future__ import annotations

import atexit
import json
import random
import sys
import time

from timeslice import TimeSliceOrchestratorClient
from timeslice.integrations.slime import PHASE_LOCKS, SlimePhaseCallback

PHASES = {
    "sync": ["generate", "offload", "train", "onload", "weight_sync"],
    "async": ["generate", "train", "weight_sync"],
}


def main() -> None:
    mode, steps, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    callback = SlimePhaseCallback()
    assert callback.enabled, "the TIMESLICE_* variables are not all set"
    client = callback.client
    assert isinstance(client, TimeSliceOrchestratorClient)
    out = open(out_path, "w", buffering=1)  # open until the atexit record ran
    job = client.job_id

    def record(phase: str, began: float, ended: float) -> None:
        grants = client.grants()
        for group in callback.held:
            grant = grants[group]
            line = {"job": job, "phase": phase, "group": group, "epoch": grant.epoch}
            line |= {"ticket": grant.ticket, "granted_at": began, "released_at": ended}
            out.write(json.dumps(line) + "\n")

    def run(phase: str) -> None:
        callback.on_phase_begin(phase, "actor", {})
        began = time.time()
        time.sleep(random.uniform(0.005, 0.03))  # the phase's work
        if PHASE_LOCKS[phase]:
            record(phase, began, time.time())
        callback.on_phase_end(phase, "actor", {})

    run("init")
    for _ in range(steps):
        for phase in PHASES[mode]:
            run(phase)
    if mode == "async":
        run("eval")
    callback.on_phase_begin("train", "actor", {})
    last = time.time()
    # Registered after the callback's own handler, so it runs first (before the release).
    atexit.register(lambda: record("train", last, time.time()))
    out.write(json.dumps({"job": job, "exiting_at": time.time()}) + "\n")


if __name__ == "__main__":
    main()
