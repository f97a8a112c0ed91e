"""Capacity with co-located instances (LLM-Mesh) against one instance per device (issue 16).

Several functions share one CPU device. Two configurations of a real ``ember serve`` replay
the same open-loop load at increasing request rates:

* ``colocated``: every function's instance on the device at once, token-level scheduling
  (``EMBER_TOKEN_SCHEDULING=on``: one iteration at a time, least headroom first, shadow
  validation at admission) and bin-packing of requests (``EMBER_SLOT_POLICY=pack``);
* ``exclusive``: one instance per device at a time (``EMBER_INSTANCES_PER_DEVICE=1``), as
  ServerlessLLM runs one model per GPU: a request of another function waits until the
  device's instance is idle, which is then stopped (its weights stay resident: Ember's
  resident cold start, so this baseline is already far faster than a reload).

Before the sweep each function gets one request (co-located, every instance is then up; the
functions keep a 60 s keep-alive). Load: Poisson arrivals at ``rate`` requests/s for
``duration`` seconds, each for a function drawn by Zipf popularity (s = 1) over the
functions, a prompt of 32-96 words and 32 output tokens (``ignore_eos``). A request meets its
SLO when its TTFT is within max(2 s, prompt tokens / 512 s) and its time per output token
after the first within 250 ms (the spec's defaults, LLM-Mesh's); a refused or failed request
misses it. *Capacity* is the highest rate at which at least ``--attainment`` (0.9) of the
requests met their SLO: the last rate of the sweep that did, refined by linear interpolation
towards the first that did not.

Acceptance (issue 16): capacity co-located / exclusive >= 1.4. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.json_line import emit
from bench.replay import Replay
from bench.trace import score
from bench.workload import Arrival, Trace, TraceConfig
from bench.zoo import Zoo, build, default_root
from scheduler.spec import SloSpec

FUNCTIONS = ("smollm2-bf16", "smollm2-ft-a", "smollm2-ft-b", "smollm2-q4")
CONFIGS: dict[str, dict[str, str]] = {
    "colocated": {"EMBER_TOKEN_SCHEDULING": "on", "EMBER_SLOT_POLICY": "pack"},
    "exclusive": {"EMBER_INSTANCES_PER_DEVICE": "1"},
}
PREWARM = 4
KEEP_ALIVE = "60s"  # instances stay between requests: capacity, not cold starts, is measured
PROMPT_WORDS = (32, 96)
OUTPUT_TOKENS = 32
SETTLE_S = 3.0  # quiet time between two rates (requests of the last one finish)


def poisson_trace(rate: float, duration_s: float, num_functions: int, seed: int) -> Trace:
    """Open-loop Poisson arrivals at ``rate``/s, Zipf (s = 1) popularity over the functions."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(num_functions)]
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        function = rng.choices(range(num_functions), weights)[0]
        arrivals.append(Arrival(t, function, rng.randint(*PROMPT_WORDS), OUTPUT_TOKENS))
        t += rng.expovariate(rate)
    config = TraceConfig(
        num_functions=num_functions,
        num_requests=len(arrivals),
        duration_s=duration_s,
        zipf_s=1.0,
        prompt_tokens=PROMPT_WORDS,
        max_tokens=(OUTPUT_TOKENS, OUTPUT_TOKENS),
        seed=seed,
    )
    return Trace(config, tuple(arrivals))


def one_each(num_functions: int) -> Trace:
    """A request per function, 3 s apart (each finishes before the next)."""
    arrivals = tuple(Arrival(3.0 * i, i, PROMPT_WORDS[0], OUTPUT_TOKENS) for i in range(num_functions))
    config = TraceConfig(
        num_functions=num_functions, num_requests=num_functions, duration_s=3.0 * num_functions, zipf_s=0.0
    )
    return Trace(config, arrivals)


