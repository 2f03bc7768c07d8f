"""``python -m timeslice_tools.cli``: the ``timeslice`` command (see :mod:`timeslice_tools.cli`)."""

import sys

from timeslice_tools.cli import main

sys.exit(main())
