"""Whether (and how) a node's agent schedules its CPU device token by token."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenSchedulingConfig:
    """``enabled``: co-located CPU instances run one iteration at a time, least headroom first,
    each on all of the cores the machine leaves (:mod:`runtime.mesh`); off: side by side, the
    cores split among them (:mod:`runtime.cpu_share`). ``max_iteration_s``: a grant held
    longer is taken back (a stuck worker must not stall its device). ``max_passed_over``: a
    waiting instance passed over by this many grants in a row goes next, whatever the
    deadlines (workers state their own deadlines: one must not starve its neighbours)."""

    enabled: bool = False
    max_iteration_s: float = 30.0
    max_passed_over: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.max_iteration_s <= 3600:
            raise ValueError(f"max_iteration_s must be in (0, 3600], got {self.max_iteration_s}")
        if not 1 <= self.max_passed_over <= 1_000_000:
            raise ValueError(f"max_passed_over must be in [1, 1000000], got {self.max_passed_over}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TokenSchedulingConfig:
        """``EMBER_TOKEN_SCHEDULING`` (on | off), ``EMBER_TOKEN_MAX_ITERATION_S`` and
        ``EMBER_TOKEN_MAX_PASSED_OVER``."""
        env = os.environ if environ is None else environ
        raw = env.get("EMBER_TOKEN_SCHEDULING", "off").strip().lower()
        if raw not in ("on", "off"):
            raise ValueError(f"EMBER_TOKEN_SCHEDULING must be on or off, not {raw!r}")
        limit = env.get("EMBER_TOKEN_MAX_ITERATION_S", "30")
        try:
            seconds = float(limit)
        except ValueError:
            raise ValueError(f"EMBER_TOKEN_MAX_ITERATION_S must be seconds, not {limit!r}") from None
        passes = env.get("EMBER_TOKEN_MAX_PASSED_OVER", "8")
        try:
            max_passed_over = int(passes)
        except ValueError:
            raise ValueError(f"EMBER_TOKEN_MAX_PASSED_OVER must be a count, not {passes!r}") from None
        return cls(raw == "on", seconds, max_passed_over)
