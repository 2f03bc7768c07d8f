"""``python -m timeslice_tools.dev.rl``: the demo behind ``make demo-rl``."""

from timeslice_tools.dev.rl.demo import main

raise SystemExit(main())
