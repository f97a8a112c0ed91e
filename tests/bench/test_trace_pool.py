"""bench.trace_pool: the instance timeline a fixed keep-alive gives, and a quick replay on a real pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.trace_pool import instance_timeline
from bench.workload import Arrival, Trace, TraceConfig

ROOT = Path(__file__).resolve().parents[2]


def trace_of(arrivals: list[tuple[float, int]]) -> Trace:
    config = TraceConfig(num_functions=3, num_requests=len(arrivals), duration_s=100.0)
    return Trace(config, tuple(Arrival(t, f, 8, 2) for t, f in sorted(arrivals)))


def test_a_request_within_the_keep_alive_reuses_the_instance() -> None:
    events = instance_timeline(
        trace_of([(0.0, 0), (2.5, 0), (10.0, 0), (1.0, 1)]), keep_alive_s=2.0, service_s=1.0
    )
    starts = [(e.t_s, e.function) for e in events if e.start]
    ends = [(e.t_s, e.function) for e in events if not e.start]
    # f0: 0.0 starts, 2.5 is within 0 + 1 + 2, 10.0 is past 2.5 + 3 = 5.5: a second start.
    assert starts == [(0.0, 0), (1.0, 1), (10.0, 0)]
    assert ends == [(4.0, 1), (5.5, 0), (13.0, 0)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 100), st.integers(0, 2)), max_size=40), st.floats(0, 5), st.floats(0, 2)
)
def test_every_instance_starts_once_ends_once_and_never_overlaps_its_function(
    arrivals: list[tuple[float, int]], keep_alive: float, service: float
) -> None:
    events = instance_timeline(trace_of(arrivals), keep_alive, service)
    assert [e.t_s for e in events] == sorted(e.t_s for e in events)
    by_instance: dict[int, list[bool]] = {}
    for e in events:
        by_instance.setdefault(e.instance, []).append(e.start)
    assert all(kinds == [True, False] for kinds in by_instance.values())
    alive: dict[int, int] = {}
    for e in events:  # one instance per function at a time
        if e.start:
            assert e.function not in alive
            alive[e.function] = e.instance
        else:
            assert alive.pop(e.function) == e.instance
    assert len({f for _, f in arrivals}) <= sum(e.start for e in events) <= len(arrivals)


@pytest.mark.slow
def test_quick_replay_on_a_real_pool(tmp_path: Path) -> None:
    out = tmp_path / "trace_pool.jsonl"
    args = ["--quick", "--speedup", "20", "--zoo-root", str(tmp_path / "zoo"), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.trace_pool", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(out.read_text())
    assert [(c["policy"], c["capacity"]) for c in line["configs"]] == [("iam", 0.6), ("lru", 0.6)]
    for c in line["configs"]:
        assert c["starts"] + c["refused"] == line["starts"] and c["refused"] == 0
        assert 0.0 <= c["hit_ratio"] <= 1.0 and 0.0 <= c["byte_hit_ratio"] <= 1.0
        assert c["bytes_loaded"] > 0  # the first start of every model loads it
