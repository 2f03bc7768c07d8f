"""``python -m timeslice_agent``: run the snapshot agent of this node.

Exit status: 0 after SIGTERM/SIGINT, 1 when a critical part failed, 2 on bad configuration or
when the agent cannot start: among others when its backend cannot act on this machine (no
driver, no right to signal the workers, no place for the worker socket: the backend's
``preflight``), in one line naming the backend, what is missing and how to fix it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from prometheus_client import disable_created_metrics

from timeslice.errors import TimeSliceError
from timeslice_agent.backends import Backend, BackendUnavailable, create_backend
from timeslice_agent.config import AgentConfig, BackendKind, parse_config
from timeslice_agent.service import Agent


def configure_logging(config: AgentConfig) -> None:
    """INFO logs to stderr; with the sim backend every line is tagged as an emulation."""
    tag = f"{config.node} {config.backend.value}"
    if config.backend is BackendKind.SIM:
        tag += " EMULATED"
    logging.basicConfig(
        level=config.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s timeslice-agent[{tag}] %(name)s: %(message)s",
    )
    # grpclib logs every reset stream of a departing worker at INFO; that is routine here.
    logging.getLogger("grpclib").setLevel(logging.WARNING)


async def serve(config: AgentConfig, backend: Backend | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        return await Agent(config, backend=backend).run(stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, configure logging, run the agent."""
    config = parse_config(argv)
    configure_logging(config)
    if config.tls is not None:
        try:
            config.tls.check()
        except TimeSliceError as exc:
            print(f"timeslice-agent: error: {exc.message}", file=sys.stderr)
            return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            backend = create_backend(config)
            # Before anything is written or bound: a node that could not move a job's state
            # must not register as able to, only to fail at its first switch.
            runner.run(backend.preflight())
        except BackendUnavailable as exc:
            # One line, no traceback: the operator must see at once what this node lacks.
            # There is no fallback to another backend, least of all to the sim emulation.
            print(
                f"timeslice-agent: cannot start the {config.backend.value} backend: {exc}",
                file=sys.stderr,
            )
            return 2
        # The *_created series only add noise to scrapes of a per-process registry.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        return runner.run(serve(config, backend))


if __name__ == "__main__":
    sys.exit(main())
