"""Everything the orchestrator keeps lives in etcd; this package is the only code that talks to it.

It knows nothing of gRPC: callers get typed records and typed errors.
"""
