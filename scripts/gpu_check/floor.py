"""``python -m scripts.gpu_check.floor DEVICE BYTES``: this machine's copy floor, one JSON line.

A plain ``copy_`` of ``BYTES`` between a device tensor and a preallocated pinned host buffer,
each way, timed with the device synchronised: what a data plane cannot beat here. The ``app``
figures are reported as a ratio of it, and ``cuda``'s against it. On CPU (``--device cpu``)
both sides are host memory and the buffer is not pinned (no CUDA to pin with).

Run in its own process, so the check process never holds a CUDA context.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

GB = 1e9
ROUNDS = 3


def measure(device: str, nbytes: int) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    started = time.perf_counter()
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(0)  # touch every page before timing
    sync()
    setup = time.perf_counter() - started
    out: list[float] = []
    back: list[float] = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        host.copy_(src, non_blocking=True)
        sync()
        out.append(nbytes / (time.perf_counter() - t) / GB)
        t = time.perf_counter()
        src.copy_(host, non_blocking=True)
        sync()
        back.append(nbytes / (time.perf_counter() - t) / GB)
    return {
        "device": device,
        "bytes": nbytes,
        "pinned": cuda,
        "rounds": ROUNDS,
        "out_gbps": statistics.median(out),
        "in_gbps": statistics.median(back),
        "out_gbps_all": out,
        "in_gbps_all": back,
        "setup_seconds": setup,
    }


def main() -> int:
    device, nbytes = sys.argv[1], int(sys.argv[2])
    try:
        result = measure(device, nbytes)
    except Exception as exc:  # recorded as the floor's error; the check goes on
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