def capacity(points: list[dict[str, Any]], target: float) -> float:
    """The highest rate meeting ``target`` attainment, interpolated towards the next one."""
    points = sorted(points, key=lambda p: p["rate"])
    best = 0.0
    for i, p in enumerate(points):
        if p["slo_attainment"] < target:
            if i > 0 and points[i - 1]["slo_attainment"] >= target:
                lo, hi = points[i - 1], p
                share = (lo["slo_attainment"] - target) / (lo["slo_attainment"] - hi["slo_attainment"])
                best = lo["rate"] + share * (hi["rate"] - lo["rate"])
            break
        best = p["rate"]
    return round(best, 3)


def run_config(
    zoo: Zoo, name: str, rates: list[float], duration_s: float, seed: int, work: Path, target: float
) -> list[dict[str, Any]]:
    """Sweep ``rates`` on one ``ember serve`` in configuration ``name``; stops after the first
    rate below ``target`` attainment (a higher one cannot do better)."""
    env = {"EMBER_PREWARM": str(PREWARM), "EMBER_STANDBY": "0", **CONFIGS[name]}
    models = tuple(zoo.model(f) for f in FUNCTIONS)
    points = []
    with Replay(zoo, work / name, env, KEEP_ALIVE) as replay:
        replay.deploy(models)
        replay.wait_ready(PREWARM)
        # One request per function first, one at a time: co-located, every instance is up
        # before the sweep; one per device, the sweep starts with the last one's.
        replay.run(one_each(len(FUNCTIONS)), list(FUNCTIONS))
        time.sleep(SETTLE_S)
        for rate in rates:
            trace = poisson_trace(rate, duration_s, len(FUNCTIONS), seed)
            result = replay.run(trace, list(FUNCTIONS))
            figures = score(result, SloSpec())
            point = {"rate": rate, **{k: figures[k] for k in _KEPT}}
            point["refused"] = sum(1 for r in result.requests if r.error and "slo_unattainable" in r.error)
            points.append(point)
            print(json.dumps({"config": name, **point}), file=sys.stderr, flush=True)
            if point["slo_attainment"] < target:
                break
            time.sleep(SETTLE_S)
    return points


_KEPT = (
    "requests",
    "errors",
    "slo_attainment",
    "throughput_rps",
    "tokens_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "cold_starts",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="0.5,1,1.5,2,2.5,3,4", help="requests/s, ascending")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--configs", default="colocated,exclusive")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ember-bench-mesh"))
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args(argv)
    rates = sorted(float(r) for r in args.rates.split(","))
    names = args.configs.split(",")
    if unknown := set(names) - set(CONFIGS):
        parser.error(f"unknown configurations {sorted(unknown)} (choose from {', '.join(CONFIGS)})")
    t0 = time.perf_counter()
    zoo = build(default_root("full"), "full", progress=True)
    ensure_time_tables(zoo)
    results = {
        name: run_config(zoo, name, rates, args.duration, args.seed, args.work, args.attainment)
        for name in names
    }
    caps = {name: capacity(points, args.attainment) for name, points in results.items()}
    line: dict[str, Any] = {
        "bench": "mesh",
        "functions": list(FUNCTIONS),
        "duration_s": args.duration,
        "attainment_target": args.attainment,
        "sweeps": results,
        "capacity_rps": caps,
    }
    if caps.get("exclusive"):
        ratio = caps.get("colocated", 0.0) / caps["exclusive"]
        line["capacity_ratio"] = round(ratio, 3)
        line["checks"] = {"colocated_ge_1_4x_exclusive": ratio >= 1.4}
    line["duration_s_total"] = round(time.perf_counter() - t0, 1)
    emit(line, args.out)


def ensure_time_tables(zoo: Zoo) -> None:
    """Zoo models registered before time tables existed get one (the agent's admissions need it)."""
    from runtime.registry import ensure_time_table, load

    for name in FUNCTIONS:
        ensure_time_table(load(zoo.model_dir(zoo.model(name))))


if __name__ == "__main__":
    main()
