"""Model importance policies (mCache's IAM and the LRU/LFU/ARC/SRRIP baselines): property tests
of what every policy guarantees, and of Eq. 1 / Eq. 2."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool.planner.importance import (
    AdaptiveReplacement,
    ImportanceAware,
    ImportancePolicy,
    LeastFrequentlyUsed,
    LeastRecentlyUsed,
    StaticRRIP,
    new_importance,
    ranks,
    utility,
)

MODELS = [f"m{i}" for i in range(6)]
SIZES = {m: (i + 1) * 100 for i, m in enumerate(MODELS)}
PENALTIES = {m: 0.5 + i for i, m in enumerate(MODELS)}

# A trace: (model index, evict-it-afterwards) per step, one second apart.
traces = st.lists(st.tuples(st.integers(0, len(MODELS) - 1), st.booleans()), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(trace=traces, policy=st.sampled_from(list(ImportancePolicy)))
def test_every_policy_orders_exactly_the_cached_models_and_scores_them_in_0_1(
    trace: list[tuple[int, bool]], policy: ImportancePolicy
) -> None:
    imp = new_importance(policy)
    cached: set[str] = set()
    for t, (i, evict) in enumerate(trace):
        m = MODELS[i]
        imp.access(m, float(t), SIZES[m], PENALTIES[m])
        cached.add(m)
        if evict:
            victim = imp.victims(float(t))[0]
            imp.evicted(victim)
            cached.discard(victim)
        order = imp.victims(float(t))
        assert sorted(order) == sorted(cached)
        scores = [imp.importance(x, float(t)) for x in order]
        assert all(0.0 <= s <= 1.0 for s in scores)
        assert scores == sorted(scores)  # the first victim is the least important
        assert imp.importance("never-seen", float(t)) == 0.0


@given(st.dictionaries(st.sampled_from(MODELS), st.floats(0, 1e6), min_size=1))
def test_eq2_ranks_follow_utilities(utilities: dict[str, float]) -> None:
    r = ranks(utilities, b0=1.0)
    for a, ua in utilities.items():
        below = sum(ua > ub for b, ub in utilities.items() if b != a)
        assert r[a] == pytest.approx(math.log(below + 1.0))
        for b, ub in utilities.items():
            assert (r[a] > r[b]) == (ua > ub)


def test_eq1_utility_is_penalty_per_byte_over_the_time_to_the_next_request() -> None:
    assert utility(2.0, 100, 0.5) == pytest.approx(2.0 / 100 / (1 / 0.5))
    assert utility(2.0, 100, 0.0) == 0.0  # never requested: never worth keeping over another


def test_iam_keeps_a_costly_popular_small_model_over_a_cheap_rare_large_one() -> None:
    imp = ImportanceAware(update_s=1e-9)
    for t in range(10):  # "hot": small, slow to load, requested every second
        imp.access("hot", float(t), 100, 5.0)
    imp.access("cold", 10.0, 10_000, 0.1)  # large, quick to load, requested once
    assert imp.victims(11.0) == ["cold", "hot"]


def test_iam_ranks_are_updated_periodically_from_a_shadow_copy() -> None:
    imp = ImportanceAware(update_s=100.0)
    imp.access("a", 0.0, 100, 1.0)
    imp.access("b", 0.0, 100, 1.0)
    first = imp.victims(1.0)  # built now
    for t in range(2, 30):  # b becomes far more popular, but the queue is read-only till the update
        imp.access("b", float(t), 100, 1.0)
    assert imp.victims(30.0) == first
    assert imp.victims(101.5) == ["a", "b"]  # the rebuilt queue: b is the more important


def test_baselines_follow_their_definitions() -> None:
    lru = LeastRecentlyUsed()
    for t, m in enumerate(["a", "b", "a"]):
        lru.access(m, float(t), 1, 1.0)
    assert lru.victims(3.0) == ["b", "a"]

    lfu = LeastFrequentlyUsed()
    for t, m in enumerate(["a", "a", "b", "c", "c", "c"]):
        lfu.access(m, float(t), 1, 1.0)
    assert lfu.victims(6.0) == ["b", "a", "c"]

    srrip = StaticRRIP()
    for t, m in enumerate(["a", "b", "a"]):  # a is re-referenced: near-immediate
        srrip.access(m, float(t), 1, 1.0)
    assert srrip.victims(3.0) == ["b", "a"]

    arc = AdaptiveReplacement()
    for t, m in enumerate(["a", "b", "b", "c"]):  # b is frequent (T2); a, c recent once (T1)
        arc.access(m, float(t), 10, 1.0)
    assert arc.victims(4.0) == ["a", "c", "b"]
    arc.evicted("a")  # to the B1 ghost list; asking for it again grows T1's target
    arc.access("a", 5.0, 10, 1.0)  # and it comes back into T2 (most recent)
    # T1 (c, 10 bytes) is within its target now: ARC replaces from T2 first.
    assert arc.p == 10.0 and arc.victims(6.0) == ["b", "a", "c"]


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        ImportanceAware(update_s=0.0)
    with pytest.raises(ValueError):
        StaticRRIP(bits=0)
    with pytest.raises(ValueError):
        ImportanceAware().access("a", 0.0, -1, 1.0)


def test_the_policy_is_a_pool_setting() -> None:
    from gpu_pool.config import PoolConfig
    from gpu_pool.errors import ConfigError

    base = {"EMBER_POOL_DEVICE": "cpu", "EMBER_POOL_ARENA": "16MiB", "EMBER_POOL_SOCKET": "/tmp/p.sock"}
    assert PoolConfig.from_env(base).importance is None
    config = PoolConfig.from_env({**base, "EMBER_POOL_IMPORTANCE": "IAM"})
    assert config.importance is ImportancePolicy.IAM
    with pytest.raises(ConfigError, match="EMBER_POOL_IMPORTANCE"):
        PoolConfig.from_env({**base, "EMBER_POOL_IMPORTANCE": "mru"})
