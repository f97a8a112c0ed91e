"""Tangram Fig. 10 (loading policies) and Fig. 12a (locality x batch) on Ember's pool daemon.

Tangram (../shared/papers/tangram.txt) splits the cost of getting a model's weights into GPU
memory into *Compute* (the planner's decision), *Merge* (moving resident tensors to make room)
and *Load* (copying the missing tensors in). Fig. 10 compares loading policies on that
breakdown for a large and a small model: random eviction + Global Merge, Minimal-Cost Eviction
+ Global Merge, and MCE + Partitioned-Greedy-Packing (Tangram), against SLLM, which reuses
nothing. Fig. 12a sweeps request locality (L1-L4, §5.1) and batch size (the KV cache a batch
needs takes space that resident weights could have used) for Tangram against SLLM.

**What runs.** A real pool daemon (``python -m gpu_pool``, one per policy and cell, so no
state carries over) with a CPU arena, and real model store entries: two families with the
tensor shapes of real LLMs (bf16; full run: SmolLM2-135M-shaped "small" models and
SmolLM2-360M-shaped "large" ones; ``--quick``: scaled-down shapes), random bytes, every model
distinct. The arena holds about half of the working set. Every request is a fresh session:
``acquire`` the model, ``kv_alloc`` blocks for ``batch`` sequences of ``seq_len`` tokens at the
model's KV bytes per token (clamped to what the arena can hold beside the model; the clamp
is counted), ``release``. The acquire report gives Compute (``plan_seconds``), Merge
(``move_seconds``) and Load (``load_seconds``) and the bytes loaded, moved and reused; all are
wall-clock times of real byte copies (memory copies on a CPU arena, not PCIe transfers, so
absolute times are smaller than the paper's; the ratios are what compares).

Policies: ``sllm`` evicts every inactive tensor (the admin ``evict``) before each acquire, so
each request loads its whole model; ``rand_gm`` (``EMBER_POOL_EVICTION=random``,
``EMBER_POOL_PACKING=global_merge``), ``mce_gm`` (mce + global_merge) and ``mce_pgp`` (the
default: mce + pgp). Requests follow :func:`bench.workload.locality_sequence` (Fig. 10: L3,
the original runs) with :func:`bench.workload.locality_arrivals` gaps of mean
``mean_gap_s``: the arrival times only feed MCE's request-rate estimates (time is compressed;
a request that would start before the previous one ended starts right after it).

Run: ``python -m bench.tangram --figure 10|12 [--quick] [--seed S]``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.json_line import emit
from bench.workload import Locality, locality_arrivals, locality_sequence
from gpu_pool import store
from gpu_pool.client import PoolClient
from gpu_pool.manifest import Manifest
from gpu_pool.spawn import running_pool

MiB = 1 << 20
KV_BLOCK_TOKENS = 16
POLICIES: dict[str, dict[str, str]] = {
    "sllm": {},  # the arena is emptied before every acquire: policies never matter
    "rand_gm": {"EMBER_POOL_EVICTION": "random", "EMBER_POOL_PACKING": "global_merge"},
    "mce_gm": {"EMBER_POOL_EVICTION": "mce", "EMBER_POOL_PACKING": "global_merge"},
    "mce_pgp": {"EMBER_POOL_EVICTION": "mce", "EMBER_POOL_PACKING": "pgp"},
}


@dataclass(frozen=True, slots=True)
class Arch:
    """A decoder-only LLM's shape (bf16, tied embeddings, grouped-query k/v)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int
    vocab: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        d, i, kv = self.hidden, self.intermediate, self.kv_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out |= {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (i, d),
                p + "mlp.up_proj.weight": (i, d),
                p + "mlp.down_proj.weight": (d, i),
            }
        out["model.norm.weight"] = (d,)
        return out

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_dim * 2  # K and V, every layer, bf16


@dataclass(frozen=True, slots=True)
class Setup:
    """The sizes of one run."""

    small: Arch
    large: Arch
    num_small: int
    num_large: int
    arena_fraction: float  # of the working set
    requests: int
    seq_len: int  # tokens per sequence of a batch
    batches: tuple[int, ...]  # Fig. 12
    localities: tuple[Locality, ...]  # Fig. 12
    fig10_batch: int
    mean_gap_s: float


FULL = Setup(
    small=Arch("smollm2-135m", 576, 30, 1536, 192, 49152),
    large=Arch("smollm2-360m", 960, 32, 2560, 320, 49152),
    num_small=3,
    num_large=2,
    arena_fraction=0.55,
    requests=100,
    seq_len=128,
    batches=(1, 16, 64),
    localities=tuple(Locality),
    fig10_batch=8,
    mean_gap_s=0.05,
)
QUICK = Setup(
    small=Arch("tiny-s", 256, 4, 704, 64, 2048),
    large=Arch("tiny-l", 384, 6, 1024, 96, 2048),
    num_small=3,
    num_large=2,
    arena_fraction=0.55,
    requests=30,
    seq_len=64,
    batches=(1, 64),
    localities=(Locality.L1, Locality.L4),
    fig10_batch=8,
    mean_gap_s=0.005,
)


