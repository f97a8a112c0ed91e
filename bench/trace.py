"""Trace-driven evaluation on a real ``ember serve``: mCache Table 3 on Ember (issue 15).

One run builds the model zoo (:mod:`bench.zoo`), generates one FaaS-like trace
(:mod:`bench.workload`: heavy-tailed popularity, bursty arrivals, idle gaps longer than the
keep-alive) and replays it (:mod:`bench.replay`) once per configuration: every model-importance
policy of the pool (mCache's IAM and the LRU, LFU, ARC and SRRIP baselines, ``EMBER_POOL_
IMPORTANCE``, feeding MCE's p_m) at every arena capacity (a fraction of the zoo's working set:
the unique tensor bytes of all its models). The same trace, the same functions, a fresh
``ember serve`` each time.

Per configuration (mCache §6.3 and Table 3, Tangram's cold-start metrics, the spec's SLO):

* ``hit_ratio``: cold starts whose model was wholly resident (0 bytes loaded) over all cold
  starts (an instance start is the only time Ember's pool is asked for a model; requests to a
  running instance never reach it). ``request_hit_ratio``: 1 - loads / requests, the share
  of requests that did not wait for a load (mCache's per-request hit ratio).
* ``byte_hit_ratio``: bytes reused / bytes needed over all cold starts; ``bytes_loaded``.
* ``load_ms_mean`` / ``load_ms_p99``: instance start time (the pool acquire and everything
  around it: mCache's "model loading time" is the part of it that loads).
* ``throughput_rps`` (completed requests over the replay's wall time), ``tokens_per_s``.
* ``ttft_ms_p50`` / ``ttft_ms_p99``, ``cold_start_rate`` (instances started per request) and
  ``slo_attainment``: requests answered within the spec's SLO (TTFT <= max(slo.ttft,
  prompt tokens / 512 s) and time per output token <= slo.tpot; failures miss it).

Prints one JSON line (``--out FILE`` appends it there too, for ``bench/plots.py``). ``--quick``
is the CI smoke test of the harness: the quick zoo, two policies, one capacity, a short trace,
two pre-warmed workers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.json_line import emit
from bench.openai_stream import pct
from bench.replay import Replay, ReplayResult
from bench.workload import (
    AZURE_KEEP_ALIVE_S,
    MAX_DURATION_S,
    MAX_REQUESTS,
    Trace,
    TraceConfig,
    generate,
    summary,
)
from bench.zoo import Zoo, build, default_root
from scheduler.spec import SloSpec

POLICIES = ("iam", "lru", "lfu", "arc", "srrip")
CAPACITIES = (0.4, 0.6, 0.8)
# Pre-warmed workers (Ember's default is 2): a burst of cold starts of several functions takes
# one each, and a replacement's process start (~2.5 s of CPU, far more beside busy instances on
# 2 cores) is not what the policies are compared on. Standbys (default 2) are off for the same
# reason: each expiry would start one more process on the same cores.
PREWARM = 6
# --quick (the CI smoke test of the harness, not a comparison): Ember's default. Each pre-warmed
# worker starts after the last one is up (~4 s each on 2 cores), and a fresh server per
# configuration waited ~25 s for six before its replay began.
QUICK_PREWARM = 2
STANDBY = 0
KEEP_ALIVE_S = 2.0  # the functions' keep-alive: Azure's 20 minutes, compressed by TIME_SCALE
TIME_SCALE = AZURE_KEEP_ALIVE_S / KEEP_ALIVE_S  # trace seconds per replay second (600)
ARENA_ALIGN = 1 << 20


def arena_bytes(zoo: Zoo, capacity: float) -> int:
    """The arena for ``capacity`` (a fraction of the zoo's working set), whole MiB."""
    return max(ARENA_ALIGN, int(zoo.working_set_bytes * capacity) // ARENA_ALIGN * ARENA_ALIGN)


def function_order(zoo: Zoo, seed: int) -> list[str]:
    """Which function is the trace's i-th most popular: a seeded shuffle of the zoo, so
    popularity is independent of model size (as in mCache's random workload)."""
    names = [m.name for m in zoo.models]
    random.Random(seed).shuffle(names)
    return names


def trace_config(
    zoo: Zoo, quick: bool, requests: int | None, duration: float | None, seed: int
) -> TraceConfig:
    """The trace both trace benchmarks replay (``bench.trace_pool`` uses the same one)."""
    return TraceConfig(
        num_functions=len(zoo.models),
        num_requests=requests if requests is not None else (16 if quick else 80),
        duration_s=duration if duration is not None else (12.0 if quick else 90.0),
        max_tokens=(2, 4),
        prompt_tokens=(8, 32),
        seed=seed,
        time_scale=TIME_SCALE,
    )


def score(result: ReplayResult, slo: SloSpec) -> dict[str, Any]:
    """The per-configuration figures of the module docstring, from one replay."""
    reqs = result.requests
    done = [r for r in reqs if r.error is None and r.ttft_s is not None]
    cold = result.cold_starts
    loads = [c for c in cold if c.bytes_loaded > 0]
    needed = sum(c.bytes_loaded + c.bytes_reused for c in cold)

    def within_slo(r: Any) -> bool:
        if r.error is not None or r.ttft_s is None:
            return False
        ttft_limit = max(slo.ttft, (r.prompt_tokens or 0) / 512)
        tpot = (r.total_s - r.ttft_s) / (r.completion_tokens - 1) if r.completion_tokens > 1 else 0.0
        return bool(r.ttft_s <= ttft_limit and tpot <= slo.tpot)

    ttfts = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    starts = [c.start_ms for c in cold]
    return {
        "requests": len(reqs),
        "errors": len(reqs) - len(done),
        "error_samples": sorted({r.error for r in reqs if r.error})[:3],
        "cold_starts": len(cold),
        "loads": len(loads),
        "cold_start_rate": round(len(cold) / len(reqs), 4) if reqs else None,
        "hit_ratio": round(1 - len(loads) / len(cold), 4) if cold else None,
        "request_hit_ratio": round(1 - len(loads) / len(reqs), 4) if reqs else None,
        "byte_hit_ratio": round(1 - sum(c.bytes_loaded for c in cold) / needed, 4) if needed else None,
        "bytes_loaded": sum(c.bytes_loaded for c in cold),
        "load_ms_mean": round(statistics.fmean(starts), 1) if starts else None,
        "load_ms_p99": round(pct(starts, 0.99), 1) if starts else None,
        "throughput_rps": round(len(done) / result.wall_s, 4),
        "tokens_per_s": round(sum(r.completion_tokens for r in done) / result.wall_s, 2),
        "ttft_ms_p50": round(statistics.median(ttfts), 1) if ttfts else None,
        "ttft_ms_p99": round(pct(ttfts, 0.99), 1) if ttfts else None,
        "slo_attainment": round(sum(map(within_slo, reqs)) / len(reqs), 4) if reqs else None,
        "wall_s": round(result.wall_s, 1),
        "pool": {
            k: result.pool.get(k) for k in ("bytes_loaded", "bytes_reused", "bytes_moved", "capacity_bytes")
        },
    }


def run_config(
    zoo: Zoo,
    trace: Trace,
    order: list[str],
    policy: str,
    capacity: float,
    work: Path,
    prewarm: int = PREWARM,
) -> dict[str, Any]:
    """Replay ``trace`` on a fresh ``ember serve`` with ``policy``, ``capacity`` and
    ``prewarm`` pre-warmed workers."""
    arena = arena_bytes(zoo, capacity)
    env = {
        "EMBER_ARENA": str(arena),
        "EMBER_POOL_IMPORTANCE": policy,
        "EMBER_PREWARM": str(prewarm),
        "EMBER_STANDBY": str(STANDBY),
    }
    t0 = time.perf_counter()
    with Replay(zoo, work / f"{policy}-{capacity}", env, f"{KEEP_ALIVE_S:g}s") as replay:
        replay.deploy(zoo.models)
        replay.wait_ready(prewarm)
        result = replay.run(trace, order)
    out = {"policy": policy, "capacity": capacity, "arena_bytes": arena, **score(result, SloSpec())}
    out["config_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"config": out}), file=sys.stderr, flush=True)
    return out


def best_baseline(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per capacity: IAM's hit ratio against the best baseline's (the acceptance check)."""
    out = {}
    for capacity in sorted({c["capacity"] for c in configs}):
        at = {c["policy"]: c for c in configs if c["capacity"] == capacity}
        if "iam" not in at or len(at) < 2:
            continue
        others = {p: c["hit_ratio"] or 0.0 for p, c in at.items() if p != "iam"}
        best = max(others, key=lambda p: others[p])
        iam = at["iam"]["hit_ratio"] or 0.0
        out[str(capacity)] = {
            "iam": iam,
            "best_baseline": best,
            "best_hit_ratio": others[best],
            "iam_ge_best": iam >= others[best],
        }
    return out


def _csv(parser: argparse.ArgumentParser, flag: str, text: str) -> list[str]:
    """A comma-separated list without empty or repeated items (parser.error otherwise)."""
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items) or len(set(items)) != len(items):
        parser.error(f"{flag} {text!r}: expected distinct comma-separated values")
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="CI smoke test: quick zoo, 2 policies, 1 capacity"
    )
    parser.add_argument("--policies", default=None, help=f"comma-separated (default {','.join(POLICIES)})")
    parser.add_argument("--capacities", default=None, help="comma-separated fractions (default 0.4,0.6,0.8)")
    parser.add_argument("--requests", type=int, default=None, help="arrivals in the trace")
    parser.add_argument("--duration", type=float, default=None, help="replay seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--zoo-root", type=Path, default=None, help="default $EMBER_ZOO_DIR or ~/.cache/ember/zoo/PROFILE"
    )
    parser.add_argument("--out", type=Path, default=None, help="append the JSON line to this file too")
    args = parser.parse_args(argv)
    profile = "quick" if args.quick else "full"
    default_policies = "iam,lru" if args.quick else ",".join(POLICIES)
    policies = _csv(parser, "--policies", default_policies if args.policies is None else args.policies)
    for p in policies:
        if p not in POLICIES:
            parser.error(f"unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    default_capacities = "0.6" if args.quick else "0.4,0.6,0.8"
    capacities_text = default_capacities if args.capacities is None else args.capacities
    try:
        capacities = [float(c) for c in _csv(parser, "--capacities", capacities_text)]
    except ValueError:
        parser.error(f"--capacities {capacities_text!r}: expected fractions such as 0.4,0.6")
    if any(not 0 < c <= 1 for c in capacities):
        parser.error("capacities are fractions in (0, 1]")
    # Given values are checked, not replaced: 0 used to fall back to the default silently.
    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--requests must be in [1, {MAX_REQUESTS}]")
    if args.duration is not None and not 1.0 <= args.duration <= MAX_DURATION_S:
        parser.error(f"--duration must be in [1, {MAX_DURATION_S:g}] seconds")
    if args.seed < 0:
        parser.error("--seed must be >= 0")

    t0 = time.perf_counter()
    zoo = build(args.zoo_root or default_root(profile), profile)
    config = trace_config(zoo, args.quick, args.requests, args.duration, args.seed)
    trace = generate(config)
    order = function_order(zoo, args.seed)
    with tempfile.TemporaryDirectory(prefix="ember-trace-") as tmp:
        prewarm = QUICK_PREWARM if args.quick else PREWARM
        configs = [
            run_config(zoo, trace, order, p, c, Path(tmp), prewarm) for c in capacities for p in policies
        ]
    line = {
        "bench": "trace",
        "profile": profile,
        "zoo": {
            "working_set_bytes": zoo.working_set_bytes,
            "models": [
                {"name": m.name, "dtype": m.dtype, "family": m.family, "nbytes": m.nbytes} for m in zoo.models
            ],
        },
        "popularity_order": order,
        "trace": {"config": asdict(config), "summary": summary(trace)},
        "configs": configs,
        "iam_vs_best": best_baseline(configs),
        "seconds": round(time.perf_counter() - t0, 1),
        "load_avg": os.getloadavg()[0],
    }
    emit(line, args.out)


if __name__ == "__main__":
    main()
