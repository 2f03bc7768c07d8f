"""The GPU check: real etcd, orchestrator and agent, two PyTorch jobs switching on one GPU.

``scripts/gpu-check`` sets up a machine without network (wheels from ``.whl/``) and runs
``python -m scripts.gpu_check``; see :mod:`scripts.gpu_check.cli` for the options and
``result.json`` / ``result.md`` under ``$OUT`` for what it reports.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
