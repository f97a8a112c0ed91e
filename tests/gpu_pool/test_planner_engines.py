"""The C planner (gpu_pool/planner/csrc/) against its Python reference: identical plans.

Soundness of the plans themselves (no overlaps, fixed regions stay, bounded moves) is
property-tested for both engines in test_allocator.py; here every decision must match the
reference exactly: placements, evictions in order, moves in order, bytes evicted, and the
out-of-memory error. Layouts are drawn with many equal sizes so that ties (best-fit bins,
partition points, move windows) are exercised, and eviction orders carry stale and
duplicate keys as the Reuse Store's may.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.planner import build_scenarios
from gpu_pool import _planner
from gpu_pool.errors import OutOfMemory
from gpu_pool.planner import native_planner
from gpu_pool.planner.allocator import MergeCosts, PackingPolicy, Plan, PlannerEngine, TensorRequest, plan
from gpu_pool.planner.eviction import EvictionPolicy, eviction_order
from gpu_pool.planner.plan_types import Move
from gpu_pool.planner.regions import Region, RegionKind, build_region_list
from tests.gpu_pool.arenas import KINDS, UNIT, arenas


def many_ties() -> st.SearchStrategy[list[Region]]:
    """Up to 120 regions, sizes from small sets so that many are equal, mostly tensors."""
    return arenas(120, ([1, 2, 4, 8], [1, 3, 5, 7, 16], range(1, 65)), (*KINDS[1:], "movable"), 8)


def both(
    regions: list[Region],
    requests: list[TensorRequest],
    order: list[str],
    packing: PackingPolicy,
    costs: MergeCosts | None,
    max_split_tries: int = 16,
) -> tuple[Plan | str, Plan | str]:
    """The native and the reference outcome: a plan, or the out-of-memory error as text."""
    out: list[Plan | str] = []
    for engine in (PlannerEngine.NATIVE, PlannerEngine.PYTHON):
        try:
            out.append(plan(regions, requests, order, packing, costs, engine, max_split_tries))
        except OutOfMemory as exc:
            out.append(f"{exc} needed={exc.needed_bytes} available={exc.available_bytes}")
    return out[0], out[1]


@settings(max_examples=600, deadline=None)
@given(
    many_ties(),
    st.lists(st.sampled_from([1, 1, 2, 3, 4, 8, 16, 24, 40]), min_size=1, max_size=40),
    st.data(),
    st.sampled_from(list(PackingPolicy)),
    st.booleans(),
    st.sampled_from([1, 2, 3, 16]),
)
def test_engines_make_identical_plans(
    regions: list[Region],
    units: list[int],
    data: st.DataObject,
    packing: PackingPolicy,
    priced: bool,
    max_split_tries: int,
) -> None:
    """Few split tries leave large subspaces to merge: ties between move windows and the
    bound on failed TryPackings then decide plans, and both engines must break them alike."""
    requests = [TensorRequest(f"n{i}", u * UNIT) for i, u in enumerate(units)]
    movable = [str(r.key) for r in regions if r.movable]
    order = data.draw(st.permutations(movable))
    # Stale keys (evicted since the order was computed), a pinned tensor, duplicates.
    order = data.draw(st.lists(st.sampled_from(["gone", "p0", *order]), max_size=4)) + order + order[:3]
    costs = None
    if priced:
        prices = data.draw(st.lists(st.floats(0, 1.0), min_size=len(movable), max_size=len(movable)))
        costs = MergeCosts(dict(zip(movable, prices, strict=True)), data.draw(st.floats(0, 1e-3)))
    native, reference = both(regions, requests, order, packing, costs, max_split_tries)
    assert native == reference


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("priced", [False, True])
def test_engines_agree_on_the_benchmark_arenas(seed: int, priced: bool) -> None:
    """The planner benchmark's fragmented ~700-region arenas: hundreds of moves and evictions."""
    for sc in build_scenarios(seed, 400):
        order = eviction_order(EvictionPolicy.MCE, sc.candidates, sc.models)
        costs = None
        if priced:
            rng = np.random.default_rng(seed)
            costs = MergeCosts({c.key: float(rng.uniform(0, 0.05)) for c in sc.candidates}, 1e-10)
        for packing in PackingPolicy:
            native, reference = both(sc.regions, sc.requests, order, packing, costs)
            assert isinstance(native, Plan)
            assert native == reference, (sc.name, packing)


