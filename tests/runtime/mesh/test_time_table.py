"""Interpolated iteration times (LLM-Mesh §5.2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.mesh.time_table import TimeTable


def table() -> TimeTable:
    return TimeTable(
        prefill_lengths=(16, 64, 256),
        prefill_s=(0.02, 0.05, 0.2),
        decode_batches=(1, 4, 16),
        decode_lengths=(64, 512),
        decode_s=((0.010, 0.014), (0.012, 0.020), (0.030, 0.060)),
    )


def test_profiled_points_are_exact() -> None:
    t = table()
    assert t.prefill(64) == pytest.approx(0.05)
    assert t.decode(4, 512) == pytest.approx(0.020)
    assert t.decode(1, 64) == pytest.approx(0.010)


def test_interpolates_between_the_two_closest_points() -> None:
    t = table()
    assert t.prefill(160) == pytest.approx(0.05 + (0.2 - 0.05) * 96 / 192)
    # bilinear: halfway in batch (1 -> 4 at 2.5) and in length (64 -> 512 at 288)
    row1, row4 = 0.012, 0.016
    assert t.decode(2.5, 288) == pytest.approx(row1 + (row4 - row1) * 0.5)  # type: ignore[arg-type]


def test_extrapolates_beyond_the_grid_along_the_edge_segment() -> None:
    t = table()
    assert t.prefill(512) == pytest.approx(0.2 + (0.2 - 0.05) / 192 * 256)
    assert t.decode(32, 64) == pytest.approx(0.030 + (0.030 - 0.012) / 12 * 16)
    assert t.prefill(1) == pytest.approx(0.02)  # never below the smallest profiled time


@given(st.integers(1, 4096), st.integers(1, 4096))
def test_prefill_is_monotone_for_a_monotone_profile(a: int, b: int) -> None:
    t = table()
    lo, hi = sorted((a, b))
    assert t.prefill(lo) <= t.prefill(hi) + 1e-12


@given(st.integers(1, 64), st.floats(1, 8192), st.integers(1, 64), st.floats(1, 8192))
def test_decode_is_monotone_for_a_monotone_profile(b1: int, l1: float, b2: int, l2: float) -> None:
    t = table()
    if b1 <= b2 and l1 <= l2:
        assert t.decode(b1, l1) <= t.decode(b2, l2) + 1e-12


def test_round_trips_and_rejects_malformed_tables() -> None:
    t = table()
    assert TimeTable.from_json(t.to_json()) == t
    bad = t.to_json() | {"prefill_lengths": [64, 16, 256]}
    with pytest.raises(ValueError, match="increasing"):
        TimeTable.from_json(bad)
    with pytest.raises(ValueError, match="version"):
        TimeTable.from_json(t.to_json() | {"version": 99})
    with pytest.raises(ValueError, match=r"\(0, 3600\)"):
        TimeTable.from_json(t.to_json() | {"prefill_s": [0.1, float("nan"), 0.3]})
    with pytest.raises(ValueError, match="malformed"):
        TimeTable.from_json({"version": 1})
