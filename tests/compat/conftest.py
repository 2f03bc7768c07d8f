"""v1alpha1 clients for the compat tests: grpcio code generated at test time from the tests'
own copy of the proto, run synchronously in subprocesses (see v1alpha1_client.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
CLIENT = HERE / "v1alpha1_client.py"


@pytest.fixture(scope="session")
def v1alpha1_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The grpcio code of the tests' copy of the v1alpha1 proto (``protoc`` at test time)."""
    out = tmp_path_factory.mktemp("v1alpha1")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "timeslice_orchestrator/v1alpha1/orchestrator.proto",
        ],
        check=True,
        cwd=PROTO_ROOT,
    )
    # Regular packages: found before any ``timeslice_orchestrator`` the interpreter's
    # site-packages might also know.
    for package in ("timeslice_orchestrator", "timeslice_orchestrator/v1alpha1"):
        (out / package / "__init__.py").touch()
    return out


class V1Client:
    """One v1alpha1 client process (one connection); calls block that process, not the test."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._lock = asyncio.Lock()

    async def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if not line:
            raise EOFError(f"the v1alpha1 client exited ({self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        return result

    async def send(self, command: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            return await self._line()

    async def call(self, op: str, timeout: float = 30, **args: Any) -> dict[str, Any]:
        """``{"ok": True, "resp": {...}}`` or ``{"ok": False, "code": ..., "details": ...}``."""
        return await self.send({"op": op, "args": args, "timeout": timeout})

    async def ok(self, op: str, timeout: float = 30, **args: Any) -> dict[str, Any]:
        reply = await self.call(op, timeout, **args)
        assert reply["ok"], reply
        resp: dict[str, Any] = reply["resp"]
        return resp

    async def code(self, op: str, timeout: float = 30, **args: Any) -> str:
        reply = await self.call(op, timeout, **args)
        assert not reply["ok"], reply
        code: str = reply["code"]
        return code

    async def raw(self, method: str, data: bytes) -> dict[str, Any]:
        return await self.send({"op": "raw", "method": method, "hex": data.hex()})

    async def connect(self, target: str) -> None:
        assert (await self.send({"op": "connect", "target": target}))["ok"]


V1Factory = Callable[..., AbstractAsyncContextManager[V1Client]]


@pytest.fixture
def v1alpha1(v1alpha1_code: Path) -> V1Factory:
    """``async with v1alpha1(target) as client``: a client process on ``target``."""

    @asynccontextmanager
    async def make(target: str, tls: dict[str, str] | None = None) -> AsyncIterator[V1Client]:
        """``tls``: V1_TLS_CA, V1_TLS_CERT, V1_TLS_KEY (files) for a TLS client."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env["PYTHONPATH"] = str(v1alpha1_code)
        env.update(tls or {})
        proc = subprocess.Popen(
            [sys.executable, str(CLIENT), target.split(",")[0]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        client = V1Client(proc)
        try:
            assert (await client._line())["ready"]
            yield client
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    return make
