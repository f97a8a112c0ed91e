"""Planner decision time with about 1,000 resident tensors (Tangram §3.2, Figure 10).

Tangram reports that its loading decision (Minimal-Cost Eviction order + Partitioned-Gain
Packing) adds under 1 ms per model switch. This benchmark builds a realistic fragmented
region list and times the two parts of the decision that :class:`gpu_pool.server.reuse_store.
ReuseStore` runs on every acquire:

* :func:`gpu_pool.planner.eviction.eviction_order` with MCE over every inactive resident tensor
  (``--resident``, default 1,000 candidates), and
* :func:`gpu_pool.planner.allocator.plan` with ``PackingPolicy.PGP`` on the default engine (the C
  planner, ``gpu_pool/planner/csrc/``), from the region list as the store passes it.

The arena is built from chunks of real LLM manifests (Llama/Qwen/Phi-like shapes, fp16,
256-byte aligned): runs of inactive tensors of ~14 models, free gaps left by evicted
tensors (each <= 64 MiB; neighbouring gaps merge), the pinned tensors of one active model
(in three runs) and vLLM-style KV blocks near the top. With the default
``--resident 1000`` the region list has ~1,500 regions; ``--resident 500`` gives ~1,000.
Two requests are planned on it:

* ``stage2``: the missing 20 layers of a Llama-2-7B-shaped model (180 tensors). The free
  bytes cover it (x1.25), but no free region holds it and best-fit decreasing cannot place
  its 86 MiB MLP weights in the holes, so Stage 2 (packing with moves) runs.
* ``stage1``: the whole 7B model (291 tensors) cold, more than the free bytes, so Stage 1
  evicts in MCE order before Stage 2 runs.

Baselines, measured in the same run on the same input: the Python reference engine
(``PlannerEngine.PYTHON``, which must return the identical plan) and ``GLOBAL_MERGE``
planning. Times are wall-clock (``time.perf_counter``) medians and p95 over ``--reps``
repetitions, with the garbage collector enabled as in the daemon. Target: median decision
(order + plan) <= 1 ms per scenario, with the plan identical to the reference's. When it
is missed (or with ``--profile``) the JSON also lists the planner functions that dominate
under cProfile (per-decision milliseconds; cProfile inflates Python-call-heavy code).

Run: ``python -m bench.planner [--quick] [--reps N] [--resident N] [--seed S] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from gpu_pool.planner.allocator import (
    PackingPolicy,
    Plan,
    PlannerEngine,
    TensorRequest,
    full_compaction_bytes,
    place_direct,
    plan,
)
from gpu_pool.planner.eviction import EvictionCandidate, EvictionPolicy, ModelCostInputs, eviction_order
from gpu_pool.planner.regions import Region, RegionKind, align_up, build_region_list

MiB = 1 << 20
GiB = 1 << 30
TARGET_MEDIAN_DECISION_MS = 1.0
HORIZON_S = 60.0
BANDWIDTH = 25e9  # bytes/s, PCIe 4.0 x16-ish host-to-device
MAX_GAP = 64 * MiB


@dataclass(frozen=True, slots=True)
class Arch:
    """The shape parameters of a decoder-only LLM (fp16 weights, untied head)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int
    vocab: int


ARCHS: tuple[Arch, ...] = (
    Arch("tinyllama-1.1b", 2048, 22, 5632, 256, 32000),
    Arch("qwen2-1.5b", 1536, 28, 8960, 256, 151936),
    Arch("phi-2", 2560, 32, 10240, 2560, 51200),
    Arch("llama-3.2-3b", 3072, 28, 8192, 1024, 128256),
    Arch("mistral-7b", 4096, 32, 14336, 1024, 32000),
)
REQUEST_ARCH = Arch("llama-2-7b", 4096, 32, 11008, 4096, 32000)


