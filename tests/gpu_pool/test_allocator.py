"""Property tests of the pure planner: random region lists, random requests."""

from __future__ import annotations

import bisect
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool.errors import OutOfMemory
from gpu_pool.planner import packing
from gpu_pool.planner.allocator import (
    MergeCosts,
    PackingPolicy,
    PlannerEngine,
    TensorRequest,
    full_compaction_bytes,
    plan,
    plan_kv,
)
from gpu_pool.planner.packing import _try_packing, runs_of
from gpu_pool.planner.regions import Region, RegionKind, build_region_list
from tests.gpu_pool.arenas import UNIT, arenas


def layouts() -> st.SearchStrategy[list[Region]]:
    """Up to 40 regions of 1..64 units: free, inactive, pinned tensors and KV blocks."""
    return arenas()


requests_st = st.lists(st.integers(1, 96), min_size=1, max_size=12).map(
    lambda sizes: [TensorRequest(f"n{i}", s * UNIT) for i, s in enumerate(sizes)]
)


def naive_best_fit(free: list[tuple[int, int]], sizes: list[int]) -> bool:
    """Independent best-fit decreasing: can the sizes go into the free regions as they are?"""
    holes = sorted(s for _, s in free)
    for size in sorted(sizes, reverse=True):
        i = bisect.bisect_left(holes, size)
        if i == len(holes):
            return False
        rest = holes.pop(i) - size
        if rest:
            bisect.insort(holes, rest)
    return True


def segment_capacities(regions: list[Region]) -> list[int]:
    """Bytes of each run between fixed regions (pinned tensors, KV) once inactive tensors go."""
    caps, run = [], 0
    for r in regions:
        if r.is_free or r.movable:
            run += r.size
        else:
            caps.append(run)
            run = 0
    return [*caps, run]


def check_plan_invariants(
    regions: list[Region],
    requests: list[TensorRequest],
    packing: PackingPolicy,
    costs: MergeCosts | None = None,
    engine: PlannerEngine = PlannerEngine.NATIVE,
) -> None:
    capacity = regions[-1].end
    order = [r.key for r in regions if r.movable]
    try:
        p = plan(regions, requests, order[::-1], packing, costs, engine)
    except OutOfMemory as exc:
        # Allowed only when no run of regions between fixed ones could hold the whole request
        # even with every inactive tensor evicted (best-fit decreasing over segments always
        # succeeds when one segment can hold everything).
        need = sum(r.size for r in requests)
        assert exc.needed_bytes == need
        assert max(segment_capacities(regions), default=0) < need
        return
    by_key = {r.key: r for r in regions if r.key is not None}
    # Only inactive tensors are evicted or moved; a tensor is never both.
    for key in p.evictions:
        assert by_key[key].movable
    moved = {m.key for m in p.moves}
    assert not moved & set(p.evictions)
    for m in p.moves:
        assert by_key[m.key].movable and by_key[m.key].offset == m.src and by_key[m.key].size == m.size
    # The layout after the plan: fixed and surviving tensors (at new offsets) + placements.
    final: list[tuple[int, int, str]] = []
    new_offset = {m.key: m.dst for m in p.moves}
    for r in regions:
        if r.is_free or r.key in p.evictions:
            continue
        final.append((new_offset.get(r.key, r.offset), r.size, str(r.key)))
        if not r.movable:
            assert r.key not in new_offset, "fixed regions never move"
    sizes = {q.key: q.size for q in requests}
    assert set(p.placements) == set(sizes)
    final += [(off, sizes[k], k) for k, off in p.placements.items()]
    final.sort()
    for (a_off, a_size, a), (b_off, _, b) in itertools.pairwise(final):
        assert a_off + a_size <= b_off, f"{a} overlaps {b}"
    assert final[0][0] >= 0 and final[-1][0] + final[-1][1] <= capacity
    # Moves execute in order without clobbering a tensor that has not moved yet.
    pending = {m.key: (m.src, m.size) for m in p.moves}
    for m in p.moves:
        del pending[m.key]
        for src, size in pending.values():
            assert m.dst + m.size <= src or src + size <= m.dst
    # Bounded by "compact everything" after the same evictions.
    assert p.bytes_moved <= full_compaction_bytes(regions, p.evictions)
    # Zero moves (and zero evictions) when best-fit can place the request in the free regions.
    if naive_best_fit([(r.offset, r.size) for r in regions if r.is_free], list(sizes.values())):
        assert p.moves == () and p.evictions == ()


