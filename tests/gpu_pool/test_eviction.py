"""Stage 1's eviction orders and Eq. 2's prices."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool import _planner
from gpu_pool.planner.eviction import (
    EvictionCandidate,
    EvictionPolicy,
    ModelCostInputs,
    eviction_cost,
    eviction_order,
    mce_ranking,
)

MODELS = {
    "hot": ModelCostInputs(0.9, 1e9, 2.0),
    "warm": ModelCostInputs(0.5, 2e9),
    "cold": ModelCostInputs(0.01, 1e9, 0.5),
}


@st.composite
def candidates(draw: st.DrawFn) -> list[EvictionCandidate]:
    """Candidates with many ties in owners, last use and size (every tie-break is exercised)."""
    owner_sets = [(), ("hot",), ("warm",), ("cold",), ("cold", "hot"), ("unknown",)]
    n = draw(st.integers(0, 200))
    return [
        EvictionCandidate(
            f"k{i}",
            draw(st.sampled_from([256, 512, 4096, 1 << 20])),
            draw(st.sampled_from(owner_sets)),
            draw(st.sampled_from([0.0, 1.5, 2.0, 1e6])),
        )
        for i in range(n)
    ]


@settings(max_examples=300, deadline=None)
@given(candidates())
def test_mce_order_is_numpy_lexsort_of_rate_last_use_and_size(cands: list[EvictionCandidate]) -> None:
    """The C sort against the reference: numpy's stable lexsort of the same three keys."""
    keys = [c.key for c in cands]
    ranking = mce_ranking(
        keys, [c.size for c in cands], [c.model_ids for c in cands], [c.last_used for c in cands], MODELS
    )
    rates = np.array(ranking.per_byte_rates, np.float64)
    sizes = np.array([c.size for c in cands], np.int64)
    last_used = np.array([c.last_used for c in cands], np.float64)
    want = [keys[i] for i in np.lexsort((-sizes, last_used, rates)).tolist()] if cands else []
    assert ranking.order == want
    assert eviction_order(EvictionPolicy.MCE, cands, MODELS) == want


@settings(max_examples=100, deadline=None)
@given(candidates())
def test_prices_are_eq2(cands: list[EvictionCandidate]) -> None:
    ranking = mce_ranking(
        [c.key for c in cands],
        [c.size for c in cands],
        [c.model_ids for c in cands],
        [c.last_used for c in cands],
        MODELS,
    )
    prices = ranking.prices()
    for c in cands:
        by_hand = sum(
            MODELS[m].miss_probability * c.size / MODELS[m].bandwidth * MODELS[m].latency_sensitivity
            for m in c.model_ids
            if m in MODELS
        )
        assert prices[c.key] == eviction_cost(c, MODELS)
        assert math.isclose(prices[c.key], by_hand, rel_tol=1e-12, abs_tol=1e-300)


def test_mce_evicts_cheapest_per_byte_first() -> None:
    cands = [
        EvictionCandidate("hot-big", 1 << 20, ("hot",), 0.0),
        EvictionCandidate("cold-small", 256, ("cold",), 5.0),
        EvictionCandidate("cold-big-old", 1 << 20, ("cold",), 1.0),
        EvictionCandidate("cold-big-new", 1 << 20, ("cold",), 5.0),
        EvictionCandidate("orphan", 512, (), 9.0),
    ]
    assert eviction_order(EvictionPolicy.MCE, cands, MODELS) == [
        "orphan",  # nobody will ask for it: free
        "cold-big-old",  # then the cold model, least recently used first
        "cold-big-new",  # same model and last use: largest first
        "cold-small",
        "hot-big",
    ]


def test_lru_and_random_orders() -> None:
    cands = [EvictionCandidate(f"k{i}", 256, ("hot",), t) for i, t in enumerate([3.0, 1.0, 2.0])]
    assert eviction_order(EvictionPolicy.LRU, cands, {}) == ["k1", "k2", "k0"]
    shuffled = eviction_order(EvictionPolicy.RANDOM, cands, {}, random.Random(7))
    assert sorted(shuffled) == ["k0", "k1", "k2"]
    assert shuffled == eviction_order(EvictionPolicy.RANDOM, list(reversed(cands)), {}, random.Random(7))


def test_mce_order_rejects_bad_columns() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        _planner.mce_order(["a"], [0.0, 1.0], [0.0], [256])
    with pytest.raises(ValueError, match="NaN"):
        _planner.mce_order(["a"], [math.nan], [0.0], [256])
    with pytest.raises(TypeError):
        _planner.mce_order(["a"], ["fast"], [0.0], [256])
