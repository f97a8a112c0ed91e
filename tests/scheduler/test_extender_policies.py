"""The extender's filter and prioritize decisions (pure: Eq. 3 over pool views)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scheduler.extender.policies import (
    PlacementConfig,
    PoolView,
    Residency,
    filter_nodes,
    judge,
    prioritize,
    scores,
)
from scheduler.extender.wire import PodDemand

NOW = 1_000_000.0
MB = 1 << 20
CONFIG = PlacementConfig(report_ttl_s=10.0)


def demand(model: str | None = "m", weight: int = 100 * MB) -> PodDemand:
    return PodDemand("ember-fn/p", "f", model, weight if model else 0)


def view(
    node: str,
    free: int = 1 << 30,
    evictable: int = 0,
    resident: int = 0,
    bandwidth: float = 1e9,
    queue: float = 0.0,
    age: float = 1.0,
    model: str = "m",
    loaded: int = 1 << 40,  # what the pool loaded: its bandwidth is trusted by default
) -> PoolView:
    resident_map = {model: resident} if resident else {}
    return PoolView(f"{node}/cpu", free, evictable, resident_map, bandwidth, queue, NOW - age, loaded)


def residency(*views: PoolView, malformed: dict[str, str] | None = None) -> Residency:
    return Residency({v.device_id: v for v in views}, malformed or {})


def test_filter_drops_down_and_full_pools_with_reasons() -> None:
    r = residency(
        view("ok"),
        view("stale", age=30.0),
        view("full", free=10 * MB, evictable=20 * MB),
        view("warm", free=0, resident=100 * MB),  # holds it all: nothing to fit
    )
    r = Residency(r.pools, {"bad/cpu": "updated must be a number"})
    result, _ = filter_nodes(demand(), ["ok", "stale", "full", "warm", "gone", "bad"], r, NOW, CONFIG)
    assert result.passed == ("ok", "warm")
    assert set(result.unresolvable) == {"stale", "gone", "bad"}
    assert "30.0 s old" in result.unresolvable["stale"] and "pool down" in result.unresolvable["stale"]
    assert "no pool report for gone/cpu" in result.unresolvable["gone"]
    assert "malformed" in result.unresolvable["bad"]
    assert result.failed == {
        "full": f"pool on full/cpu cannot fit model m: {100 * MB} bytes missing, "
        f"{10 * MB} free + {20 * MB} evictable"
    }


def test_prioritize_prefers_the_node_holding_the_tensors() -> None:
    r = residency(view("cold"), view("half", resident=50 * MB), view("warm", resident=100 * MB))
    priorities, verdicts = prioritize(demand(), ["cold", "half", "warm"], r, NOW, CONFIG)
    assert [(p.host, p.score) for p in priorities] == [("cold", 0), ("half", 5), ("warm", 10)]
    assert verdicts[2].expected_start_s == 0.0


def test_queueing_and_bandwidth_count() -> None:
    # Eq. 3: 100 MB at 1 GB/s = 0.105 s; a 1 s queue on the warm node makes the cold one better.
    r = residency(view("cold"), view("warm", resident=100 * MB, queue=1.0))
    scored = dict(prioritize(demand(), ["cold", "warm"], r, NOW, CONFIG)[0])
    assert scored == {"cold": 10, "warm": 0}
    # An unmeasured bandwidth (0) uses the default: 2 GB/s beats a measured 0.5 GB/s.
    r = residency(view("slow", bandwidth=0.5e9), view("new", bandwidth=0.0))
    assert dict(prioritize(demand(), ["slow", "new"], r, NOW, CONFIG)[0]) == {"slow": 0, "new": 10}
    # A bandwidth measured over a few small loads is their overhead: the default stands in.
    r = residency(view("slow", bandwidth=0.5e9), view("fast", bandwidth=4e9, loaded=10 * MB))
    assert dict(prioritize(demand(), ["slow", "fast"], r, NOW, CONFIG)[0]) == {"slow": 0, "fast": 10}
    untrusting = PlacementConfig(trusted_load_bytes=1 << 50)
    assert dict(prioritize(demand(), ["slow", "fast"], r, NOW, untrusting)[0]) == {"slow": 10, "fast": 10}


def test_a_cold_model_goes_where_it_evicts_nothing() -> None:
    """Eq. 3 alone sends every cold model to the fastest node, full or not; the eviction price
    sends it where there is room (an evicted byte is a byte someone reloads later)."""
    full_fast = view("fast", free=0, evictable=1 << 30, bandwidth=1.5e9, resident=500 * MB, model="other")
    roomy_slow = view("slow", free=1 << 30, bandwidth=1e9)
    r = residency(full_fast, roomy_slow)
    assert dict(prioritize(demand(), ["fast", "slow"], r, NOW, CONFIG)[0]) == {"fast": 0, "slow": 10}
    once = PlacementConfig(eviction_weight=1.0)
    assert dict(prioritize(demand(), ["fast", "slow"], r, NOW, once)[0]) == {"fast": 5, "slow": 10}
    pure = PlacementConfig(eviction_weight=0.0)
    assert dict(prioritize(demand(), ["fast", "slow"], r, NOW, pure)[0]) == {"fast": 10, "slow": 5}


def test_a_full_node_cycling_its_models_loses_to_a_node_with_room() -> None:
    """A node holding part of the model but full (each start there evicts another model's part,
    whose next start evicts in turn) against an empty node: moving once wins at weight 2."""
    cycling = view("cycling", free=5 * MB, evictable=200 * MB, resident=55 * MB)
    roomy = view("roomy")
    r = residency(cycling, roomy)
    assert dict(prioritize(demand(), ["cycling", "roomy"], r, NOW, CONFIG)[0]) == {"cycling": 8, "roomy": 10}
    once = PlacementConfig(eviction_weight=1.0)
    assert dict(prioritize(demand(), ["cycling", "roomy"], r, NOW, once)[0])["cycling"] == 10


def test_a_pod_that_is_no_function_is_left_alone() -> None:
    result, _ = filter_nodes(demand(model=None), ["a", "b"], Residency({}), NOW, CONFIG)
    assert result.passed == ("a", "b") and not result.failed and not result.unresolvable
    priorities, _ = prioritize(demand(model=None), ["a", "b"], Residency({}), NOW, CONFIG)
    assert [p.score for p in priorities] == [0, 0]


def test_the_score_mapping() -> None:
    assert scores([], 1.0) == []
    assert scores([None, None], 1.0) == [0, 0]
    assert scores([0.0, 0.5, 1.0, None], 1.0) == [10, 5, 0, 0]
    assert scores([0.2, 0.2], 1.0) == [10, 10]
    assert scores([0.0, 0.001], 1.0) == [10, 10]  # 0.1 % of a cold load apart: alike
    assert scores([0.0, 4.0, 8.0], 1.0) == [10, 5, 0]  # the spread beyond a cold load
    assert scores([3.0, 3.0], 0.0) == [10, 10]  # a weightless model


def test_config_is_validated() -> None:
    for bad in (
        {"report_ttl_s": 0}, {"default_bandwidth": 0}, {"device": "a/b"}, {"device": ""},
        {"eviction_weight": -1}, {"trusted_load_bytes": -1},
    ):  # fmt: skip
        with pytest.raises(ValueError):
            PlacementConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        view("a", free=-1)
    with pytest.raises(ValueError):
        view("a", bandwidth=float("inf"))
    with pytest.raises(ValueError):  # regression: negative residency was taken as is
        view("a", resident=-1)


# ----- properties ------------------------------------------------------------------------------

sizes = st.integers(min_value=0, max_value=1 << 34)
pools = st.builds(
    lambda free, evictable, resident, bandwidth, queue, age: (
        free,
        evictable,
        resident,
        bandwidth,
        queue,
        age,
    ),
    sizes,
    sizes,
    sizes,
    st.sampled_from([0.0, 1e6, 1e8, 1e9, 2e9, 1e10]),
    st.floats(min_value=0, max_value=100),
    st.floats(min_value=-5, max_value=30),
)


def views_of(specs: list[tuple[int, int, int, float, float, float]]) -> list[PoolView]:
    return [view(f"n{i}", f, e, r, b, q, a) for i, (f, e, r, b, q, a) in enumerate(specs)]


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(pools, min_size=1, max_size=12), weight=sizes)
def test_scores_are_within_0_and_10_and_the_best_feasible_node_scores_10(
    specs: list[tuple[int, int, int, float, float, float]], weight: int
) -> None:
    views = views_of(specs)
    nodes = [v.device_id.split("/")[0] for v in views] + ["missing"]
    priorities, verdicts = prioritize(demand(weight=weight), nodes, residency(*views), NOW, CONFIG)
    assert [p.host for p in priorities] == nodes
    assert all(0 <= p.score <= 10 for p in priorities)
    feasible = [(v.expected_start_s, p.score) for v, p in zip(verdicts, priorities, strict=True)]
    feasible = [(t, s) for t, s in feasible if t is not None]
    if feasible:
        best = min(t for t, _ in feasible)
        assert all(s == 10 for t, s in feasible if t == best)
        # non-increasing in the expected start
        ordered = sorted(feasible)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(ordered))
    assert priorities[-1].score == 0  # no report


@settings(max_examples=300, deadline=None)
@given(
    warm=pools,
    cold=pools,
    weight=st.integers(min_value=1, max_value=1 << 34),
    queue=st.floats(min_value=0, max_value=100),
    others=st.lists(pools, max_size=6),
)
def test_a_node_holding_all_bytes_never_scores_below_one_holding_none(
    warm: tuple[int, int, int, float, float, float],
    cold: tuple[int, int, int, float, float, float],
    weight: int,
    queue: float,
    others: list[tuple[int, int, int, float, float, float]],
) -> None:
    """With equal queueing, whatever their free bytes and bandwidths and whatever other nodes."""
    w = view("warm", warm[0], warm[1], weight, warm[3], queue, 1.0)
    c = view("cold", cold[0], cold[1], 0, cold[3], queue, 1.0)
    views = [w, c, *views_of(others)]
    nodes = [v.device_id.split("/")[0] for v in views]
    scored = dict(prioritize(demand(weight=weight), nodes, residency(*views), NOW, CONFIG)[0])
    assert scored["warm"] >= scored["cold"]
    result, _ = filter_nodes(demand(weight=weight), nodes, residency(*views), NOW, CONFIG)
    assert "warm" in result.passed


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(pools, min_size=1, max_size=12), weight=sizes)
def test_filter_never_drops_a_healthy_node_with_room(
    specs: list[tuple[int, int, int, float, float, float]], weight: int
) -> None:
    views = views_of(specs)
    nodes = [v.device_id.split("/")[0] for v in views]
    result, _ = filter_nodes(demand(weight=weight), nodes, residency(*views), NOW, CONFIG)
    assert set(result.passed) | set(result.failed) | set(result.unresolvable) == set(nodes)
    assert not set(result.passed) & (set(result.failed) | set(result.unresolvable))
    for v, n in zip(views, nodes, strict=True):
        fresh = NOW - v.updated <= CONFIG.report_ttl_s
        room = v.free_bytes + v.evictable_bytes >= weight - min(v.resident_bytes.get("m", 0), weight)
        assert (n in result.passed) == (fresh and room), (n, fresh, room)
        if not fresh:
            assert n in result.unresolvable


def test_a_report_dated_ahead_beyond_the_ttl_is_a_down_pool() -> None:
    """Regression: a report dated in the future (a node clock far ahead) never grew stale, so
    its pool kept passing after it stopped; skew within the TTL is tolerated."""
    skewed = judge(demand(), "a", residency(view("a", age=-5.0)), NOW, CONFIG)
    assert skewed.reason is None
    ahead = judge(demand(), "a", residency(view("a", age=-3600.0)), NOW, CONFIG)
    assert ahead.unresolvable and ahead.reason is not None and "ahead" in ahead.reason


@given(age=st.floats(min_value=0, max_value=100), ttl=st.floats(min_value=0.1, max_value=60))
def test_staleness_is_the_report_ttl(age: float, ttl: float) -> None:
    assume(abs(age - ttl) > 1e-6)
    v = judge(demand(), "a", residency(view("a", age=age)), NOW, PlacementConfig(report_ttl_s=ttl))
    assert (v.reason is None) == (age < ttl)
