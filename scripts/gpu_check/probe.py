"""``python -m scripts.gpu_check.probe DEVICE``: what torch sees, as one JSON line on stdout.

Run in its own process so the check process itself never creates a CUDA context (it would
hold device memory and show up in NVML next to the jobs).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def probe(device: str) -> dict[str, Any]:
    """torch's versions and devices; for ``cuda``, whether a first allocation works."""
    import torch

    info: dict[str, Any] = {
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if device != "cuda":
        return info
    if not info["cuda_available"]:
        info["cuda_error"] = "torch.cuda.is_available() is False"
        return info
    info["devices"] = [
        {
            "name": torch.cuda.get_device_name(i),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
        }
        for i in range(torch.cuda.device_count())
    ]
    started = time.perf_counter()
    try:
        torch.ones(1, device="cuda").sum().item()
    except Exception as exc:
        info["cuda_error"] = f"{type(exc).__name__}: {exc}"
    info["cuda_init_seconds"] = time.perf_counter() - started
    return info


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print(json.dumps(probe(device)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
