"""bench.mesh's load and its capacity figure."""

from __future__ import annotations

from bench.mesh import OUTPUT_TOKENS, capacity, poisson_trace


def test_poisson_load_has_its_rate_and_zipf_popularity() -> None:
    trace = poisson_trace(rate=4.0, duration_s=500.0, num_functions=4, seed=3)
    n = len(trace.arrivals)
    assert 1800 < n < 2200  # 4/s for 500 s
    times = [a.t_s for a in trace.arrivals]
    assert times == sorted(times) and times[-1] < 500.0
    counts = [sum(a.function == i for a in trace.arrivals) for i in range(4)]
    assert counts == sorted(counts, reverse=True)  # 1 : 1/2 : 1/3 : 1/4
    assert all(a.max_tokens == OUTPUT_TOKENS for a in trace.arrivals)
    assert poisson_trace(4.0, 50.0, 4, seed=3) == poisson_trace(4.0, 50.0, 4, seed=3)


def test_capacity_is_the_last_rate_meeting_the_target_interpolated() -> None:
    points = [
        {"rate": 1.0, "slo_attainment": 1.0},
        {"rate": 2.0, "slo_attainment": 0.95},
        {"rate": 3.0, "slo_attainment": 0.85},
    ]
    assert capacity(points, 0.9) == 2.5  # halfway from 0.95 to 0.85
    assert capacity(points[:2], 0.9) == 2.0  # never below the target: the last rate
    assert capacity([{"rate": 1.0, "slo_attainment": 0.5}], 0.9) == 0.0
