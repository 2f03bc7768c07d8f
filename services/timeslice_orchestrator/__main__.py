"""`python -m timeslice_orchestrator`: run one orchestrator replica.

``python -m timeslice_orchestrator features ...`` shows or sets the deployment's features
(:mod:`timeslice_orchestrator.features`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

from timeslice.errors import TimeSliceError
from timeslice_orchestrator import features
from timeslice_orchestrator.app import serve
from timeslice_orchestrator.config import parse_args
from timeslice_orchestrator.store.etcd import StoreError

# Objects allocated before a young-generation collection. A replica allocates a few hundred
# short-lived objects per call, almost none of them in reference cycles; at Python's default
# (700) it ran a collection every few calls, about 8% of its CPU per acquire/yield cycle
# (bench.floor, side by side). Older generations keep their defaults' ratios.
GC_YOUNG_THRESHOLD = 20_000


def main() -> None:
    if sys.argv[1:2] == ["features"]:
        sys.exit(features.main(sys.argv[2:]))
    config = parse_args()
    for files in (config.tls, config.etcd_tls):
        if files is not None:
            try:
                files.check()
            except TimeSliceError as exc:
                sys.exit(f"timeslice orchestrator: error: {exc.message}")
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    logging.basicConfig(
        level=config.log_level,
        format=f"%(asctime)s %(levelname)s [{config.replica_id}] %(name)s: %(message)s",
    )
    runner: object = asyncio.run
    if config.tls is None:
        # Not with TLS: uvloop's start_tls neither returns nor raises for some refused
        # handshakes (the client then waits out its deadline with no reason given), while
        # asyncio's reports every refusal (timeslice_orchestrator.tls).
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            pass
    try:
        code = runner(serve(config))  # type: ignore[operator]
    except (StoreError, TimeoutError, OSError) as exc:
        # Start-up gave up (etcd unreachable for --start-timeout, an address in use): one line.
        sys.exit(f"timeslice orchestrator: error: cannot start: {exc or type(exc).__name__}")
    sys.exit(code)


if __name__ == "__main__":
    main()
