"""The timeslice orchestrator: a stateless replica serving the client and agent APIs over etcd."""
