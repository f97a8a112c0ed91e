"""Tangram Fig. 10 / 12 on a real pool daemon, at the ``--quick`` size (a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.tangram import POLICIES, run

ROOT = Path(__file__).resolve().parents[2]


def test_figure10_breaks_loading_down_per_policy() -> None:
    out = run(10, quick=True)
    policies = out["policies"]
    assert set(policies) == set(POLICIES)
    for name, families in policies.items():
        for family in ("small", "large", "all"):
            part = families[family]
            assert {"compute_ms", "merge_ms", "load_ms", "bytes_loaded", "bytes_moved"} <= set(part)
        whole = families["all"]
        assert whole["requests"] == out["requests_per_run"]
        assert whole["bytes_moved"] > 0 or whole["merge_ms"] == 0.0, name  # Merge is moving
    sllm = policies["sllm"]["all"]
    assert sllm["bytes_reused"] == 0 and sllm["bytes_moved"] == 0  # SLLM reuses nothing
    for name in ("rand_gm", "mce_gm", "mce_pgp"):
        part = policies[name]["all"]
        assert part["bytes_reused"] > 0 and part["bytes_loaded"] < sllm["bytes_loaded"], name
        assert part["bytes_loaded"] + part["bytes_reused"] == sllm["bytes_loaded"], name
    assert out["arena_bytes"] < out["working_set_bytes"]
    assert set(out["load_vs_sllm"]) == {"rand_gm", "mce_gm", "mce_pgp"}


def test_figure12_reuse_falls_with_locality_and_batch() -> None:
    out = run(12, quick=True)
    cells = {(c["locality"], c["batch"]): c for c in out["cells"]}
    assert set(cells) == {("L1", 1), ("L1", 64), ("L4", 1), ("L4", 64)}
    for cell in cells.values():
        assert cell["mce_pgp"]["bytes_loaded"] <= cell["sllm"]["bytes_loaded"]
    # The strongest locality and smallest batch reuse the most; batch 64's KV takes room.
    assert cells[("L4", 1)]["bytes_loaded_vs_sllm"] < cells[("L1", 1)]["bytes_loaded_vs_sllm"]
    assert cells[("L1", 1)]["bytes_loaded_vs_sllm"] <= cells[("L1", 64)]["bytes_loaded_vs_sllm"]
    assert out["pass"]


def test_cli_prints_one_json_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.tangram", "--figure", "10", "--quick"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["figure"] == 10
