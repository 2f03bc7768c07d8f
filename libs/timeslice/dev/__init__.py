"""Local development tooling: a throw-away etcd, a local cluster of real processes, the demo.

Nothing here is used by the services in production; it starts the same programs a deployment
runs (``python -m timeslice_orchestrator`` / ``python -m timeslice_agent``) on loopback.

- :class:`EtcdServer` / :func:`find_etcd_binary` (:mod:`timeslice.dev.etcd`)
- :class:`LocalCluster` (:mod:`timeslice.dev.cluster`)
- the pure record analysis used by the demo and benchmarks (:mod:`timeslice.dev.timeline`)
- the demo, ``python -m timeslice.dev.demo`` (:mod:`timeslice.dev.demo`)
"""

from timeslice.dev.cluster import ClusterError, LocalCluster
from timeslice.dev.etcd import EtcdError, EtcdServer, find_etcd_binary

__all__ = ["ClusterError", "EtcdError", "EtcdServer", "LocalCluster", "find_etcd_binary"]
