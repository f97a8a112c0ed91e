"""``bench.trace --quick`` end to end: the CI smoke test of the trace harness (issue 15).

It builds the quick zoo, replays a short trace against two real ``ember serve`` runs (IAM and
LRU at 60 % of the working set) and checks what a broken harness would get wrong: every
arrival sent and answered, one instance start seen per cold start with consistent byte
counts, ratios within their ranges, and the figures drawn from the line it printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.plots import draw
from bench.replay import Replay
from bench.trace import main
from bench.workload import TraceConfig, generate
from bench.zoo import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_trace_replays_every_arrival_and_draws_its_figures(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    out = data / "trace.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.trace",
            "--quick",
            "--zoo-root",
            str(tmp_path / "zoo"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text().splitlines()[-1]) == line
    arrivals = line["trace"]["config"]["num_requests"]
    assert [(c["policy"], c["capacity"]) for c in line["configs"]] == [("iam", 0.6), ("lru", 0.6)]
    for config in line["configs"]:
        assert config["requests"] == arrivals
        assert config["errors"] == 0, config["error_samples"]
        # Every function the trace asks for starts at least once; a start that loads is a miss.
        assert config["cold_starts"] >= sum(1 for n in line["trace"]["summary"]["per_function"] if n)
        assert 0 <= config["loads"] <= config["cold_starts"]
        for key in ("hit_ratio", "request_hit_ratio", "byte_hit_ratio", "slo_attainment"):
            assert 0.0 <= config[key] <= 1.0, key
        assert config["bytes_loaded"] <= config["pool"]["bytes_loaded"]
        assert config["arena_bytes"] <= line["zoo"]["working_set_bytes"]
        assert config["ttft_ms_p50"] <= config["ttft_ms_p99"]
    assert set(line["iam_vs_best"]) == {"0.6"}
    figures = draw(data, tmp_path / "figures")
    assert sorted(p.name for p in figures) == ["trace_policies.png", "trace_slo.png"]
    assert all(p.stat().st_size > 10_000 for p in figures)


@pytest.mark.parametrize(
    "argv",
    [
        ["--requests", "0"],  # used to mean the default (80) silently
        ["--duration", "0"],
        ["--duration", "nan"],
        ["--requests", "-3"],
        ["--capacities", ""],
        ["--capacities", "0.6,"],
        ["--capacities", "0.6,0.6"],
        ["--capacities", "nan"],
        ["--policies", "iam,iam"],
        ["--seed", "-1"],
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv: list[str], tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")  # a zoo build here fails at once: no argument may get that far
    with pytest.raises(SystemExit) as info:
        main([*argv, "--zoo-root", str(not_a_dir)])
    assert info.value.code == 2


@pytest.mark.slow
def test_a_failed_replay_leaves_no_poller_behind(tmp_path: Path) -> None:
    """An error while sending (here: a trace naming more functions than were given) ends the
    replay's /v1/cluster poller too, not only its ember serve."""
    zoo = build(tmp_path / "zoo", "quick")
    trace = generate(TraceConfig(num_functions=2, num_requests=2, duration_s=1.0))

    def pollers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.endswith("(poll)")]

    env = {"EMBER_PREWARM": "0", "EMBER_STANDBY": "0"}
    with Replay(zoo, tmp_path / "home", env, "2s") as replay, pytest.raises(IndexError):
        replay.run(trace, [])
    assert pollers() == []
