"""A v1alpha1 client as the reference's Python client is: grpcio, synchronous, plaintext.

Run as a subprocess (``python v1alpha1_client.py TARGET``) whose PYTHONPATH is only the code
grpcio-tools generated from tests/compat/proto: its package ``timeslice_orchestrator`` would
clash with our service package in the test's own process. One process is one client, so one
HTTP/2 connection. It reads one JSON command per line on stdin and answers one JSON line:

- ``{"op": "Acquire", "args": {...}, "timeout": 30}``: a call; the answer is
  ``{"ok": true, "resp": {...}}`` or ``{"ok": false, "code": "NOT_FOUND", "details": "..."}``;
- ``{"op": "raw", "method": "Acquire", "hex": "0805"}``: the same with the request's bytes;
- ``{"op": "cancel", "args": {...}, "after": 0.5}``: an Acquire the client cancels;
- ``{"op": "connect", "target": "HOST:PORT"}``: a new channel (what a client that fails over
  does).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

import grpc

pb: Any = importlib.import_module("timeslice_orchestrator.v1alpha1.orchestrator_pb2")
rpc: Any = importlib.import_module("timeslice_orchestrator.v1alpha1.orchestrator_pb2_grpc")
json_format: Any = importlib.import_module("google.protobuf.json_format")
SERVICE = "/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService/"


def _dict(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return result


def _channel(target: str) -> Any:
    """Plaintext, as the reference's client; TLS with the files of $V1_TLS_CA/CERT/KEY."""
    ca = os.environ.get("V1_TLS_CA")
    if not ca:
        return grpc.insecure_channel(target)
    with open(ca, "rb") as a, open(os.environ["V1_TLS_CERT"], "rb") as c:
        with open(os.environ["V1_TLS_KEY"], "rb") as k:
            creds = grpc.ssl_channel_credentials(a.read(), k.read(), c.read())
    return grpc.secure_channel(target, creds)


def main() -> None:
    channel = _channel(sys.argv[1])
    stub = rpc.TimeSliceOrchestratorServiceStub(channel)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any]
        try:
            if op == "connect":
                channel.close()
                channel = _channel(cmd["target"])
                stub = rpc.TimeSliceOrchestratorServiceStub(channel)
                reply = {"ok": True}
            elif op == "cancel":
                # Start an Acquire, then cancel it (the client gives up, as with Ctrl-C).
                future = stub.Acquire.future(pb.AcquireRequest(**cmd["args"]), timeout=60)
                time.sleep(cmd["after"])
                future.cancel()
                reply = {"ok": False, "code": "CANCELLED", "details": "cancelled by the client"}
            elif op == "raw":
                call = channel.unary_unary(SERVICE + cmd["method"])
                data = call(bytes.fromhex(cmd["hex"]), timeout=cmd.get("timeout", 30))
                reply = {"ok": True, "raw": data.hex()}
            else:
                request = getattr(pb, f"{op}Request")(**cmd.get("args", {}))
                method = getattr(stub, op)
                reply = {"ok": True, "resp": _dict(method(request, timeout=cmd.get("timeout", 30)))}
        except grpc.RpcError as exc:
            reply = {"ok": False, "code": exc.code().name, "details": exc.details()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
