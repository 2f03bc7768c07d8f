"""``python -m timeslice.cli``: the operator commands (see :mod:`timeslice.cli`)."""

import sys

from timeslice.cli import main

sys.exit(main())