# Both engines: the C planner (the default) and its Python reference.
engines = pytest.mark.parametrize("engine", list(PlannerEngine))


@engines
@settings(max_examples=400, deadline=None)
@given(layouts(), requests_st)
def test_pgp_plans_are_sound(
    engine: PlannerEngine, regions: list[Region], requests: list[TensorRequest]
) -> None:
    check_plan_invariants(regions, requests, PackingPolicy.PGP, engine=engine)


@engines
@settings(max_examples=300, deadline=None)
@given(layouts(), requests_st, st.data(), st.floats(0, 1e-3))
def test_cost_aware_pgp_plans_are_sound(
    engine: PlannerEngine,
    regions: list[Region],
    requests: list[TensorRequest],
    data: st.DataObject,
    move_price: float,
) -> None:
    """With Eq. 1 prices, Stage 2 may evict a window instead of moving; invariants still hold."""
    keys = [str(r.key) for r in regions if r.movable]
    prices = data.draw(st.lists(st.floats(0, 1.0), min_size=len(keys), max_size=len(keys)))
    costs = MergeCosts(dict(zip(keys, prices, strict=True)), move_price)
    check_plan_invariants(regions, requests, PackingPolicy.PGP, costs, engine)


@engines
def test_cheap_evictions_replace_moves_and_dear_ones_do_not(engine: PlannerEngine) -> None:
    # free [0,2) | cold tensor [2,3) | free [3,5): a 4-unit tensor needs the 5-unit window.
    regions = build_region_list(5 * UNIT, [Region(2 * UNIT, UNIT, RegionKind.TENSOR, "cold", movable=True)])
    request = [TensorRequest("x", 4 * UNIT)]
    moving = plan(regions, request, [], PackingPolicy.PGP, MergeCosts({"cold": 1.0}, 1e-9), engine)
    assert moving.evictions == () and [m.key for m in moving.moves] == ["cold"]
    evicting = plan(regions, request, [], PackingPolicy.PGP, MergeCosts({"cold": 1e-9}, 1e-3), engine)
    assert evicting.evictions == ("cold",) and evicting.moves == ()
    assert evicting.placements == {"x": 0} and evicting.bytes_evicted == UNIT


@engines
@settings(max_examples=200, deadline=None)
@given(layouts(), requests_st)
def test_global_merge_plans_are_sound(
    engine: PlannerEngine, regions: list[Region], requests: list[TensorRequest]
) -> None:
    check_plan_invariants(regions, requests, PackingPolicy.GLOBAL_MERGE, engine=engine)


@settings(max_examples=200, deadline=None)
@given(layouts(), requests_st)
def test_pgp_moves_no_more_than_global_merge(regions: list[Region], requests: list[TensorRequest]) -> None:
    order = [r.key for r in regions if r.movable]
    try:
        pgp = plan(regions, requests, order, PackingPolicy.PGP)
        gm = plan(regions, requests, order, PackingPolicy.GLOBAL_MERGE)
    except OutOfMemory:
        return
    assert pgp.evictions == gm.evictions
    assert pgp.bytes_moved <= gm.bytes_moved


@engines
def test_figure6_partition_avoids_moving_the_big_tensor(engine: PlannerEngine) -> None:
    """A free/tensor/free/tensor/free arena where one split saves moving the larger tensor."""
    regions = build_region_list(
        12 * UNIT,
        [
            Region(2 * UNIT, 1 * UNIT, RegionKind.TENSOR, "small", movable=True),
            Region(5 * UNIT, 3 * UNIT, RegionKind.TENSOR, "big", movable=True),
        ],
    )
    # free: [0,2) [3,5) [8,12) units; new tensors 4 and 3 units: 4 fits [8,12); 3 needs [0,5) merged.
    new = [TensorRequest("x", 4 * UNIT), TensorRequest("y", 3 * UNIT)]
    p = plan(regions, new, ["small", "big"], engine=engine)
    assert p.evictions == ()
    assert [m.key for m in p.moves] == ["small"]
    gm = plan(regions, new, [], PackingPolicy.GLOBAL_MERGE, engine=engine)
    assert gm.bytes_moved == 4 * UNIT


