"""Local development tooling: a throw-away etcd, a local cluster of real processes, the demo.

Nothing here is used by the services in production; it starts the same programs a deployment
runs (``python -m timeslice_orchestrator`` / ``python -m timeslice_agent``) on loopback.

- :class:`EtcdServer` / :func:`find_etcd_binary` (:mod:`timeslice_tools.dev.etcd`)
- :class:`LocalCluster` (:mod:`timeslice_tools.dev.cluster`)
- the pure record analysis used by the demo and benchmarks (:mod:`timeslice_tools.dev.timeline`)
- the demo, ``python -m timeslice_tools.dev.demo`` (:mod:`timeslice_tools.dev.demo`)
"""

from timeslice_tools.dev.cluster import ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdCluster, EtcdError, EtcdServer, find_etcd_binary

__all__ = [
    "ClusterError",
    "EtcdCluster",
    "EtcdError",
    "EtcdServer",
    "LocalCluster",
    "find_etcd_binary",
]
