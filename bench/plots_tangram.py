"""Figures of the pool benchmarks for :mod:`bench.plots`: Tangram Fig. 10 and Fig. 12a as
``bench.tangram`` measured them, and the fine-tune dedup of ``bench.zoo --dedup``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from bench.figure_file import save

MiB = 1 << 20
PARTS = (
    ("compute_ms", "Compute", "#7f7f7f"),
    ("merge_ms", "Merge", "#ff7f0e"),
    ("load_ms", "Load", "#1f77b4"),
)
POLICY_LABELS = {
    "sllm": "no reuse\n(SLLM)",
    "rand_gm": "Rand+GM",
    "mce_gm": "MCE+GM",
    "mce_pgp": "MCE+PGP\n(Tangram)",
}


def plot_fig10(data: dict[str, Any], out: Path) -> list[Path]:
    """Stacked Compute / Merge / Load per loading policy, one panel per model family."""
    if data.get("figure") != 10:
        raise ValueError("tangram_fig10.jsonl: expected a figure 10 line")
    policies = [p for p in POLICY_LABELS if p in data["policies"]]
    families = [f for f in ("small", "large") if data["policies"][policies[0]].get(f, {}).get("requests")]
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 4), squeeze=False)
    for ax, family in zip(axes[0], families, strict=True):
        bottom = [0.0] * len(policies)
        for key, label, color in PARTS:
            values = [data["policies"][p][family][key] for p in policies]
            ax.bar(range(len(policies)), values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(range(len(policies)), [POLICY_LABELS[p] for p in policies], fontsize=8)
        ax.set_ylabel("ms per request (mean)")
        ax.set_title(f"{family} models")
    axes[0][0].legend(fontsize=8)
    reduction = data.get("merge_reduction_pgp_vs_gm")
    note = f"; merge -{reduction:.0%} PGP vs GM" if reduction is not None else ""
    fig.suptitle(
        f"Loading policies, {data['requests_per_run']} requests at locality {data['locality']}{note}"
    )
    return [save(fig, out / "tangram_fig10.png")]


def plot_fig12(data: dict[str, Any], out: Path) -> list[Path]:
    """Load time and bytes relative to no reuse, per locality (groups) and batch (bars)."""
    if data.get("figure") != 12:
        raise ValueError("tangram_fig12.jsonl: expected a figure 12 line")
    cells = data["cells"]
    levels = list(dict.fromkeys(c["locality"] for c in cells))
    batches = sorted({c["batch"] for c in cells})
    width = 0.8 / len(batches)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in zip(
        axes,
        ("load_vs_sllm", "bytes_loaded_vs_sllm"),
        ("load time / no reuse", "bytes loaded / no reuse"),
        strict=True,
    ):
        for j, batch in enumerate(batches):
            xs, ys = [], []
            for i, level in enumerate(levels):
                match = [c for c in cells if c["locality"] == level and c["batch"] == batch]
                if match and match[0][key] is not None:
                    xs.append(i + (j - (len(batches) - 1) / 2) * width)
                    ys.append(match[0][key])
            ax.bar(xs, ys, width, label=f"batch {batch}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(levels)), levels)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("Tangram (MCE+PGP) against no reuse by workload locality and batch size")
    return [save(fig, out / "tangram_fig12.png")]


def plot_dedup(data: dict[str, Any], out: Path) -> list[Path]:
    """Resident bytes after each acquire of a base and its fine-tunes: measured, expected
    (base + differing tensors) and what separate copies would take."""
    reports = data.get("dedup") or []
    if not reports:
        raise ValueError("zoo_dedup.jsonl: the line has no dedup measurement (run bench.zoo --dedup)")
    report = reports[0]
    steps = [
        {
            "model": report["base"],
            "resident_bytes": report["base_bytes"],
            "expected_bytes": report["base_bytes"],
        }
    ]
    steps += report["variants"]
    labels = [s["model"] if i == 0 else f"+ {s['model']}" for i, s in enumerate(steps)]
    separate = [report["base_bytes"] * (i + 1) / MiB for i in range(len(steps))]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(steps))
    ax.bar(
        [x - 0.2 for x in xs], [s["resident_bytes"] / MiB for s in steps], 0.4, label="resident (measured)"
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [s["expected_bytes"] / MiB for s in steps],
        0.4,
        label="base + differing tensors",
    )
    ax.plot(list(xs), separate, "k--", marker="o", label="separate copies")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("MiB in the pool")
    ax.legend(fontsize=8)
    ax.set_title("Fine-tuned variants share their base's tensors (dedup by fingerprint)")
    return [save(fig, out / "zoo_dedup.png")]
