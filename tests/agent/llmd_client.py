"""A client of the llm-d snapshot agent API, as the reference's client talks to it.

Run as a subprocess by tests/agent/test_llmd_agent.py, with synchronous ``grpcio`` and code
that the test generated from protos/ with grpcio-tools (its directory is argv[1]). Modes:

- ``workload GEN TARGET JOB GROUP LOG [MODE [TAGS [DELAY_FIRST_SNAPSHOT]]]``: register over
  WorkloadChannel (the reference's ``register_workload``) and answer every command ok,
  appending one JSON line per command to LOG before answering; runs until killed.
- ``calls GEN TARGET JSON``: run a list of calls, print one JSON list of results.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import sys
import time
from pathlib import Path
from typing import Any


def _load(gen: Path) -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(gen))
    from snapshot_agent.v1alpha1 import agent_pb2, agent_pb2_grpc

    # grpc/health/v1 would shadow grpcio's own `grpc` package: load it by path.
    spec = importlib.util.spec_from_file_location(
        "health_pb2", gen / "grpc" / "health" / "v1" / "health_pb2.py"
    )
    assert spec is not None and spec.loader is not None
    health = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(health)
    return agent_pb2, agent_pb2_grpc, health


def workload(gen: Path, target: str, job: str, group: str, log: str, *rest: str) -> None:
    import grpc

    pb, pb_grpc, _ = _load(gen)
    mode = rest[0] if rest else ""
    tags = [t for t in rest[1].split(",") if t] if len(rest) > 1 else []
    delay_first = float(rest[2]) if len(rest) > 2 else 0.0
    caps = pb.WorkloadCapabilities(tags=tags)
    if mode:
        caps.default_mode = pb.SuspendMode.Value(mode)
        caps.supported_modes.append(pb.SuspendMode.Value(mode))
    outbox: queue.Queue[Any] = queue.Queue()
    outbox.put(
        pb.WorkloadMessage(register=pb.RegisterWorkload(job_id=job, group=group, capabilities=caps))
    )

    def requests() -> Any:
        while True:
            item = outbox.get()
            if item is None:
                return
            yield item

    snapshots = 0
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SnapshotAgentServiceStub(channel)
        print("registered", flush=True)
        for command in stub.WorkloadChannel(requests()):
            kind = command.WhichOneof("command")
            entry: dict[str, Any] = {"id": command.command_id, "kind": kind, "t": time.time()}
            if kind == "snapshot":
                entry["mode"] = pb.SuspendMode.Name(command.snapshot.mode)
                entry["tags"] = list(command.snapshot.tags)
                snapshots += 1
                if snapshots == 1 and delay_first:
                    time.sleep(delay_first)
            elif kind == "restore":
                entry["tags"] = list(command.restore.tags)
            with open(log, "a") as f:
                f.write(json.dumps(entry) + "\n")
            outbox.put(
                pb.WorkloadMessage(result=pb.CommandResult(command_id=command.command_id, ok=True))
            )


def _channel_case(pb: Any, stub: Any, messages: list[Any]) -> str:
    """Send ``messages`` on a WorkloadChannel and return the status it ends with."""
    import grpc

    def requests() -> Any:
        yield from messages
        time.sleep(10)  # keep our side open: the agent must end the stream itself

    try:
        for _ in stub.WorkloadChannel(requests(), timeout=8):
            pass
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "OK"


def calls(gen: Path, target: str, spec: str) -> None:
    import grpc

    pb, pb_grpc, health = _load(gen)
    out: list[Any] = []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SnapshotAgentServiceStub(channel)
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health.HealthCheckRequest.SerializeToString,
            response_deserializer=health.HealthCheckResponse.FromString,
        )
        for call in json.loads(spec):
            name, args = call[0], call[1] if len(call) > 1 else {}
            try:
                if name == "wait_state":  # poll Status until a job is in a state
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        states = {
                            s.job_id: pb.JobState.Name(s.state)
                            for s in stub.Status(pb.StatusRequest(), timeout=5).job_statuses
                        }
                        if states.get(args["job"]) == args["state"]:
                            break
                        time.sleep(0.01)
                    out.append(["OK", states])
                elif name == "Status":
                    reply = stub.Status(pb.StatusRequest(), timeout=5)
                    jobs = {s.job_id: pb.JobState.Name(s.state) for s in reply.job_statuses}
                    accs = [
                        [a.id, a.memory_used_bytes, a.memory_total_bytes]
                        for a in reply.accelerator_statuses
                    ]
                    out.append(["OK", {"jobs": jobs, "accelerators": accs}])
                elif name == "Health":
                    reply = check(health.HealthCheckRequest(service=args["service"]), timeout=5)
                    out.append(["OK", health.HealthCheckResponse.ServingStatus.Name(reply.status)])
                elif name in ("Snapshot", "Restore"):
                    cls = pb.SnapshotRequest if name == "Snapshot" else pb.RestoreRequest
                    request = cls(job_id=args.get("job_id", ""), group=args.get("group", ""))
                    if "backend" in args:
                        request.backend = args["backend"]  # may be a value the enum lacks
                    if "pids" in args:
                        request.backend_config.cuda.explicit_target.pids.extend(args["pids"])
                    reply = getattr(stub, name)(request, timeout=5)
                    out.append(["OK", reply.operation_id])
                elif name == "GetOperation":
                    reply = stub.GetOperation(
                        pb.GetOperationRequest(operation_id=args["id"]), timeout=5
                    )
                    out.append(["OK", pb.OperationStatus.Name(reply.status)])
                elif name == "Channel":
                    messages = []
                    for m in args["messages"]:
                        if "register" in m:
                            r = m["register"]
                            caps = pb.WorkloadCapabilities(
                                supported_modes=[pb.SuspendMode.Value(x) for x in r.get("modes", [])],
                                default_mode=pb.SuspendMode.Value(
                                    r.get("default", "SUSPEND_MODE_UNSPECIFIED")
                                ),
                            )
                            messages.append(
                                pb.WorkloadMessage(
                                    register=pb.RegisterWorkload(
                                        job_id=r["job_id"], group=r["group"], capabilities=caps
                                    )
                                )
                            )
                        elif "result" in m:
                            messages.append(
                                pb.WorkloadMessage(result=pb.CommandResult(command_id=m["result"]))
                            )
                        else:
                            messages.append(pb.WorkloadMessage())
                    out.append([_channel_case(pb, stub, messages), None])
                else:
                    raise ValueError(name)
            except grpc.RpcError as exc:
                out.append([exc.code().name, exc.details()])
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    mode, gen, *argv = sys.argv[1:]
    if mode == "workload":
        workload(Path(gen), *argv)
    else:
        calls(Path(gen), *argv)
