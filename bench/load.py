"""Load bandwidth: a 1 GiB missing manifest into a CPU arena vs a plain memcpy of the same bytes.

Both sides copy the same 1 GiB: the baseline is one ``numpy.copyto`` (a plain memcpy) from
an in-memory buffer into a pre-touched buffer; the pool reads the model-store file (warm in
the page cache, as a host model cache would be) into a pre-faulted arena through
:meth:`ReuseStore.acquire` (planning, grouped parallel ``preadv`` copies, bookkeeping).
Target: pool bandwidth >= 0.8 x memcpy. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpu_pool import store
from gpu_pool.arena.cpu import CpuArena
from gpu_pool.manifest import Manifest
from gpu_pool.server.reuse_store import ReuseStore


def make_model(root: Path, total_bytes: int) -> Manifest:
    """A store entry of ~``total_bytes`` in Llama-like tensors (bf16), random contents."""
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    hidden, inter = 2048, 5632
    layer_shapes = [
        (hidden, hidden),
        (512, hidden),
        (512, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
        (hidden,),
        (hidden,),
    ]
    layer = 0
    size = 0
    while size < total_bytes:
        for j, shape in enumerate(layer_shapes):
            t = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
            tensors[f"layers.{layer}.w{j}"] = t
            size += t.numel() * 2
        layer += 1
    return store.write(root / "model-1g", tensors, model_id="model-1g")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="manifest size in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="ember-bench-load-") as tmp:
        manifest = make_model(Path(tmp), total)
        nbytes = manifest.nbytes
        file = manifest.tensors[0].file
        # Warm the page cache and hold the same bytes in memory for the memcpy baseline.
        src = np.fromfile(file, dtype=np.uint8)
        dst = np.ones_like(src)
        memcpy = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            memcpy.append(src.nbytes / (time.perf_counter() - t0))
        memcpy_bw = statistics.median(memcpy)
        del dst

        arena = CpuArena(((nbytes * 5 // 4) >> 21 << 21) + (64 << 20), prefault=True)
        try:
            pool = ReuseStore(arena)
            pool.open_session("bench")
            runs = []
            for _ in range(args.repeats):
                result = pool.acquire("bench", manifest)
                assert result.bytes_loaded == nbytes
                runs.append(result)
                pool.release("bench")
                pool.evict()
            total_s = [r.load_seconds + r.plan_seconds for r in runs]
            pool_bw = nbytes / statistics.median(total_s)
            copy_bw = statistics.median(r.load_bandwidth for r in runs)
        finally:
            arena.close()
    ratio = pool_bw / memcpy_bw
    print(
        json.dumps(
            {
                "bench": "load",
                "bytes": nbytes,
                "num_tensors": len(manifest.tensors),
                "memcpy_gbps": round(memcpy_bw / 1e9, 3),
                "pool_load_gbps": round(pool_bw / 1e9, 3),
                "pool_copy_only_gbps": round(copy_bw / 1e9, 3),
                "plan_ms_median": round(statistics.median(r.plan_seconds for r in runs) * 1e3, 3),
                "ratio_vs_memcpy": round(ratio, 3),
                "target_ratio": 0.8,
                "pass": ratio >= 0.8,
            }
        )
    )


if __name__ == "__main__":
    main()
