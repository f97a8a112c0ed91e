"""bench.idle_wake: one JSON line with the back-to-back baseline and one row per idle gap."""

from __future__ import annotations

import json
import subprocess
import sys


def test_prints_one_row_per_gap_with_the_baseline_measured_in_the_same_run() -> None:
    args = ["--layers", "2", "--dim", "64", "--threads", "1", "--samples", "2", "--gaps", "0.01,0.02"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.idle_wake", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (line,) = done.stdout.splitlines()
    out = json.loads(line)
    assert out["bench"] == "idle_wake"
    assert [row["gap_s"] for row in out["by_gap"]] == [0.0, 0.01, 0.02]  # the baseline added first
    baseline = out["by_gap"][0]
    assert baseline["first_over_back_to_back"] == 1.0
    assert baseline["first_ms_p50"] == out["back_to_back_ms_p50"] > 0
    assert all(row["first_ms_p50"] > 0 and row["first_over_back_to_back"] > 0 for row in out["by_gap"])


def test_refuses_negative_gaps() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.idle_wake", "--gaps", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "gaps >= 0" in done.stderr
