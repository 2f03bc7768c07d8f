"""The timeslice snapshot agent: one per node.

It dials an orchestrator replica over gRPC (``AgentHub.Connect``), executes checkpoint/restore
directives through a pluggable backend and acks them, and serves the local ``WorkerLink`` API on
a unix socket so GPU worker processes of its node can register. Run it with
``python -m timeslice_agent``; see :mod:`timeslice_agent.config` for the options.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
