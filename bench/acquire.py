"""Acquire of a fully resident ~300-tensor / 270 MB manifest from fresh client processes.

A pool daemon runs in its own process with the model already resident. Each sample is a
new Python process (torch and the client imported before the clock starts, as in a
pre-warmed worker) that times: connect + hello, the ``acquire`` round trip, mapping the
arena and building every tensor view. Baseline in the same processes: loading the same
tensors without the pool (``safetensors.torch.load_file`` of the store file copied into
private memory, warm page cache). Target: p50 <= 5 ms. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gpu_pool import store
from gpu_pool.client import PoolClient
from gpu_pool.manifest import Manifest
from gpu_pool.spawn import running_pool

CLIENT = r"""
import json, sys, time
import torch
from gpu_pool import store
from gpu_pool.client import PoolClient
from gpu_pool.spawn import running_pool
from safetensors.torch import load_file
manifest = store.read(sys.argv[2])
manifest.encoded()  # as a pre-warmed worker's model template has it (runtime.instance)
t0 = time.perf_counter()
client = PoolClient(sys.argv[1])
t1 = time.perf_counter()
reply = client._call("acquire", manifest_bin=manifest.encoded())
t2 = time.perf_counter()
arena = client.arena()
t3 = time.perf_counter()
views = client.views(manifest, reply["placements"])  # as runtime.instance makes them
t4 = time.perf_counter()
assert len(views) == len(manifest.tensors) and reply["report"]["bytes_loaded"] == 0
client.close()
b0 = time.perf_counter()
loaded = {k: v.clone() for k, v in load_file(manifest.tensors[0].file).items()}  # private copy, no pool
b1 = time.perf_counter()
assert all(torch.equal(loaded[n], views[n]) for n in list(loaded)[:5])
print(json.dumps({"connect": t1 - t0, "rpc": t2 - t1, "map": t3 - t2, "views": t4 - t3,
                  "total": t4 - t0, "baseline": b1 - b0}))
"""


def smollm2_like(root: Path) -> Manifest:
    """A manifest shaped like SmolLM2-135M in bf16: 30 layers x 9 tensors + embeddings (~270 MB)."""
    g = torch.Generator().manual_seed(0)
    hidden, inter, kv = 576, 1536, 192
    tensors = {"model.embed_tokens.weight": torch.randn(49152, hidden, generator=g).bfloat16()}
    for i in range(30):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }
        for name, shape in shapes.items():
            tensors[p + name] = torch.randn(*shape, generator=g).bfloat16()
    tensors["model.norm.weight"] = torch.randn(hidden, generator=g).bfloat16()
    return store.write(root / "smollm2-like", tensors, model_id="smollm2-like")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 samples")
    args = parser.parse_args()
    samples = 5 if args.quick else args.samples
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="ember-bench-acquire-") as tmp:
        root = Path(tmp)
        manifest = smollm2_like(root)
        sock = str(root / "pool.sock")
        env = dict(os.environ, PYTHONPATH=str(repo))
        with running_pool(sock, "1GiB", env={"PYTHONPATH": str(repo)}, store_roots=(root,)):
            with PoolClient(sock) as warm:
                warm.acquire(manifest)  # make it resident, then release by closing
            runs = []
            for _ in range(samples):
                out = subprocess.run(
                    [sys.executable, "-c", CLIENT, sock, str(root / "smollm2-like")],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=True,
                    timeout=120,
                )
                runs.append(json.loads(out.stdout))

    def p50_ms(key: str) -> float:
        return round(statistics.median(r[key] for r in runs) * 1e3, 3)

    p50 = p50_ms("total")
    print(
        json.dumps(
            {
                "bench": "acquire",
                "num_tensors": len(manifest.tensors),
                "bytes": manifest.nbytes,
                "samples": samples,
                "p50_ms": p50,
                "p90_ms": round(sorted(r["total"] for r in runs)[int(0.9 * (samples - 1))] * 1e3, 3),
                "breakdown_p50_ms": {k: p50_ms(k) for k in ("connect", "rpc", "map", "views")},
                "baseline_private_load_p50_ms": p50_ms("baseline"),
                "speedup_vs_baseline": round(p50_ms("baseline") / p50, 1),
                "target_p50_ms": 5.0,
                "pass": p50 <= 5.0,
            }
        )
    )


if __name__ == "__main__":
    main()