def tensor_sizes(arch: Arch) -> list[tuple[str, int]]:
    """``(name, aligned bytes)`` of every tensor of ``arch`` in load order."""
    d, i, kv = arch.hidden, arch.intermediate, arch.kv_dim
    out = [("embed_tokens", arch.vocab * d * 2)]
    for layer in range(arch.layers):
        p = f"layers.{layer}."
        out += [
            (p + "input_layernorm", d * 2),
            (p + "self_attn.q_proj", d * d * 2),
            (p + "self_attn.k_proj", d * kv * 2),
            (p + "self_attn.v_proj", d * kv * 2),
            (p + "self_attn.o_proj", d * d * 2),
            (p + "post_attention_layernorm", d * 2),
            (p + "mlp.gate_proj", d * i * 2),
            (p + "mlp.up_proj", d * i * 2),
            (p + "mlp.down_proj", i * d * 2),
        ]
    out += [("norm", d * 2), ("lm_head", arch.vocab * d * 2)]
    return [(name, align_up(n)) for name, n in out]


def key_of(model_id: str, tensor: str) -> str:
    """A 32-hex fingerprint-like key, unique per model and tensor."""
    return xxhash.xxh3_128_hexdigest(f"{model_id}/{tensor}".encode())


@dataclass(slots=True)
class Scenario:
    """One planner input: the region list, the request, and Eq. 2's inputs."""

    name: str
    regions: list[Region]
    requests: list[TensorRequest]
    candidates: list[EvictionCandidate]
    models: dict[str, ModelCostInputs]


