"""Residency-aware placement vs kube-scheduler's default spreading, on a simulated cluster.

8 functions (each its own tiny random-weight Llama, ~430 KB of float32 weights, registered
through the normal registry) over 3 nodes whose pools have 1.5 MiB arenas each: three models
fit per node, so each node holds part of the eight, and the cluster holds them all only
while no model is on two nodes (with ``--arena 1MiB`` six of the eight fit at most). A
skewed request mix (Zipf, s = 1.1, over a random ranking; one request per tick) scales
functions from zero and back (keep-alive: ``--keep-alive`` ticks idle). Every scale-from-zero
schedules a real ``v1.Pod`` through the real extender over HTTP (:mod:`bench.cluster_sim`) and
starts it by acquiring the model from the bound node's pool; the pool's ``bytes_loaded`` is
the cost.

The same trace is replayed twice, each time on a fresh cluster (new Redis, pools, extender):

* ``extender``: filter, then prioritize (Tangram Eq. 3 over the pools' reported residency),
  bind to the top score;
* ``spread``: filter (so both place only where the model fits), then a random node: what
  kube-scheduler's default spreading does, knowing nothing of residency.

Target: bytes loaded with the extender <= 30 % of those with spreading. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from bench.cluster_sim import Cluster, SimFunction, replay, zipf_trace

TARGET_RATIO = 0.30
LAYERS = 10  # ~430 KB of float32 weights per model: three fit a 1.5 MiB arena


def tiny_functions(root: Path, count: int, layers: int = LAYERS) -> tuple[list[SimFunction], Path]:
    """``count`` functions, each with its own tiny random-weight Llama registered under
    ``root/home``; returns them and the model store root the pools must trust."""
    from runtime.registry import models_dir, register
    from runtime.sources import SourceRoots

    # The tests' GGUF writer (llama.cpp's layout): benchmarks run from a checkout.
    from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

    src = Path(os.path.realpath(root)) / "sources"
    src.mkdir(parents=True, exist_ok=True)
    functions = []
    for i in range(count):
        path = src / f"fn{i}.gguf"
        write_tiny_gguf(path, hf_weights(seed=100 + i, layers=layers))
        model = register(str(path), "float32", home=root / "home", roots=SourceRoots((src,)))
        functions.append(SimFunction(f"fn{i}", "default", model.model_id, model.manifest()))
    return functions, models_dir(root / "home")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--functions", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--arena", default="1536KiB", help="each node's pool arena")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--keep-alive", type=int, default=2, help="ticks idle before scaling to zero")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="150 requests")
    args = parser.parse_args()
    requests = 150 if args.quick else args.requests
    t_bench = time.perf_counter()
    out: dict[str, object] = {
        "bench": "multinode",
        "functions": args.functions,
        "nodes": args.nodes,
        "arena": args.arena,
        "requests": requests,
        "zipf_s": args.zipf,
        "keep_alive_ticks": args.keep_alive,
        "seed": args.seed,
    }
    with tempfile.TemporaryDirectory(prefix="ember-bench-multinode-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        functions, store = tiny_functions(root, args.functions)
        out["register_s"] = round(time.perf_counter() - t0, 1)
        out["weight_bytes_per_model"] = sorted({f.weight_bytes for f in functions})
        trace = zipf_trace(len(functions), requests, args.zipf, random.Random(args.seed))
        out["requests_per_function"] = [trace.count(i) for i in range(len(functions))]
        results = {}
        for policy in ("extender", "spread"):
            t0 = time.perf_counter()
            with Cluster(root / policy, (store,), nodes=args.nodes, arena=args.arena) as cluster:
                result = replay(cluster, functions, trace, policy, args.keep_alive, seed=args.seed)
                decisions = cluster.extender.decisions() if cluster.extender else []
            results[policy] = {
                **result.encode(),
                "decisions_logged": len(decisions),
                "wall_s": round(time.perf_counter() - t0, 1),
            }
    out["extender"] = results["extender"]
    out["spread"] = results["spread"]
    spread = int(results["spread"]["bytes_loaded"])  # type: ignore[call-overload]
    ratio = int(results["extender"]["bytes_loaded"]) / spread if spread else None  # type: ignore[call-overload]
    out["bytes_loaded_ratio_extender_over_spread"] = round(ratio, 3) if ratio is not None else None
    out["target_ratio_max"] = TARGET_RATIO
    out["pass"] = ratio is not None and ratio <= TARGET_RATIO
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - t_bench, 1)
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
