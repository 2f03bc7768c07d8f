"""`python -m timeslice_orchestrator`: run one orchestrator replica."""

from __future__ import annotations

import asyncio
import logging
import sys

from timeslice_orchestrator.app import serve
from timeslice_orchestrator.config import parse_args


def main() -> None:
    config = parse_args()
    logging.basicConfig(
        level=logging.INFO,
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
    sys.exit(runner(serve(config)))  # type: ignore[operator]


if __name__ == "__main__":
    main()