def build_layout(
    rng: random.Random, n_resident: int, free_target: int
) -> tuple[list[Region], list[EvictionCandidate], dict[str, ModelCostInputs]]:
    """A fragmented arena: ``n_resident`` inactive tensors, gaps, pinned tensors, KV blocks."""
    model_ids = [f"{ARCHS[j % len(ARCHS)].name}-ft{j}" for j in range(14)]
    manifests = {m: tensor_sizes(ARCHS[j % len(ARCHS)]) for j, m in enumerate(model_ids)}
    # Zipf(1.0) popularity, one request every 5 s over all models on average.
    rates = {m: (1 / (r + 1)) / sum(1 / (k + 1) for k in range(len(model_ids))) / 5.0 for r, m in
             enumerate(rng.sample(model_ids, len(model_ids)))}  # fmt: skip
    models = {
        m: ModelCostInputs(1 - math.exp(-rates[m] * HORIZON_S), BANDWIDTH, rng.choice([0.5, 1.0, 1.0, 2.0]))
        for m in model_ids
    }

    # Address-ordered items (kind, size, key, model); kinds: "t" inactive, "gap", "pin", "kv".
    items: list[tuple[str, int, str, str]] = []
    used: set[str] = set()
    candidates: list[EvictionCandidate] = []
    while len(candidates) < n_resident:
        m = rng.choice(model_ids)
        tensors = manifests[m]
        start = rng.randrange(len(tensors))
        for name, size in tensors[start : start + rng.randint(1, 24)]:
            key = key_of(m, name)
            if key in used or len(candidates) >= n_resident:
                continue
            used.add(key)
            owners = (m,) if rng.random() > 0.05 else (m, rng.choice(model_ids))
            candidates.append(
                EvictionCandidate(key, size, tuple(dict.fromkeys(owners)), rng.uniform(0, 3600))
            )
            items.append(("t", size, key, m))
    # Gaps where 1-3 adjacent tensors were evicted (<= 64 MiB each), until they hold ``free_target``.
    pool = [s for s in (size for t in manifests.values() for _, size in t) if s <= MAX_GAP]
    free = 0
    while free < free_target:
        gap = min(MAX_GAP, sum(rng.choice(pool) for _ in range(rng.randint(1, 3))))
        items.insert(rng.randrange(len(items) + 1), ("gap", gap, "", ""))
        free += gap

    # The active model: 3 runs of pinned tensors at random places (loaded into fragmented space).
    active = tensor_sizes(ARCHS[0])
    runs = [
        active[: len(active) // 3],
        active[len(active) // 3 : 2 * len(active) // 3],
        active[2 * len(active) // 3 :],
    ]
    for run in runs:
        at = rng.randrange(len(items))
        items[at:at] = [("pin", size, key_of("active", name), "") for name, size in run]
    # KV blocks (2 MiB, 16 tokens) of the active session: a few runs in the top third.
    for _ in range(6):
        at = rng.randrange(2 * len(items) // 3, len(items))
        items[at:at] = [("kv", 2 * MiB, "", "")] * rng.randint(4, 16)

    allocated: list[Region] = []
    offset = 0
    for n, (kind, size, key, _) in enumerate(items):
        if kind == "gap":
            offset += size
            continue
        if kind == "t":
            allocated.append(Region(offset, size, RegionKind.TENSOR, key, movable=True))
        elif kind == "pin":
            allocated.append(Region(offset, size, RegionKind.TENSOR, key, movable=False))
        else:
            allocated.append(Region(offset, size, RegionKind.KV, str(n)))
        offset += size
    offset += 16 * MiB  # a small free tail
    return build_region_list(offset, allocated), candidates, models


def build_scenarios(seed: int, n_resident: int) -> list[Scenario]:
    """The ``stage2`` and ``stage1`` scenarios on one layout."""
    rng = random.Random(seed)
    full = [TensorRequest(key_of("llama-2-7b", n), s) for n, s in tensor_sizes(REQUEST_ARCH)]
    partial = [r for r in full if r.key in {key_of("llama-2-7b", n) for n, _ in _layers_tail(12)}]
    free_target = int(sum(r.size for r in partial) * 1.25)
    regions, candidates, models = build_layout(rng, n_resident, free_target)
    return [
        Scenario("stage2", regions, partial, candidates, models),
        Scenario("stage1", regions, full, candidates, models),
    ]


def _layers_tail(first: int) -> list[tuple[str, int]]:
    """Tensors of layers ``first..31`` of the request model (its missing part)."""
    return [
        (n, s)
        for n, s in tensor_sizes(REQUEST_ARCH)
        if n.startswith("layers.") and int(n.split(".")[1]) >= first
    ]


def timings(fn: Callable[[], object], reps: int) -> list[float]:
    """Wall-clock milliseconds of ``reps`` calls of ``fn`` (after two warm-up calls)."""
    fn()
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict[str, float]:
    """Median and p95 in ms, rounded."""
    ordered = sorted(ms)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"median_ms": round(statistics.median(ordered), 4), "p95_ms": round(p95, 4)}


def profile(sc: Scenario, reps: int, top: int = 8) -> list[dict[str, object]]:
    """cProfile hot spots of one decision (order + PGP plan) in the pool's modules."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        order = eviction_order(EvictionPolicy.MCE, sc.candidates, sc.models)
        plan(sc.regions, sc.requests, order, PackingPolicy.PGP)  # the native engine
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = file.rsplit("/", 1)[-1]
        ours = ("allocator.py", "packing.py", "layout.py", "eviction.py", "native_planner.py")
        if not (file.endswith(ours) or file == "~"):
            continue
        label = f"{where}:{line}({func})" if file != "~" else func
        rows.append((tottime, cumtime, ncalls, label))
    rows.sort(reverse=True)
    return [
        {
            "fn": label,
            "tottime_ms": round(tt / reps * 1e3, 3),
            "cumtime_ms": round(ct / reps * 1e3, 3),
            "calls": round(nc / reps, 1),
        }
        for tt, ct, nc, label in rows[:top]
    ]


def run_scenario(sc: Scenario, reps: int) -> tuple[dict[str, object], float]:
    """Outcome and timings of one scenario, and its median decision time in ms."""
    order = eviction_order(EvictionPolicy.MCE, sc.candidates, sc.models)
    pgp: Plan = plan(sc.regions, sc.requests, order, PackingPolicy.PGP)
    gm: Plan = plan(sc.regions, sc.requests, order, PackingPolicy.GLOBAL_MERGE)
    reference = plan(sc.regions, sc.requests, order, PackingPolicy.PGP, engine=PlannerEngine.PYTHON)
    free = [(r.offset, r.size) for r in sc.regions if r.is_free]
    need = sum(r.size for r in sc.requests)

    def planning(packing: PackingPolicy, engine: PlannerEngine) -> Callable[[], object]:
        return lambda: plan(sc.regions, sc.requests, order, packing, engine=engine)

    def decision(packing: PackingPolicy, engine: PlannerEngine) -> Callable[[], object]:
        return lambda: plan(
            sc.regions,
            sc.requests,
            eviction_order(EvictionPolicy.MCE, sc.candidates, sc.models),
            packing,
            engine=engine,
        )

    native, python = PlannerEngine.NATIVE, PlannerEngine.PYTHON
    t_order = timings(lambda: eviction_order(EvictionPolicy.MCE, sc.candidates, sc.models), reps)
    t_pgp = timings(planning(PackingPolicy.PGP, native), reps)
    t_pgp_py = timings(planning(PackingPolicy.PGP, python), reps)
    t_gm = timings(planning(PackingPolicy.GLOBAL_MERGE, native), reps)
    t_dec = timings(decision(PackingPolicy.PGP, native), reps)
    t_dec_py = timings(decision(PackingPolicy.PGP, python), reps)
    t_dec_gm = timings(decision(PackingPolicy.GLOBAL_MERGE, native), reps)
    result: dict[str, object] = {
        "request_tensors": len(sc.requests),
        "request_mib": round(need / MiB, 1),
        "largest_request_tensor_mib": round(max(r.size for r in sc.requests) / MiB, 1),
        "free_mib": round(sum(s for _, s in free) / MiB, 1),
        "largest_free_mib": round(max(s for _, s in free) / MiB, 1),
        "direct_placement_possible": place_direct(free, sc.requests) is not None,
        "evictions": len(pgp.evictions),
        "evicted_mib": round(pgp.bytes_evicted / MiB, 1),
        "moves_pgp": len(pgp.moves),
        "moved_mib_pgp": round(pgp.bytes_moved / MiB, 1),
        "moves_gm": len(gm.moves),
        "moved_mib_gm": round(gm.bytes_moved / MiB, 1),
        "full_compaction_mib": round(full_compaction_bytes(sc.regions, pgp.evictions) / MiB, 1),
        "same_plan_as_python_reference": pgp == reference,
        "order": summary(t_order),
        "plan_pgp": summary(t_pgp),
        "plan_pgp_python_reference": summary(t_pgp_py),
        "plan_global_merge": summary(t_gm),
        "decision": summary(t_dec),
        "decision_python_reference": summary(t_dec_py),
        "decision_global_merge": summary(t_dec_gm),
        "decision_speedup_over_python_reference": round(
            statistics.median(t_dec_py) / statistics.median(t_dec), 2
        ),
    }
    return result, statistics.median(t_dec)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (50 instead of 300)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per timing (default 300)")
    ap.add_argument("--resident", type=int, default=1000, help="inactive resident tensors (MCE candidates)")
    ap.add_argument("--seed", type=int, default=20240607)
    ap.add_argument("--profile", action="store_true", help="always include cProfile hot spots")
    args = ap.parse_args(argv)
    reps = args.reps or (50 if args.quick else 300)

    scenarios = build_scenarios(args.seed, args.resident)
    regions = scenarios[0].regions
    results: dict[str, dict[str, object]] = {}
    medians: dict[str, float] = {}
    for sc in scenarios:
        results[sc.name], medians[sc.name] = run_scenario(sc, reps)
    same = all(r["same_plan_as_python_reference"] for r in results.values())
    ok = same and all(m <= TARGET_MEDIAN_DECISION_MS for m in medians.values())
    out: dict[str, object] = {
        "bench": "planner",
        "seed": args.seed,
        "reps": reps,
        "python": sys.version.split()[0],
        "regions": len(regions),
        "inactive_tensors": sum(1 for r in regions if r.movable),
        "pinned_tensors": sum(1 for r in regions if r.kind is RegionKind.TENSOR and not r.movable),
        "kv_blocks": sum(1 for r in regions if r.kind is RegionKind.KV),
        "free_regions": sum(1 for r in regions if r.is_free),
        "arena_gib": round(regions[-1].end / GiB, 2),
        "scenarios": results,
        "target": {"median_decision_ms_max": TARGET_MEDIAN_DECISION_MS},
        "median_decision_ms": {k: round(v, 4) for k, v in medians.items()},
        "pass": ok,
    }
    if not ok or args.profile:
        out["profile"] = {sc.name: profile(sc, max(10, reps // 10)) for sc in scenarios}
    print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
