"""Figures from the benchmarks' JSON lines: ``python -m bench.plots [--data DIR] [--out DIR]``.

Reads the newest line of each benchmark's file under ``--data`` (default
``docs/figures/data``, written by ``scripts/figures``) and draws PNGs under ``--out``
(default ``docs/figures``), one per reproduced experiment:

* ``trace.jsonl`` (``bench.trace``): ``trace_policies.png`` (mCache Table 3 / Fig. 9 on Ember:
  hit ratio, mean start time, TTFT p99 and throughput per policy and capacity) and
  ``trace_slo.png`` (cold-start rate and SLO attainment per configuration);
* ``trace_pool.jsonl`` (``bench.trace_pool``): ``trace_pool_hits.png``, the same policies and
  capacities under one fixed sequence of instance starts on the pool alone;
* ``tangram_fig10.jsonl`` (``bench.tangram --figure 10``): ``tangram_fig10.png``, the
  Compute / Merge / Load breakdown per loading policy;
* ``tangram_fig12.jsonl`` (``bench.tangram --figure 12``): ``tangram_fig12.png``, load time
  relative to no reuse per locality level and batch size;
* ``zoo_dedup.jsonl`` (``bench.zoo --dedup``): ``zoo_dedup.png``, resident bytes of a base and
  its fine-tuned variants against base + differing tensors;
* ``mesh.jsonl`` (``bench.mesh``): ``mesh_capacity.png``, SLO attainment against request rate,
  co-located with token-level scheduling vs one instance per device (LLM-Mesh);
* ``overlap.jsonl`` (``bench.overlap``): ``tidal_overlap.png``, an evicted model's cold start
  overlapped with its loading vs load-then-compute (TIDAL Eq. 1);
* ``lora.jsonl`` (``bench.lora``): ``tidal_lora.png``, TTFT with per-request adapters and the
  pool's resident bytes against base + adapters.

A missing file skips its figures (said on stderr); a file whose lines are not the expected
benchmark's fails loudly. Rendering uses the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import plots_mesh, plots_tangram
from bench.figure_file import save

MiB = 1 << 20
POLICY_COLORS = {"iam": "#d62728", "lru": "#1f77b4", "lfu": "#2ca02c", "arc": "#9467bd", "srrip": "#ff7f0e"}


def newest(path: Path, bench: str) -> dict[str, Any] | None:
    """The last JSON line of ``path`` (None if the file is missing); it must be ``bench``'s."""
    if not path.is_file():
        print(f"plots: {path} not found, skipping its figures", file=sys.stderr)
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no JSON line")
    data: dict[str, Any] = json.loads(lines[-1])
    if data.get("bench") != bench:
        raise ValueError(f"{path}: expected a {bench!r} line, got {data.get('bench')!r}")
    return data


def _grouped(ax: Any, configs: list[dict[str, Any]], key: str, scale: float = 1.0) -> None:
    """Bars of ``key`` per capacity (groups) and policy (bars)."""
    capacities = sorted({c["capacity"] for c in configs})
    policies = [p for p in POLICY_COLORS if any(c["policy"] == p for c in configs)]
    width = 0.8 / max(1, len(policies))
    for j, policy in enumerate(policies):
        xs, ys = [], []
        for i, capacity in enumerate(capacities):
            match = [c for c in configs if c["policy"] == policy and c["capacity"] == capacity]
            if match and match[0].get(key) is not None:
                xs.append(i + (j - (len(policies) - 1) / 2) * width)
                ys.append(match[0][key] * scale)
        ax.bar(xs, ys, width, label=policy.upper(), color=POLICY_COLORS[policy])
    ax.set_xticks(range(len(capacities)), [f"{round(c * 100)} %" for c in capacities])
    ax.set_xlabel("arena / working set")


def plot_trace(data: dict[str, Any], out: Path) -> list[Path]:
    """mCache's policy comparison on Ember, and cold starts / SLO per configuration."""
    configs = data["configs"]
    ws = data["zoo"]["working_set_bytes"] / MiB
    title = (
        f"{len(data['zoo']['models'])} functions, working set {ws:.0f} MiB, {configs[0]['requests']} requests"
    )
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("hit_ratio", 1.0, "cold starts with the model resident"),
        ("load_ms_mean", 1.0, "mean instance start (ms)"),
        ("ttft_ms_p99", 1e-3, "TTFT p99 (s)"),
        ("throughput_rps", 1.0, "throughput (requests/s)"),
    ]
    for ax, (key, scale, label) in zip(axes.flat, panels, strict=True):
        _grouped(ax, configs, key, scale)
        ax.set_ylabel(label)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Model-importance policies on ember serve ({title})")
    first = save(fig, out / "trace_policies.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (key, label) in zip(
        axes,
        [("cold_start_rate", "instance starts per request"), ("slo_attainment", "requests within the SLO")],
        strict=True,
    ):
        _grouped(ax, configs, key)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("Cold-start rate and SLO attainment per configuration")
    second = save(fig, out / "trace_slo.png")
    return [first, second]


def plot_trace_pool(data: dict[str, Any], out: Path) -> list[Path]:
    """The policies under one fixed acquire sequence (bench.trace_pool): hit ratios and bytes."""
    configs = data["configs"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("hit_ratio", 1.0, "starts with the model resident"),
        ("byte_hit_ratio", 1.0, "bytes reused / bytes needed"),
        ("bytes_loaded", 1 / MiB / 1024, "GiB loaded"),
    ]
    for ax, (key, scale, label) in zip(axes, panels, strict=True):
        _grouped(ax, configs, key, scale)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Policies on the pool alone, one sequence of {data['starts']} instance starts from the same trace"
    )
    return [save(fig, out / "trace_pool_hits.png")]


FIGURES: dict[str, tuple[str, Callable[[dict[str, Any], Path], list[Path]]]] = {
    "trace.jsonl": ("trace", plot_trace),
    "trace_pool.jsonl": ("trace_pool", plot_trace_pool),
    "tangram_fig10.jsonl": ("tangram", plots_tangram.plot_fig10),
    "tangram_fig12.jsonl": ("tangram", plots_tangram.plot_fig12),
    "zoo_dedup.jsonl": ("zoo", plots_tangram.plot_dedup),
    "mesh.jsonl": ("mesh", plots_mesh.plot_mesh),
    "overlap.jsonl": ("overlap", plots_mesh.plot_overlap),
    "lora.jsonl": ("lora", plots_mesh.plot_lora),
}


def draw(data_dir: Path, out_dir: Path) -> list[Path]:
    """Every figure whose data file exists; returns the PNGs written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, (bench, plot) in FIGURES.items():
        data = newest(data_dir / name, bench)
        if data is not None:
            written += plot(data, out_dir)
    return written


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description="Draw docs/figures/ from the benchmarks' JSON lines.")
    parser.add_argument("--data", type=Path, default=root / "docs" / "figures" / "data")
    parser.add_argument("--out", type=Path, default=root / "docs" / "figures")
    args = parser.parse_args()
    for path in draw(args.data, args.out):
        print(path)


if __name__ == "__main__":
    main()
