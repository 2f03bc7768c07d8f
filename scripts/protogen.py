"""Regenerate the betterproto2 code for protos/ into a target folder.

Used by `make protos` (target: libs/timeslice_proto) and by the test that fails when the
committed generated code is stale (target: a temporary folder, then compared file by file).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PLUGIN_OPTIONS = "client_generation=async,server_generation=async"


def proto_files() -> list[Path]:
    """Every proto under protos/: ours (timeslice.v1) and the llm-d reference's v1alpha1
    services we also serve for its users (orchestrator and snapshot agent), plus gRPC health."""
    return sorted(PROTO_ROOT.glob("**/*.proto"))


def generate(target: Path) -> None:
    """Write the generated package into ``target``, replacing what was there."""
    bin_dir = Path(sys.executable).parent
    plugin = bin_dir / "protoc-gen-python_betterproto2"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--plugin=protoc-gen-python_betterproto2={plugin}",
            f"--python_betterproto2_out={out}",
            f"--python_betterproto2_opt={PLUGIN_OPTIONS}",
            *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
        ]
        # The compiler formats its output with ruff, which it finds on PATH.
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
        subprocess.run(cmd, check=True, cwd=PROTO_ROOT, env=env, capture_output=True)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(out, target)


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "libs" / "timeslice_proto"
    generate(target)
    print(f"generated {target}")


if __name__ == "__main__":
    main()