@dataclass(frozen=True, slots=True)
class Model:
    manifest: Manifest
    family: str  # "small" or "large"
    arch: Arch


@dataclass(frozen=True, slots=True)
class Sample:
    """What one request cost."""

    family: str
    compute_s: float
    merge_s: float
    load_s: float
    bytes_loaded: int
    bytes_moved: int
    bytes_reused: int
    kv_clamped: bool


def write_models(root: Path, setup: Setup, seed: int) -> list[Model]:
    """The working set, families interleaved so both are among the popular models (index 0
    is the most requested)."""
    order: list[str] = []
    left = {"small": setup.num_small, "large": setup.num_large}
    while any(left.values()):
        for family in ("small", "large"):
            if left[family]:
                order.append(family)
                left[family] -= 1
    models = []
    for k, family in enumerate(order):
        arch = setup.small if family == "small" else setup.large
        rng = np.random.default_rng([seed, k])
        tensors = {}
        for name, shape in arch.shapes().items():
            raw = rng.integers(0, 256, size=2 * math.prod(shape), dtype=np.uint8)
            tensors[name] = torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
        model_id = f"{arch.name}-{k}"
        models.append(Model(store.write(root / model_id, tensors, model_id=model_id), family, arch))
    return models


def _kv_request(model: Model, batch: int, seq_len: int, arena: int, alignment: int) -> tuple[int, int, bool]:
    """(blocks, block bytes, clamped) for a batch, at most what fits beside the model."""
    block = KV_BLOCK_TOKENS * model.arch.kv_bytes_per_token
    aligned_block = -(-block // alignment) * alignment
    weights = sum(-(-e.nbytes // alignment) * alignment for e in model.manifest.tensors)
    wanted = batch * math.ceil(seq_len / KV_BLOCK_TOKENS)
    room = max(0, (arena - weights - 4 * MiB) // aligned_block)
    return min(wanted, room), block, wanted > room


def run_policy(
    policy: str, root: Path, models: Sequence[Model], sequence: Sequence[int], arrivals: Sequence[float],
    batch: int, setup: Setup, arena: int,
) -> list[Sample]:  # fmt: skip
    """Replay ``sequence`` on a fresh daemon under ``policy``."""
    samples = []
    sock = str(root / f"pool-{policy}.sock")
    with running_pool(sock, arena, env={**POLICIES[policy]}, store_roots=(root,)) as pool:
        admin = PoolClient(sock, admin_token=pool.admin_token) if policy == "sllm" else None
        try:
            start = time.monotonic()
            for index, at in zip(sequence, arrivals, strict=True):
                time.sleep(max(0.0, start + at - time.monotonic()))
                if admin is not None:
                    admin.evict()  # SLLM: nothing stays resident between requests
                model = models[index]
                with PoolClient(sock) as client:
                    client.acquire_placements(model.manifest)
                    report = client.last_acquire
                    assert report is not None
                    blocks, block_bytes, clamped = _kv_request(
                        model, batch, setup.seq_len, arena, client.alignment
                    )
                    if blocks:
                        client.kv_alloc(blocks, block_bytes)
                    client.release()  # synchronous: the next session finds nothing pinned
                samples.append(
                    Sample(
                        model.family,
                        report.plan_seconds,
                        report.move_seconds,
                        report.load_seconds,
                        report.bytes_loaded,
                        report.bytes_moved,
                        report.bytes_reused,
                        clamped,
                    )
                )
        finally:
            if admin is not None:
                admin.close()
    return samples


def breakdown(samples: Sequence[Sample]) -> dict[str, Any]:
    """Mean Compute / Merge / Load milliseconds and bytes per request."""
    if not samples:
        return {"requests": 0}

    def mean(values: Sequence[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    return {
        "requests": len(samples),
        "compute_ms": round(mean([s.compute_s for s in samples]) * 1e3, 4),
        "merge_ms": round(mean([s.merge_s for s in samples]) * 1e3, 4),
        "load_ms": round(mean([s.load_s for s in samples]) * 1e3, 4),
        "bytes_loaded": sum(s.bytes_loaded for s in samples),
        "bytes_moved": sum(s.bytes_moved for s in samples),
        "bytes_reused": sum(s.bytes_reused for s in samples),
        "kv_clamped": sum(s.kv_clamped for s in samples),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def figure10(root: Path, models: Sequence[Model], setup: Setup, arena: int, seed: int) -> dict[str, Any]:
    sequence = locality_sequence(len(models), Locality.L3, setup.requests, seed)
    arrivals = locality_arrivals(Locality.L3, setup.requests, setup.mean_gap_s, seed)
    runs = {
        p: run_policy(p, root, models, sequence, arrivals, setup.fig10_batch, setup, arena) for p in POLICIES
    }
    policies = {
        p: {
            fam: breakdown([s for s in samples if fam in ("all", s.family)])
            for fam in ("small", "large", "all")
        }
        for p, samples in runs.items()
    }
    sllm_load = policies["sllm"]["all"]["load_ms"]

    def vs_sllm(key: str) -> dict[str, dict[str, float | None]]:
        return {
            p: {
                fam: _ratio(policies[p][fam][key], policies["sllm"][fam][key])
                for fam in ("small", "large", "all")
            }
            for p in POLICIES
            if p != "sllm"
        }

    gm, pgp = policies["mce_gm"]["all"], policies["mce_pgp"]["all"]
    merge_ratio = _ratio(pgp["merge_ms"], gm["merge_ms"])
    moved_ratio = _ratio(pgp["bytes_moved"], gm["bytes_moved"])
    return {
        "figure": 10,
        "locality": Locality.L3.value,
        "batch": setup.fig10_batch,
        "policies": policies,
        "load_vs_sllm": vs_sllm("load_ms"),
        # Bytes as well as milliseconds: copy times on a shared CPU are noisy, bytes are not.
        "bytes_loaded_vs_sllm": vs_sllm("bytes_loaded"),
        "merge_reduction_pgp_vs_gm": None if merge_ratio is None else round(1 - merge_ratio, 4),
        "bytes_moved_reduction_pgp_vs_gm": None if moved_ratio is None else round(1 - moved_ratio, 4),
        "tangram": {
            "rand_gm_load_reduction_vs_sllm": "up to 0.68",
            "merge_reduction_pgp_vs_gm": 0.93,
            "compute_ms_max": 1.0,
        },
        "pass": bool(
            pgp["compute_ms"] < 1.0
            and policies["mce_pgp"]["all"]["load_ms"] < sllm_load
            and pgp["bytes_moved"] <= gm["bytes_moved"]
        ),
    }


def figure12(root: Path, models: Sequence[Model], setup: Setup, arena: int, seed: int) -> dict[str, Any]:
    cells: list[dict[str, Any]] = []
    ratios: dict[tuple[str, int], float | None] = {}
    for level in setup.localities:
        sequence = locality_sequence(len(models), level, setup.requests, seed)
        arrivals = locality_arrivals(level, setup.requests, setup.mean_gap_s, seed)
        for batch in setup.batches:
            sllm = breakdown(run_policy("sllm", root, models, sequence, arrivals, batch, setup, arena))
            tangram = breakdown(run_policy("mce_pgp", root, models, sequence, arrivals, batch, setup, arena))
            ratios[(level.value, batch)] = _ratio(tangram["bytes_loaded"], sllm["bytes_loaded"])
            cells.append(
                {
                    "locality": level.value,
                    "batch": batch,
                    "sllm": sllm,
                    "mce_pgp": tangram,
                    "load_vs_sllm": _ratio(tangram["load_ms"], sllm["load_ms"]),
                    "bytes_loaded_vs_sllm": ratios[(level.value, batch)],
                }
            )
    best = ratios[(setup.localities[-1].value, setup.batches[0])]
    worst = ratios[(setup.localities[0].value, setup.batches[-1])]
    return {
        "figure": 12,
        "cells": cells,
        "tangram": "load falls with locality and rises with batch; L1 x batch 64 matches SLLM",
        # Bytes, not milliseconds: the ordering of cells is about reuse, timing noise aside.
        "pass": best is not None
        and worst is not None
        and best <= worst
        and all(r is not None and r <= 1.0 for r in ratios.values()),
    }


def run(figure: int, quick: bool, seed: int = 0) -> dict[str, Any]:
    """One figure's JSON document."""
    setup = QUICK if quick else FULL
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-bench-tangram-") as tmp:
        root = Path(tmp)
        models = write_models(root, setup, seed)
        working_set = sum(m.manifest.nbytes for m in models)
        arena = int(working_set * setup.arena_fraction) // (2 * MiB) * (2 * MiB)
        largest = max(m.manifest.nbytes for m in models)
        arena = max(arena, (largest + 8 * MiB) // (2 * MiB) * (2 * MiB) + 2 * MiB)
        make = figure10 if figure == 10 else figure12
        out = make(root, models, setup, arena, seed)
    return {
        "bench": "tangram",
        "quick": quick,
        "seed": seed,
        "device": "cpu",
        "models": {m.manifest.model_id: m.manifest.nbytes for m in models},
        "working_set_bytes": working_set,
        "arena_bytes": arena,
        "requests_per_run": setup.requests,
        "seq_len": setup.seq_len,
        **out,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--figure", type=int, choices=(10, 12), required=True)
    parser.add_argument("--quick", action="store_true", help="scaled-down models and fewer requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON line to this file too")
    args = parser.parse_args(argv)
    emit(run(args.figure, args.quick, args.seed), args.out)


if __name__ == "__main__":
    main()
