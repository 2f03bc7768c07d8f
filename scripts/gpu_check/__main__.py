"""``python -m scripts.gpu_check``: see :mod:`scripts.gpu_check.cli`."""

from scripts.gpu_check.cli import main

raise SystemExit(main())
