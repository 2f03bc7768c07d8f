"""Profile a benchmark's service process with cProfile (bench.controlplane.profile_orchestrator).

This directory is put first on ``PYTHONPATH`` of the processes a profiling run starts, with
``TIMESLICE_BENCH_PROFILE=<path prefix>``; Python imports this module at start-up, which
profiles the main thread (where the asyncio loop runs) and writes ``<prefix>.<pid>`` when
the process exits normally (SIGTERM stops the services cleanly). Without the variable it
does nothing.
"""

from __future__ import annotations

import atexit
import cProfile
import os


def _start(prefix: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()

    def dump() -> None:
        profiler.disable()
        profiler.dump_stats(f"{prefix}.{os.getpid()}")

    atexit.register(dump)


_PREFIX = os.environ.get("TIMESLICE_BENCH_PROFILE")
if _PREFIX:
    _start(_PREFIX)
