"""Affinity placement (Tangram Alg. 2 / Eq. 3) and scaling rules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.policies import (
    DeviceState,
    ModelDemand,
    desired_instances,
    expected_start,
    place,
    should_reject,
)

GB = 1 << 30


def test_the_device_holding_the_tensors_wins() -> None:
    m = ModelDemand("m", 2 * GB)
    cold = DeviceState("n1/cuda:0", free_bytes=10 * GB, evictable_bytes=0)
    warm = DeviceState("n1/cuda:1", free_bytes=1 * GB, evictable_bytes=0, resident_bytes={"m": 2 * GB})
    [p] = place([m], [cold, warm])
    assert p.device_id == "n1/cuda:1" and p.expected_start_s == 0 and p.missing_bytes == 0


def test_host_cache_beats_disk_and_queueing_counts() -> None:
    m = ModelDemand("m", 4 * GB)
    disk = DeviceState("a", 8 * GB, 0, disk_bandwidth=2e9)
    cached = DeviceState("b", 8 * GB, 0, host_cache_models=frozenset({"m"}), host_cache_bandwidth=20e9)
    assert place([m], [disk, cached])[0].device_id == "b"
    busy = DeviceState(
        "b", 8 * GB, 0, host_cache_models=frozenset({"m"}), host_cache_bandwidth=20e9, queue_seconds=5
    )
    assert place([m], [disk, busy])[0].device_id == "a"


def test_infeasible_models_stay_unplaced() -> None:
    [p] = place([ModelDemand("big", 20 * GB)], [DeviceState("a", 8 * GB, 4 * GB)])
    assert p.device_id is None and p.expected_start_s == math.inf


def test_placements_in_one_round_charge_the_device() -> None:
    ms = [ModelDemand("m1", 6 * GB), ModelDemand("m2", 6 * GB)]
    ds = [DeviceState("a", 8 * GB, 0), DeviceState("b", 8 * GB, 0, disk_bandwidth=1e9)]
    p1, p2 = place(ms, ds)
    assert p1.device_id == "a" and p2.device_id == "b"  # a is full after m1


devices_st = st.lists(
    st.builds(
        DeviceState,
        device_id=st.uuids().map(str),
        free_bytes=st.integers(0, 16 * GB),
        evictable_bytes=st.integers(0, 16 * GB),
        resident_bytes=st.dictionaries(
            st.sampled_from(["m0", "m1", "m2"]), st.integers(0, 8 * GB), max_size=3
        ),
        disk_bandwidth=st.floats(1e8, 1e11),
        queue_seconds=st.floats(0, 10),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda d: d.device_id,
)


@given(devices_st, st.integers(1, 8 * GB), st.sampled_from(["m0", "m1", "m2"]))
def test_placement_picks_the_lowest_feasible_expected_start(
    devices: list[DeviceState], size: int, mid: str
) -> None:
    m = ModelDemand(mid, size)
    [p] = place([m], devices)
    starts = [t for d in devices if (t := expected_start(m, d)) is not None]
    if not starts:
        assert p.device_id is None
    else:
        assert p.expected_start_s == min(starts)
        chosen = next(d for d in devices if d.device_id == p.device_id)
        assert expected_start(m, chosen) == min(starts)


@given(st.integers(0, 1000), st.integers(1, 64), st.integers(0, 10), st.integers(0, 10))
def test_desired_instances_bounds(in_flight: int, concurrency: int, lo: int, extra: int) -> None:
    hi = lo + extra
    if hi < 1:
        return
    n = desired_instances(in_flight, concurrency, lo, hi)
    assert lo <= n <= hi
    if lo < n < hi:
        assert n == math.ceil(in_flight / concurrency)
    with pytest.raises(ValueError):
        desired_instances(in_flight, 0, lo, hi)


def test_early_reject() -> None:
    assert should_reject(3.0, 2.0) and not should_reject(1.0, 2.0)
