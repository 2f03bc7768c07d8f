"""timeslice tools: what developers and operators run, kept out of the job-facing SDK.

- :mod:`timeslice_tools.cli`: the ``timeslice`` command (the SDK's operator commands plus
  ``dev cluster`` and the ``orchestrator`` / ``agent`` service launchers);
- :mod:`timeslice_tools.dev`: a throw-away etcd, a local cluster of real processes, the demo
  and the timeline analysis the demo and the benchmarks share.

A job needs only :mod:`timeslice`; nothing in the SDK imports this package.
"""