@engines
def test_out_of_memory_names_bytes(engine: PlannerEngine) -> None:
    regions = build_region_list(4 * UNIT, [Region(0, UNIT, RegionKind.TENSOR, "pinned", movable=False)])
    with pytest.raises(OutOfMemory) as info:
        plan(regions, [TensorRequest("x", 4 * UNIT)], [], engine=engine)
    assert info.value.needed_bytes == 4 * UNIT
    assert info.value.available_bytes == 3 * UNIT
    assert str(4 * UNIT) in str(info.value) and str(3 * UNIT) in str(info.value)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(1, 20), st.integers(1, 8), st.booleans())
def test_kv_plans_never_touch_fixed_regions(
    regions: list[Region], num_blocks: int, units: int, aligned: bool
) -> None:
    block = units * UNIT
    order = [r.key for r in regions if r.movable]
    try:
        kv = plan_kv(regions, num_blocks, block, order, aligned)
    except OutOfMemory as exc:
        carvable = sum(r.size // block for r in regions if r.is_free or r.movable)
        # Evicting everything must really not have been enough (up to merging of neighbours).
        assert exc.needed_bytes == num_blocks * block
        assert carvable * block <= sum(r.size for r in regions if r.is_free or r.movable)
        return
    assert len(kv.offsets) == num_blocks
    if aligned:
        assert all(o % block == 0 for o in kv.offsets)
    evicted = set(kv.evictions)
    assert all(next(r for r in regions if r.key == k).movable for k in evicted)
    kept = [(r.offset, r.size) for r in regions if not r.is_free and r.key not in evicted]
    spans = sorted(kept + [(o, block) for o in kv.offsets])
    for (a, sa), (b, _) in itertools.pairwise(spans):
        assert a + sa <= b
    # Eviction happens only when free space alone could not hold the blocks.
    if not aligned and sum(r.size // block for r in regions if r.is_free) >= num_blocks:
        assert not evicted


def greedy_two_halves(sizes: list[int], cap1: int, cap2: int) -> bool:
    """TryPacking one tensor at a time (the reference for the per-run closed form)."""
    for size in sizes:
        if cap1 >= cap2:
            if size > cap1:
                return False
            cap1 -= size
        else:
            if size > cap2:
                return False
            cap2 -= size
    return True


@settings(max_examples=2000, deadline=None)
@given(
    st.lists(st.sampled_from([1, 2, 3, 5, 8, 13]), min_size=1, max_size=30),
    st.integers(0, 120),
    st.integers(0, 120),
)
def test_try_packing_by_runs_matches_one_tensor_at_a_time(sizes: list[int], cap1: int, cap2: int) -> None:
    sizes.sort(reverse=True)
    runs = runs_of([TensorRequest(f"t{i}", s) for i, s in enumerate(sizes)])
    assert _try_packing(runs, cap1, cap2) == greedy_two_halves(sizes, cap1, cap2)


def best_fit_one_at_a_time(free: list[tuple[int, int]], desc: list[TensorRequest]) -> dict[str, int] | None:
    """Best-fit decreasing one tensor at a time (the reference for the per-run version)."""
    by_size = sorted((size, offset) for offset, size in free)
    placements = {}
    for r in desc:
        i = bisect.bisect_left(by_size, (r.size, -1))
        if i == len(by_size):
            return None
        size, offset = by_size.pop(i)
        placements[r.key] = offset
        if size > r.size:
            bisect.insort(by_size, (size - r.size, offset + r.size))
    return placements


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=12),
    st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=20),
)
def test_best_fit_by_runs_matches_one_tensor_at_a_time(gaps: list[int], sizes: list[int]) -> None:
    free = list(zip(itertools.accumulate([0, *gaps[:-1]], lambda acc, g: acc + g + 100), gaps, strict=True))
    desc = sorted((TensorRequest(f"t{i}", s) for i, s in enumerate(sizes)), key=lambda r: -r.size)
    total = sum(sizes)
    if max(gaps) >= total:
        return  # the whole-block case places the request contiguously instead
    got = packing.place_direct([o for o, _ in free], gaps, desc, desc, runs_of(desc), total)
    want = best_fit_one_at_a_time(free, desc)
    assert got == want