def test_engines_agree_on_out_of_memory() -> None:
    regions = build_region_list(
        6 * UNIT,
        [
            Region(0, UNIT, RegionKind.TENSOR, "t", movable=True),
            Region(2 * UNIT, UNIT, RegionKind.TENSOR, "pin", movable=False),
        ],
    )
    native, reference = both(regions, [TensorRequest("x", 4 * UNIT)], [], PackingPolicy.PGP, None)
    assert isinstance(native, str) and native == reference
    assert f"needed={4 * UNIT} available={4 * UNIT}" in native and "cut into pieces" in native


def columns() -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    return (
        np.array([0, 512], np.int64),
        np.array([256, 256], np.int64),
        np.array([True, False]),
        ["a", "b"],
    )


def test_binding_rejects_malformed_columns() -> None:
    offsets, sizes, movable, keys = columns()
    args = (offsets, sizes, movable, keys, 0, 1024, [256], [], None, Move, False, 0.0, 16)
    assert _planner.plan(*args)[0] == [256]
    bad = {
        0: np.array([0, 512], np.int32),  # wrong dtype
        1: np.array([256], np.int64),  # wrong length
        2: np.array([1, 0], np.int8),  # not bool
    }
    for pos, value in bad.items():
        with pytest.raises(ValueError, match="must be a contiguous"):
            _planner.plan(*args[:pos], value, *args[pos + 1 :])
    overlapping = np.array([0, 128], np.int64)
    with pytest.raises(ValueError, match="overlaps"):
        _planner.plan(overlapping, *args[1:])
    with pytest.raises(ValueError, match="leave the arena"):
        _planner.plan(*args[:5], 600, *args[6:])
    with pytest.raises(ValueError, match="> 0"):
        _planner.plan(*args[:6], [256, 0], *args[7:])
    with pytest.raises(TypeError, match="tuple subclass"):
        _planner.plan(*args[:9], dict, *args[10:])
    with pytest.raises(ValueError, match="max_split_tries"):
        _planner.plan(*args[:12], 0)


def test_engines_bound_failed_split_tries_alike() -> None:
    """A segment whose first partition point fails TryPacking: with one try allowed it is
    merged whole, with two it splits (found by random search against a C mutant that
    allowed one try too many)."""
    rows = [(0, 8, "t0", True), (8, 8, "t1", True), (16, 1, "p2", False), (30, 8, "t6", True),
            (42, 4, "t8", True), (54, 2, "p11", False), (56, 8, "t12", True), (64, 2, "t13", True),
            (66, 8, "t14", True), (74, 1, "p15", False), (75, 8, "t16", True), (87, 2, "t18", True),
            (89, 8, "t19", True), (98, 4, "t21", True)]  # fmt: skip
    regions = build_region_list(
        102 * UNIT, [Region(o * UNIT, s * UNIT, RegionKind.TENSOR, k, movable=m) for o, s, k, m in rows]
    )
    requests = [TensorRequest(f"n{i}", u * UNIT) for i, u in enumerate([4, 8, 8, 8])]
    order = [k for _, _, k, m in rows if m]
    plans = {}
    for tries in (1, 2):
        native, reference = both(regions, requests, order, PackingPolicy.PGP, None, tries)
        assert isinstance(native, Plan) and native == reference
        plans[tries] = native
    assert plans[1].bytes_moved > plans[2].bytes_moved  # the bound changes the plan


def test_an_unbuilt_core_is_reported_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout used without scripts/setup: native plans fail loudly, the reference works."""
    monkeypatch.setattr(native_planner, "_planner", None)
    monkeypatch.setattr(native_planner, "_IMPORT_ERROR", ImportError("no module named gpu_pool._planner"))
    regions = build_region_list(4 * UNIT, [])
    with pytest.raises(native_planner.NativeCoreMissing, match="run scripts/setup"):
        plan(regions, [TensorRequest("x", UNIT)])
    assert plan(regions, [TensorRequest("x", UNIT)], engine=PlannerEngine.PYTHON).placements == {"x": 0}
