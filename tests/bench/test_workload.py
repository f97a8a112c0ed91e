"""The trace generator: deterministic, bounded, and shaped as its docstring says."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.workload import (
    TRACE_VERSION,
    Locality,
    Trace,
    TraceConfig,
    consecutive_share,
    generate,
    locality_arrivals,
    locality_sequence,
    summary,
    zipf_counts,
)

CONFIG = TraceConfig(num_functions=40, num_requests=3000, duration_s=600.0, time_scale=24.0, seed=7)

configs = st.builds(
    TraceConfig,
    num_functions=st.integers(1, 60),
    num_requests=st.integers(0, 800),
    duration_s=st.floats(1.0, 1e5),
    zipf_s=st.floats(0.0, 3.0),
    burst_cv=st.floats(0.1, 6.0),
    prompt_tokens=st.tuples(st.integers(1, 64), st.integers(64, 512)),
    max_tokens=st.tuples(st.integers(1, 8), st.integers(8, 64)),
    seed=st.integers(0, 2**32),
)


def test_same_config_same_trace_and_seed_matters() -> None:
    assert generate(CONFIG) == generate(CONFIG)
    assert generate(CONFIG) != generate(dataclasses.replace(CONFIG, seed=8))


@settings(max_examples=60, deadline=None)
@given(configs)
def test_sorted_counted_and_bounded(config: TraceConfig) -> None:
    trace = generate(config)
    assert len(trace.arrivals) == config.num_requests
    times = [a.t_s for a in trace.arrivals]
    assert times == sorted(times)
    for a in trace.arrivals:
        assert 0.0 <= a.t_s < config.duration_s
        assert 0 <= a.function < config.num_functions
        assert config.prompt_tokens[0] <= a.prompt_tokens <= config.prompt_tokens[1]
        assert config.max_tokens[0] <= a.max_tokens <= config.max_tokens[1]
    counts = summary(trace)["per_function"]
    assert sum(counts) == config.num_requests
    assert counts == sorted(counts, reverse=True)  # function 0 is the most popular
    assert Trace.from_json(trace.to_json()) == trace


@given(st.integers(0, 10_000), st.integers(1, 200), st.floats(0.0, 4.0))
def test_zipf_counts_exact_and_non_increasing(total: int, n: int, s: float) -> None:
    counts = zipf_counts(total, n, s)
    assert sum(counts) == total and len(counts) == n
    assert counts == sorted(counts, reverse=True)


def test_popularity_skew_top_functions_dominate() -> None:
    s = summary(generate(CONFIG))
    assert s["top20_share"] > 0.75  # 8 of 40 functions carry most requests
    flat = summary(generate(dataclasses.replace(CONFIG, zipf_s=0.0)))
    assert flat["top20_share"] == pytest.approx(0.2, abs=0.01)


def test_bursty_arrivals_and_idle_gaps_beyond_keep_alive() -> None:
    s = summary(generate(CONFIG))
    assert s["iat_cv_median"] > 1.2  # burst_cv 2: bursty, not Poisson
    assert s["replay_keep_alive_s"] == pytest.approx(1200 / 24)
    assert s["gaps_over_keep_alive"] > 0.0 and s["max_gap_s"] > 3 * s["replay_keep_alive_s"]
    assert s["cold_starts"] > CONFIG.num_functions  # functions go cold again after their first request
    calm = summary(generate(dataclasses.replace(CONFIG, burst_cv=0.3)))
    assert calm["iat_cv_median"] < 0.6


def test_time_scale_keeps_gaps_relative_to_keep_alive() -> None:
    """The same trace compressed 60x more replays 60x faster; gaps keep their relation to
    the (scaled) keep-alive."""
    slow = dataclasses.replace(CONFIG, duration_s=36_000.0, time_scale=1.0)
    fast = dataclasses.replace(CONFIG, duration_s=600.0, time_scale=60.0)
    a, b = summary(generate(slow)), summary(generate(fast))
    assert a["gaps_over_keep_alive"] == pytest.approx(b["gaps_over_keep_alive"])
    assert a["le_once_per_minute"] == b["le_once_per_minute"]
    assert b["replay_keep_alive_s"] == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_functions", 0),
        ("num_requests", -1),
        ("num_requests", 10**7),
        ("duration_s", float("nan")),
        ("duration_s", 0.0),
        ("zipf_s", -0.1),
        ("burst_cv", 0.0),
        ("prompt_tokens", (64, 16)),
        ("prompt_tokens", (0, 16)),
        ("max_tokens", (1, 10**6)),
        ("seed", -1),
        ("num_functions", True),
        ("time_scale", 0.0),
    ],
)
def test_config_refuses_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CONFIG, **{field: value})


def test_from_json_refuses_bad_traces() -> None:
    good = json.loads(generate(dataclasses.replace(CONFIG, num_requests=3)).to_json())
    assert good["v"] == TRACE_VERSION
    bad_version = {**good, "v": 2}
    unsorted = {**good, "arrivals": list(reversed(good["arrivals"]))}
    out_of_range = {**good, "arrivals": [[0.0, 99, 16, 4], *good["arrivals"][1:]]}
    short = {**good, "arrivals": good["arrivals"][:2]}
    extra = {**good, "extra": 1}
    for data in (bad_version, unsorted, out_of_range, short, extra):
        with pytest.raises(ValueError):
            Trace.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="nested too deeply"):  # not RecursionError
        Trace.from_json("[" * 200_000)
    with pytest.raises(ValueError):  # not a JSON document at all (JSONDecodeError is one)
        Trace.from_json("{")


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(0, 400), st.integers(0, 2**32))
def test_locality_levels_order_consecutive_runs(num_models: int, length: int, seed: int) -> None:
    seqs = {level: locality_sequence(num_models, level, length, seed) for level in Locality}
    for seq in seqs.values():
        assert len(seq) == length and all(0 <= m < num_models for m in seq)
    shares = [consecutive_share(seqs[level]) for level in Locality]
    assert shares[0] == 0.0  # L1: no request repeats the previous model
    assert shares[0] <= shares[1] <= shares[2] == shares[3]
    assert locality_sequence(num_models, Locality.L3, length, seed) == seqs[Locality.L3]


def test_locality_levels_strictly_ordered_on_a_long_sequence() -> None:
    shares = [consecutive_share(locality_sequence(8, level, 2000, seed=1)) for level in Locality]
    assert shares[0] == 0.0 < shares[1] < shares[2]
    assert shares[2] > 0.5  # most requests follow one to the same model (Tangram Fig. 4a)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32))
def test_locality_arrival_cv_ordered(seed: int) -> None:
    cvs = []
    for level in Locality:
        gaps = np.diff([0.0, *locality_arrivals(level, 3000, 2.0, seed)])
        assert gaps.mean() == pytest.approx(2.0, rel=0.25)
        cvs.append(gaps.std() / gaps.mean())
    assert cvs == sorted(cvs) and cvs[0] < 0.35 and cvs[3] > 1.4


def test_l1_needs_two_models() -> None:
    with pytest.raises(ValueError, match="two models"):
        locality_sequence(1, Locality.L1, 5)
    assert locality_sequence(1, Locality.L4, 5) == [0] * 5
