"""Hypothesis strategy for planner inputs: random region lists of one arena."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from gpu_pool.planner.regions import Region, RegionKind, build_region_list

UNIT = 256
KINDS = ("free", "free", "movable", "movable", "pinned", "kv")


@st.composite
def arenas(
    draw: st.DrawFn,
    max_regions: int = 40,
    size_sets: Sequence[Sequence[int]] = (range(1, 65),),
    kinds: Sequence[str] = KINDS,
    max_tail_units: int = 0,
) -> list[Region]:
    """Runs of free space, inactive tensors, pinned tensors and KV blocks; sizes (in UNITs)
    from one of ``size_sets`` (small sets make many sizes equal), then a free tail."""
    sizes = draw(st.sampled_from(size_sets))
    allocated: list[Region] = []
    offset = 0
    for i in range(draw(st.integers(1, max_regions))):
        size = draw(st.sampled_from(sizes)) * UNIT
        kind = draw(st.sampled_from(kinds))
        if kind == "movable":
            allocated.append(Region(offset, size, RegionKind.TENSOR, f"t{i}", movable=True))
        elif kind == "pinned":
            allocated.append(Region(offset, size, RegionKind.TENSOR, f"p{i}", movable=False))
        elif kind == "kv":
            allocated.append(Region(offset, size, RegionKind.KV, f"{i}"))
        offset += size
    return build_region_list(offset + draw(st.integers(0, max_tail_units)) * UNIT, allocated)
