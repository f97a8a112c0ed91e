"""What one ``acquire`` cost: the report the Reuse Store measures and the node agent reads.

One type all the way (issue 10): :class:`gpu_pool.server.reuse_store.AcquireResult` is this
report plus the tensors' placements; the daemon sends the report in its ``acquire`` reply,
:class:`gpu_pool.client.PoolClient` keeps it as ``last_acquire``, the runtime's model binding
holds it, the worker returns it from ``/_ember/assign`` and the agent reads its bytes from it.

Wire encoding, version :data:`REPORT_VERSION`: a map with exactly the keys ``v`` and the
report's fields (``{"v": 2, "bytes_loaded": ..., "move_seconds": ...}``), carried as msgpack
by the pool protocol (the ``acquire`` reply's ``report``) and as JSON by the worker's assign
reply (its ``acquire``). :meth:`AcquireReport.from_wire` refuses anything else with a typed
error: a map of another shape or version, a field of the wrong type (booleans are not
numbers), a byte count outside ``0..2**63-1``, a duration that is negative or not finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpu_pool.errors import InvalidArgument, ProtocolError, UnsupportedVersion
from gpu_pool.wire.messages import MAX_COUNT

# 2: ``move_seconds`` (Tangram's Merge time, Fig. 10) joined the report.
REPORT_VERSION = 2
COUNT_FIELDS = ("bytes_loaded", "bytes_reused", "bytes_moved", "bytes_evicted")
SECONDS_FIELDS = ("load_seconds", "plan_seconds", "move_seconds")
REPORT_FIELDS = (*COUNT_FIELDS, *SECONDS_FIELDS)  # the dataclass's fields, in order


@dataclass(frozen=True, slots=True)
class AcquireReport:
    """What an ``acquire`` cost, as the pool daemon measured it.

    Bytes are the manifest's tensor bytes (unaligned) loaded from the model store, served
    from resident tensors, moved to make room and evicted; seconds are the wall time of the
    byte copies from the store (Tangram's Load), of the planner (Compute) and of moving
    resident tensors to make room (Merge). Validated on construction; seconds are stored as
    floats.
    """

    bytes_loaded: int
    bytes_reused: int
    bytes_moved: int
    bytes_evicted: int
    load_seconds: float
    plan_seconds: float
    move_seconds: float

    def __post_init__(self) -> None:
        for name in COUNT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ProtocolError(f"acquire report: '{name}' must be an integer")
            if not 0 <= value <= MAX_COUNT:
                raise InvalidArgument(f"acquire report: '{name}' must be between 0 and {MAX_COUNT}", name)
        for name in SECONDS_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ProtocolError(f"acquire report: '{name}' must be a number of seconds")
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"acquire report: '{name}' must be finite and >= 0", name)
            # JSON and msgpack may carry a whole number of seconds as an integer.
            object.__setattr__(self, name, float(value))

    @property
    def load_bandwidth(self) -> float:
        """Bytes per second of the copies (0 when nothing was loaded)."""
        return self.bytes_loaded / self.load_seconds if self.load_seconds > 0 else 0.0

    def to_wire(self) -> dict[str, Any]:
        """The versioned map this report travels as (the report's fields only: an
        :class:`~gpu_pool.server.reuse_store.AcquireResult` sends its placements apart)."""
        return {"v": REPORT_VERSION, **{name: getattr(self, name) for name in REPORT_FIELDS}}

    @staticmethod
    def from_wire(data: object) -> AcquireReport:
        """The report encoded in ``data`` (see the module docstring), or a
        :class:`~gpu_pool.errors.ProtocolError` saying what is wrong with it."""
        if not isinstance(data, dict):
            raise ProtocolError("acquire report must be a map")
        version = data.get("v")
        if type(version) is not int or version != REPORT_VERSION:  # True == 1: not a version
            raise UnsupportedVersion(
                f"acquire report version {version!r} is not supported (this side speaks {REPORT_VERSION})"
            )
        expected = {"v", *REPORT_FIELDS}
        unknown = sorted(map(str, set(data) - expected))[:8]  # the error stays short
        missing = sorted(expected - set(data))
        if unknown or missing:
            raise ProtocolError(f"acquire report fields: unknown {unknown}, missing {missing}")
        return AcquireReport(**{name: data[name] for name in REPORT_FIELDS})
