"""A real worker process for the agent tests: registers over the unix socket and answers hooks.

Run as ``python agent_worker.py --socket PATH --job J --group G [...]``. Every WorkerCommand it
receives is printed to stdout as one JSON line, flushed, so the test can follow along. With
``--hook-mode ok`` hooks are answered ok with ``--hook-bytes``; ``fail`` answers not-ok with a
reason; ``silent`` never answers (to exercise the hook timeout). With ``--child`` it starts a child
``sleep`` and registers that descendant's pid instead of its own (printed first as ``CHILD``).
It prints ``{"kind": "PID", "pid": ..., "ns_pid": ...}`` first: its pid as it sees it, which in
a pid namespace of its own (``unshare --pid``) differs from the node's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from timeslice_proto.timeslice.v1 import (
    CommandResult,
    HookKind,
    WorkerInfo,
    WorkerLinkStub,
)


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> int:
    pid = args.pid or os.getpid()
    child = None
    if args.child:
        # Reap the child at once when it dies, so a test can see its pid reused.
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "60"])
        pid = child.pid
        _emit({"kind": "CHILD", "pid": pid})
    channel = Channel(path=args.socket)
    stub = WorkerLinkStub(channel)
    info = WorkerInfo(
        job_id=args.job,
        group_id=args.group,
        pid=pid,
        state_bytes=args.state_bytes,
        app_callbacks=args.app_callbacks,
        acquirer=args.acquirer,
        registrant_pid=os.getpid() if args.registrant_pid < 0 else args.registrant_pid,
    )
    try:
        async for command in stub.register(info):
            _emit(
                {
                    "kind": command.kind.name,
                    "command_id": command.command_id,
                    "job_id": command.job_id,
                    "group_id": command.group_id,
                }
            )
            if command.kind in (HookKind.BEFORE_CHECKPOINT, HookKind.AFTER_RESTORE):
                if args.hook_mode == "silent":
                    continue
                ok = args.hook_mode == "ok"
                await stub.complete_command(
                    CommandResult(
                        command_id=command.command_id,
                        ok=ok,
                        error="" if ok else f"{command.kind.name.lower()} hook exploded",
                        bytes_moved=args.hook_bytes if ok else 0,
                    ),
                    timeout=5.0,
                )
    except GRPCError as exc:
        _emit({"kind": "ERROR", "status": exc.status.name, "message": exc.message or ""})
        return 3
    finally:
        channel.close()
        if child is not None:
            child.kill()
            with contextlib.suppress(ChildProcessError):
                child.wait()
    _emit({"kind": "END"})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--pid", type=int, default=0)
    parser.add_argument("--child", action="store_true")
    # The pid the worker says it has (-1: its own, as the SDK sends; 0: unsaid, an older SDK).
    parser.add_argument("--registrant-pid", type=int, default=-1)
    parser.add_argument("--state-bytes", type=int, default=0)
    parser.add_argument("--app-callbacks", action="store_true")
    parser.add_argument("--acquirer", action="store_true")
    parser.add_argument("--hook-mode", choices=["ok", "fail", "silent"], default="ok")
    parser.add_argument("--hook-bytes", type=int, default=0)
    sys.exit(asyncio.run(main(parser.parse_args())))
