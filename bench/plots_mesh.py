"""Figures of issue 16's benchmarks for :mod:`bench.plots`: LLM-Mesh capacity (``bench.mesh``),
TIDAL's overlapped loading (``bench.overlap``) and per-request LoRA (``bench.lora``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from bench.figure_file import save

CONFIG_STYLE = {
    "colocated": ("#d62728", "co-located, token-level"),
    "exclusive": ("#1f77b4", "one per device"),
}
MiB = 1 << 20


def plot_mesh(data: dict[str, Any], out: Path) -> list[Path]:
    """SLO attainment against request rate per configuration, capacity marked."""
    fig, ax = plt.subplots(figsize=(6, 4))
    target = data["attainment_target"]
    for name, points in data["sweeps"].items():
        color, label = CONFIG_STYLE.get(name, ("#7f7f7f", name))
        rates = [p["rate"] for p in points]
        ax.plot(rates, [p["slo_attainment"] for p in points], "o-", color=color, label=label)
        cap = data["capacity_rps"].get(name)
        if cap:
            ax.axvline(cap, color=color, linestyle=":", linewidth=1)
    ax.axhline(target, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ratio = data.get("capacity_ratio")
    title = f"{len(data['functions'])} functions on one CPU device"
    ax.set_title(title + (f": capacity x{ratio:.2f}" if ratio is not None else ""))
    ax.legend(fontsize=8)
    return [save(fig, out / "mesh_capacity.png")]


def plot_overlap(data: dict[str, Any], out: Path) -> list[Path]:
    """Left: cold-start TTFT of an evicted model at the acceptance prompt length, overlapped vs
    load-then-compute, with Eq. 1's bound. Right: the ratio over the prompt-length sweep."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["load alone", "prefill alone", "load, then\ncompute", "overlapped\n(TIDAL)"]
    values = [
        data["load_s_p50"],
        data["prefill_s_p50"],
        data["ttft_sequential_s_p50"],
        data["ttft_overlapped_s_p50"],
    ]
    left.bar(range(4), values, color=["#7f7f7f", "#7f7f7f", "#1f77b4", "#d62728"])
    eq1 = "Eq. 1: max(load, prefill)"
    left.axhline(data["eq1_overlapped_s"], color="black", linestyle=":", linewidth=0.8, label=eq1)
    left.set_xticks(range(4), labels, fontsize=8)
    left.set_ylabel("seconds (p50)")
    gib = data["model_bytes"] / (1 << 30)
    tokens = data["acceptance_prompt_tokens"]
    left.set_title(f"{gib:.2f} GiB model, {tokens}-token prompt: ratio {data['ttft_ratio']:.2f}", fontsize=9)
    left.legend(fontsize=8)
    sweep = data["sweep"]
    lengths = [r["prompt_tokens"] for r in sweep]
    right.plot(lengths, [r["ttft_ratio"] for r in sweep], "o-", color="#d62728", label="measured")
    eq1_ratios = [r["eq1_ratio"] for r in sweep]
    right.plot(lengths, eq1_ratios, "s:", color="black", label="Eq. 1 from load, prefill")
    right.axhline(data["target_ratio"], color="#7f7f7f", linestyle="--", linewidth=0.8, label="target")
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(n) for n in lengths])
    right.set_xlabel("prompt tokens")
    right.set_ylabel("TTFT overlapped / load-then-compute")
    right.set_ylim(0, 1.1)
    direct = "on" if data.get("direct_reads") else "off"
    right.set_title(f"page cache {data['page_cache']}, direct reads {direct}", fontsize=9)
    right.legend(fontsize=8)
    return [save(fig, out / "tidal_overlap.png")]


def plot_lora(data: dict[str, Any], out: Path) -> list[Path]:
    """Warm TTFT without an adapter, with one, and switching per request; resident bytes."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    modes = ("none", "same", "alternating")
    ttft = data["ttft_ms"]
    left.bar(range(3), [ttft[m]["p50"] for m in modes], color=["#7f7f7f", "#1f77b4", "#d62728"])
    left.set_xticks(range(3), ["no adapter", "same adapter", "switching\nper request"], fontsize=8)
    left.set_ylabel("warm TTFT p50 (ms)")
    left.set_title(f"switching costs x{data['switch_over_same']:.3f}")
    res = data["residency"]
    right.bar(
        range(2),
        [res["resident_bytes"] / MiB, res["base_plus_adapters"] / MiB],
        color=["#d62728", "#7f7f7f"],
    )
    right.set_xticks(range(2), ["resident in the pool", "base + adapters"], fontsize=8)
    right.set_ylabel("MiB")
    right.set_title("one base, per-function adapters")
    return [save(fig, out / "tidal_lora.png")]
