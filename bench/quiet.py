"""When a node is quiet enough to time a cold start on (``bench.coldstart``, ``bench.peers``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Device report counters of work that takes the cores a cold start's prefill needs: worker
# processes starting (imports) and standbys being prepared.
BUSY = ("starting_workers", "standby_preparing")
REPORT_AGE_S = 1.2  # device reports are re-published every second: wait this long, then check again


def quiet(devices: Iterable[Mapping[str, Any]], prewarm: int) -> bool:
    """Whether ``prewarm`` pre-warmed workers are ready on some device and no device starts a
    worker or prepares a standby (``devices``: the device reports of ``/v1/cluster``)."""
    reports = list(devices)
    warm = max((int(d.get("warm_workers", 0)) for d in reports), default=0)
    return warm >= prewarm and not any(int(d.get(k, 0)) for d in reports for k in BUSY)
