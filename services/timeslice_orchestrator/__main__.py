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
    try:
        import uvloop

        runner: object = uvloop.run
    except ImportError:
        runner = asyncio.run
    sys.exit(runner(serve(config)))  # type: ignore[operator]


if __name__ == "__main__":
    main()
