"""Iteration times of one model on one device kind, interpolated (LLM-Mesh §5.2).

Prefill time is close to linear in the prompt's length, so it is interpolated between the
two profiled lengths around it. Decode time depends on the batch size and the average
sequence length, so it is interpolated bilinearly on a grid of both. Profiled points are
powers of two (``O(log L_max * log B_max)`` samples); outside the grid the nearest edge
segment is extended linearly, never below the smallest profiled time. The tables are
materialized at registration (Medusa §6): nothing is profiled when an instance starts.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_POINTS = 64  # per axis: a table from a profile file is bounded input


def _segment(xs: Sequence[float], x: float) -> tuple[int, int]:
    """Indices of the two points of ``xs`` (sorted, >= 2) whose segment covers ``x``, or the
    nearest edge segment."""
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    return i - 1, i


def _lerp(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_axis(name: str, xs: tuple[int, ...]) -> None:
    if not 1 <= len(xs) <= MAX_POINTS:
        raise ValueError(f"{name}: 1 to {MAX_POINTS} points, got {len(xs)}")
    if any(x < 1 for x in xs) or any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"{name} must be increasing positive integers, got {xs}")


@dataclass(frozen=True, slots=True)
class TimeTable:
    """Profiled seconds per iteration: prefill by length, decode by (batch, average length)."""

    prefill_lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    decode_batches: tuple[int, ...]
    decode_lengths: tuple[int, ...]
    decode_s: tuple[tuple[float, ...], ...]  # [batch index][length index]

    def __post_init__(self) -> None:
        _check_axis("prefill_lengths", self.prefill_lengths)
        _check_axis("decode_batches", self.decode_batches)
        _check_axis("decode_lengths", self.decode_lengths)
        if len(self.prefill_s) != len(self.prefill_lengths):
            raise ValueError("prefill_s needs one time per prefill length")
        if len(self.decode_s) != len(self.decode_batches) or any(
            len(row) != len(self.decode_lengths) for row in self.decode_s
        ):
            raise ValueError("decode_s needs one row per batch size and one time per length")
        times = [*self.prefill_s, *(t for row in self.decode_s for t in row)]
        if not all(0 < t < 3600 for t in times):  # NaN fails too
            raise ValueError("every profiled time must be in (0, 3600) seconds")

    def prefill(self, length: int) -> float:
        """Seconds to prefill ``length`` tokens (one request, nothing cached)."""
        xs, ys = self.prefill_lengths, self.prefill_s
        if len(xs) == 1:
            return ys[0] * max(length, 1) / xs[0]
        i, j = _segment(xs, length)
        return max(min(ys), _lerp(xs[i], ys[i], xs[j], ys[j], length))

    def decode(self, batch: int, avg_length: float) -> float:
        """Seconds of one decode iteration of ``batch`` sequences of ``avg_length`` tokens."""
        if batch < 1:
            return 0.0
        rows = [self._along_length(row, avg_length) for row in self.decode_s]
        bs = self.decode_batches
        if len(bs) == 1:
            return rows[0] * batch / bs[0] if batch > bs[0] else rows[0]
        i, j = _segment(bs, batch)
        return max(min(min(r) for r in self.decode_s), _lerp(bs[i], rows[i], bs[j], rows[j], batch))

    def _along_length(self, row: tuple[float, ...], length: float) -> float:
        ls = self.decode_lengths
        if len(ls) == 1:
            return row[0]
        i, j = _segment(ls, length)
        return max(min(row), _lerp(ls[i], row[i], ls[j], row[j], length))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "prefill_lengths": list(self.prefill_lengths),
            "prefill_s": list(self.prefill_s),
            "decode_batches": list(self.decode_batches),
            "decode_lengths": list(self.decode_lengths),
            "decode_s": [list(row) for row in self.decode_s],
        }

    @classmethod
    def from_json(cls, data: Any) -> TimeTable:
        """The table of a profile file (ValueError on anything malformed or of another version)."""
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"a time table must be an object of version {VERSION}")
        try:
            return cls(
                tuple(int(x) for x in data["prefill_lengths"]),
                tuple(float(x) for x in data["prefill_s"]),
                tuple(int(x) for x in data["decode_batches"]),
                tuple(int(x) for x in data["decode_lengths"]),
                tuple(tuple(float(x) for x in row) for row in data["decode_s"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed time table: {exc}") from None
