"""Demo for scripts/run: register a ~340 MB demo model, acquire it twice from two sessions.

The first session loads every byte from the model store; the second finds everything
resident and loads nothing (the pool kept the tensors after the first session released).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gpu_pool import store
from gpu_pool.client import PoolClient


def demo_tensors() -> dict[str, torch.Tensor]:
    """A Llama-shaped stack of random bfloat16 weights (~340 MB)."""
    g = torch.Generator().manual_seed(0)
    tensors = {"embed_tokens.weight": torch.randn(32000, 1024, generator=g).bfloat16()}
    for layer in range(12):
        p = f"layers.{layer}."
        for name, shape in (
            ("q_proj", (1024, 1024)),
            ("k_proj", (256, 1024)),
            ("v_proj", (256, 1024)),
            ("o_proj", (1024, 1024)),
            ("gate_proj", (2816, 1024)),
            ("up_proj", (2816, 1024)),
            ("down_proj", (1024, 2816)),
        ):
            tensors[p + name + ".weight"] = torch.randn(*shape, generator=g).bfloat16()
        tensors[p + "input_layernorm.weight"] = torch.ones(1024).bfloat16()
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--store", required=True, type=Path)
    args = parser.parse_args()
    entry = args.store / "demo-llama"
    manifest = (
        store.read(entry) if entry.exists() else store.write(entry, demo_tensors(), model_id="demo-llama")
    )
    print(f"model demo-llama: {len(manifest.tensors)} tensors, {manifest.nbytes / 1e6:.0f} MB")
    for attempt in ("first instance", "second instance"):
        t0 = time.perf_counter()
        with PoolClient(args.socket) as client:
            tensors = client.acquire(manifest)
            report = client.last_acquire
            assert report is not None
            ms = (time.perf_counter() - t0) * 1e3
            print(
                f"{attempt}: acquire {ms:.1f} ms, loaded {report.bytes_loaded / 1e6:.0f} MB, "
                f"reused {report.bytes_reused / 1e6:.0f} MB, {len(tensors)} tensor views"
            )


if __name__ == "__main__":
    main()
