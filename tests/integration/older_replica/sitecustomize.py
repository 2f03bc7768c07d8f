"""Makes an orchestrator process an older replica, one without YieldStream (tests only).

tests/integration/test_yield_stream.py puts this directory first on the ``PYTHONPATH`` of a
cluster's services with ``TIMESLICE_TEST_OLDER_REPLICA=1``; Python imports this module at
start-up, and the replica then serves every method but YieldStream, which grpclib answers as
a method it does not have, exactly as a replica of a version before it. Without the variable
it does nothing.
"""

from __future__ import annotations

import os
from typing import Any


def _without_yield_stream() -> None:
    from timeslice_orchestrator.api import TimeSliceService

    full = TimeSliceService.__mapping__

    def older(self: TimeSliceService) -> dict[str, Any]:
        mapping = full(self)
        del mapping["/timeslice.v1.TimeSlice/YieldStream"]
        return mapping

    TimeSliceService.__mapping__ = older  # type: ignore[method-assign]


if os.environ.get("TIMESLICE_TEST_OLDER_REPLICA"):
    _without_yield_stream()
