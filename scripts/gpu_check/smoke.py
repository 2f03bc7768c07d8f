"""The driver's checkpoint API on one small process, and parking processes before a kill.

``python -m scripts.gpu_check.smoke`` (the smoke step, about ten seconds): start a child that
puts 64 MiB on the GPU, then through the agent's own :class:`DriverApi` lock, checkpoint,
restore and unlock it, printing the process state after each step and the cuda-bindings
version; the child then checks its tensor. A refused API is one line here, before the long run.
It ends by parking the child (below) and killing it.

``python -m scripts.gpu_check.smoke --park PID...``: lock and checkpoint every pid that is
running CUDA, then SIGKILL it. Killing a live *restored* process has hung whole hosts
(NVIDIA/cuda-checkpoint#53); a checkpointed one dies safely. A pid that cannot be parked is
left alive and reported: a process left behind beats a hung machine.

Both print one JSON line last (the result); the check runs them as child processes with a
deadline, so a driver call that never returns cannot hang the check.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from timeslice_agent.backends.cuda import CudaCallError, DriverApi, NoCudaState, ProcessState

LOCK_TIMEOUT_MS = 30_000
CHILD_READY_SECONDS = 60.0
CHILD_CODE = """
import sys, torch
x = torch.full((1 << 24,), 7, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    ok = bool((x == 7).all().item())
    print("ok" if ok else "MISMATCH", flush=True)
"""


def _say(text: str) -> None:
    print(f"[gpu-check smoke] {text}", flush=True)


async def _state(api: DriverApi, pid: int) -> str:
    try:
        return (await api.state(pid)).value
    except NoCudaState:
        return "no-cuda"


async def park(api: DriverApi, pid: int) -> str:
    """Lock and checkpoint ``pid`` unless it holds no live CUDA state; its state after."""
    state = await _state(api, pid)
    if state == ProcessState.RUNNING.value:
        await api.lock(pid, LOCK_TIMEOUT_MS)
        state = ProcessState.LOCKED.value
    if state == ProcessState.LOCKED.value:
        await api.checkpoint(pid)
        state = await _state(api, pid)
    return state


async def park_and_kill(pids: list[int]) -> dict[str, Any]:
    """Park every pid, then kill the parked ones; what happened to each."""
    api = DriverApi()
    done: dict[str, Any] = {}
    for pid in pids:
        try:
            state = await park(api, pid)
        except CudaCallError as exc:
            done[str(pid)] = {"killed": False, "error": str(exc)}
            _say(f"pid {pid}: NOT killed, it could not be parked: {exc}")
            continue
        except ProcessLookupError:
            done[str(pid)] = {"killed": False, "error": "gone"}
            continue
        if state not in (ProcessState.CHECKPOINTED.value, "no-cuda"):
            done[str(pid)] = {"killed": False, "error": f"state {state} after parking"}
            _say(f"pid {pid}: NOT killed, state {state} after parking")
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        done[str(pid)] = {"killed": True, "state": state}
        _say(f"pid {pid}: {state}, killed")
    return done


async def _no_cuda_answer(api: DriverApi) -> str:
    """What the driver answers GetState for a process that never used CUDA: the cuda backend
    skips such a pid only on CUDA_ERROR_NOT_INITIALIZED (documented, not yet seen on a GPU),
    so the first run records the real answer. Never fails the smoke step."""
    plain = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        return f"state {(await api.state(plain.pid)).value}"
    except NoCudaState as exc:
        return f"no CUDA (skipped): {exc}"
    except CudaCallError as exc:
        return f"UNEXPECTED, would fail a directive: {exc}"
    finally:
        plain.kill()
        await asyncio.wait_for(plain.wait(), 10)


def _child() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_CODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def smoke() -> dict[str, Any]:
    """Lock, checkpoint, restore and unlock one small CUDA child (module docstring)."""
    result: dict[str, Any] = {"ok": False, "states": []}
    api = DriverApi()
    result["cuda_bindings"] = getattr(api, "bindings_version", "unknown")
    result["driver_cuda_version"] = api.driver_version
    _say(f"cuda-bindings {result['cuda_bindings']}, driver CUDA {api.driver_version}")
    child = _child()
    assert child.stdin is not None and child.stdout is not None
    started = time.monotonic()
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline),
                                      CHILD_READY_SECONDS)  # fmt: skip
        if line.strip() != "ready":
            raise RuntimeError(f"the child did not start: {line!r}")
        pid = child.pid
        result["states"].append(("start", await _state(api, pid)))

        async def lock(pid: int) -> None:
            await api.lock(pid, LOCK_TIMEOUT_MS)

        steps: tuple[tuple[str, Callable[[int], Awaitable[None]]], ...] = (
            ("lock", lock),
            ("checkpoint", api.checkpoint),
            ("restore", api.restore),
            ("unlock", api.unlock),
        )
        for name, call in steps:
            t = time.monotonic()
            try:
                await call(pid)
            except CudaCallError as exc:
                result["error"] = f"{name} refused: {exc}"
                _say(f"{name}: REFUSED: {exc}")
                return result
            state = await _state(api, pid)
            result["states"].append((name, state))
            _say(f"{name}: ok in {time.monotonic() - t:.2f} s, state {state}")
        child.stdin.write("check\n")
        child.stdin.flush()
        answer = (await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)).strip()
        result["child_check"] = answer
        result["ok"] = answer == "ok" and result["states"][-1][1] == "running"
        _say(f"child's tensor after restore: {answer}")
        result["no_cuda_answer"] = await _no_cuda_answer(api)
        _say(f"GetState of a process without CUDA: {result['no_cuda_answer']}")
    finally:
        if child.poll() is None:
            result["end"] = await park_and_kill([child.pid])
        child.wait(timeout=30)
        result["seconds"] = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args and args[0] == "--park":
            pids = [int(a) for a in args[1:]]
            result: dict[str, Any] = {"parked": asyncio.run(park_and_kill(pids))}
        else:
            result = asyncio.run(smoke())
    except Exception as exc:  # an unusable API is the finding; the line says which
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _say(f"FAILED: {result['error']}")
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
