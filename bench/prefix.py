"""Prefix caching: a repeated 512-token system prompt, hit vs miss, warm and at a cold start.

Every request is a chat completion at ``temperature 0`` of SmolLM2-135M-Instruct in bfloat16: a
system prompt of :data:`SYSTEM_TOKENS` tokens (numbered rules, calibrated with the model's own
tokenizer; each starts with its own nonce, so two system prompts share no KV block) and a short
user question. Measured in one run, two ways:

* in-process (default): a real pool daemon; an instance is what a worker builds on assign
  (:func:`runtime.instance.bind`: pool acquire of resident weights, views, engine) after a
  pre-warmed worker's warm-up. TTFT = chat rendering and tokenizing + the step that samples the
  first token (publishing to the pool runs after it, as in serving). A resident cold start = a
  new pool session + bind + TTFT, the previous instance's session closed (it ended);
* ``--serve``: the same through ``ember serve`` (as :mod:`bench.coldstart`: pre-warmed workers,
  ``keepAlive: 3s``, ``maxScale: 1``), TTFT from sending the streamed request to the first SSE
  chunk with content, ``cached_tokens`` from the stream's usage. Needs an idle machine: on a
  loaded one the pre-warmed workers (SCHED_IDLE) never finish starting.

Warm: ``--pairs`` times a new system prompt (a miss: the whole prompt is prefilled), then the same
system prompt with another question (a hit: its full blocks come from the instance's prefix
cache). Target: hit TTFT p50 <= 25 % of miss p50. Resident cold starts, ``--cold`` of each kind,
alternating: a system prompt an ended instance published (its prefix KV still in the pool: the
new instance restores it) and a new one. Target: hit p50 <= 30 % of miss p50. Each sample's
cached tokens are checked (0 on a miss, the system prompt's full blocks on a hit). Prints one
JSON line; measure on an otherwise idle machine (the load average is reported).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.coldstart import DTYPE, FUNCTION, REPLENISH_PAUSE_S, SOURCE, WAIT_S, Bench, deploy, http_client

SYSTEM_TOKENS = 512
QUESTIONS = (
    "Which rule mentions the harbour?",
    "Summarise rule 3 in five words.",
    "What is the capital of France?",
    "Name one rule about lanterns.",
)


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int


def system_prompt(tokenizer: Any, nonce: str, tokens: int = SYSTEM_TOKENS) -> str:
    """A system prompt of about ``tokens`` tokens that starts with ``nonce``."""
    words = ("harbour", "lantern", "ledger", "orchard", "signal", "tide", "archive", "bridge")
    text = f"Session {nonce}. You are the keeper of a small port town. Follow these rules."
    for i in itertools.count(1):
        line = f" Rule {i}: keep the {words[i % 8]} and the {words[(i * 3) % 8]} in order, and log it."
        if len(tokenizer.encode(text + line).ids) > tokens:
            return text
        text += line
    raise AssertionError("unreachable")


def stream(b: Bench, system: str, question: str, max_tokens: int) -> Sample:
    """One streamed chat request on a new connection (the connect is timed, as in coldstart)."""
    body = json.dumps(
        {
            "model": FUNCTION,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    ).encode()
    ttft, usage = None, None
    with http_client() as client:
        t0 = time.perf_counter()
        headers = {"content-type": "application/json"}
        with client.stream("POST", b.url + "/v1/chat/completions", content=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"chat request failed: HTTP {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"the stream failed: {chunk['error']}")
                if chunk.get("choices") and (chunk["choices"][0].get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
    if ttft is None or usage is None:
        raise RuntimeError("the stream carried no content or no usage")
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    return Sample(round(ttft * 1e3, 2), cached, int(usage["prompt_tokens"]))


def summary(hits: list[Sample], misses: list[Sample]) -> dict[str, Any]:
    hit = statistics.median(s.ttft_ms for s in hits)
    miss = statistics.median(s.ttft_ms for s in misses)
    return {
        "hit_ttft_p50_ms": round(hit, 2),
        "miss_ttft_p50_ms": round(miss, 2),
        "hit_over_miss": round(hit / miss, 3),
        "hit_ttft_ms": [s.ttft_ms for s in hits],
        "miss_ttft_ms": [s.ttft_ms for s in misses],
        "hit_cached_tokens": [s.cached_tokens for s in hits],
        "miss_cached_tokens": [s.cached_tokens for s in misses],
        "prompt_tokens": [s.prompt_tokens for s in hits + misses],
    }


def run_engine(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The in-process measurement (see the module docstring)."""
    from gpu_pool.client import PoolClient
    from gpu_pool.spawn import running_pool
    from runtime.engine.sampling import SamplingParams
    from runtime.instance import ModelBinding, bind, load_template, warm_up
    from runtime.registry import models_dir, register

    params = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(binding: ModelBinding, system: str, question: str, t0: float | None = None) -> Sample:
        """Time to the first token; the engine then finishes (and publishes) off the clock."""
        t0 = time.perf_counter() if t0 is None else t0
        engine = binding.engine
        ids = binding.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        seq_id = engine.add_request(ids, params)
        while not engine.step():
            pass
        elapsed = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        engine.blocks.flush_publish()
        cached = engine.seqs[seq_id].cached_tokens or 0
        engine.forget(seq_id)
        return Sample(round(elapsed * 1e3, 2), cached, len(ids))

    with tempfile.TemporaryDirectory(prefix="ember-bench-prefix-") as tmp:
        home = Path(tmp)
        model = register(SOURCE, DTYPE, home=home)
        template = load_template(model.directory)
        warm_up(template)  # what a pre-warmed worker does before it has a function
        tok = template.tokenizer
        questions = itertools.cycle(QUESTIONS)

        def fresh() -> str:
            return system_prompt(tok, secrets.token_hex(4))

        sock = str(home / "pool.sock")
        env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        with running_pool(sock, args.arena, env=env, store_roots=(models_dir(home),)) as pool:

            def instance_session() -> PoolClient:
                """A session as the agent opens one for an instance: a ticket scoped to the function
                (a managed pool shares prefix KV within one function only)."""
                with PoolClient(sock, admin_token=pool.admin_token) as admin:
                    ticket = admin.grant(1 << 30, prefix_scope="default/prefix-bench")
                return PoolClient(sock, ticket=ticket)

            with instance_session() as client:
                binding = bind(template, client, 16)
                for _ in range(2):  # first prefills of these shapes (oneDNN primitives)
                    ttft(binding, fresh(), next(questions))
                hits, misses = [], []
                for _ in range(args.pairs):
                    system = fresh()
                    misses.append(ttft(binding, system, next(questions)))
                    hits.append(ttft(binding, system, next(questions)))
                out["warm"] = summary(hits, misses)
                binding.engine.close()
            published = [system]  # the last warm one: its blocks stayed in the pool
            cold_hits, cold_misses, bind_ms = [], [], []
            for i in range(2 * args.cold):
                hit = i % 2 == 0
                if not hit:
                    published.append(fresh())
                t0 = time.perf_counter()
                with instance_session() as client:  # a new instance; the last one ended
                    binding = bind(template, client, 16)
                    bind_ms.append((time.perf_counter() - t0) * 1e3)
                    sample = ttft(binding, published[-1], next(questions), t0)
                    (cold_hits if hit else cold_misses).append(sample)
                    binding.engine.close()
            out["resident_cold"] = summary(cold_hits, cold_misses)
            out["resident_cold"]["bind_ms_p50"] = round(statistics.median(bind_ms), 2)
            with PoolClient(sock) as client:
                stats = client.stats()
            out["pool"] = {k: v for k, v in stats.items() if k.startswith("prefix")}


def run_serve(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Through ``ember serve`` (see the module docstring)."""
    from tokenizers import Tokenizer

    from gateway.spawn import ServeProcess

    with tempfile.TemporaryDirectory(prefix="ember-bench-prefix-") as home:
        server = ServeProcess(Path(home), env={"EMBER_ARENA": args.arena, "EMBER_PREWARM": str(args.prewarm)})
        b = Bench(server.url, args.max_tokens, server.log_path)
        try:
            model = deploy(b)
            tok = Tokenizer.from_file(str(Path(model["dir"]) / "tokenizer.json"))
            b.wait_scaled_to_zero(args.prewarm)
            questions = itertools.cycle(QUESTIONS)

            def fresh() -> str:
                return system_prompt(tok, secrets.token_hex(4))

            # Warm: the first start, then warm-ups until the replacement pre-warmed worker is ready.
            stream(b, fresh(), next(questions), args.max_tokens)
            give_up = time.monotonic() + WAIT_S
            for i in itertools.count():
                stream(b, fresh(), next(questions), args.max_tokens)
                time.sleep(REPLENISH_PAUSE_S)
                if i >= 1 and b.warm_workers() >= args.prewarm:
                    break
                if time.monotonic() > give_up:
                    raise TimeoutError(f"the pre-warmed workers were not replenished; {b.diagnosis()}")
            hits, misses = [], []
            for _ in range(args.pairs):
                system = fresh()
                misses.append(stream(b, system, next(questions), args.max_tokens))
                hits.append(stream(b, system, next(questions), args.max_tokens))
            out["warm"] = summary(hits, misses)

            # Resident cold starts: a prefix an ended instance published vs one nobody has seen.
            cold_hits, cold_misses = [], []
            published = [system]  # the last warm one: its blocks are in the pool
            for _ in range(args.cold):
                b.wait_scaled_to_zero(args.prewarm)
                cold_hits.append(stream(b, published[-1], next(questions), args.max_tokens))
                b.wait_scaled_to_zero(args.prewarm)
                published.append(fresh())
                cold_misses.append(stream(b, published[-1], next(questions), args.max_tokens))
            out["resident_cold"] = summary(cold_hits, cold_misses)
        finally:
            b.close()
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="through ember serve (default: in-process)")
    parser.add_argument("--pairs", type=int, default=6, help="warm miss/hit pairs (default 6)")
    parser.add_argument("--cold", type=int, default=4, help="resident cold starts of each kind (default 4)")
    parser.add_argument("--max-tokens", type=int, default=4, help="--serve: tokens per request (default 4)")
    parser.add_argument("--prewarm", type=int, default=2, help="--serve: EMBER_PREWARM (default 2)")
    parser.add_argument("--arena", default="1GiB", help="pool arena (default 1GiB)")
    parser.add_argument("--quick", action="store_true", help="3 pairs, 2 cold starts of each kind")
    args = parser.parse_args()
    if min(args.pairs, args.cold, args.max_tokens) < 1:
        parser.error("--pairs, --cold and --max-tokens must be >= 1")
    if args.quick:
        args.pairs, args.cold = 3, 2
    import torch

    t_bench = time.perf_counter()
    out: dict[str, Any] = {
        "bench": "prefix",
        "mode": "serve" if args.serve else "in-process",
        "model": SOURCE,
        "dtype": DTYPE,
        "system_tokens": SYSTEM_TOKENS,
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
    }
    (run_serve if args.serve else run_engine)(args, out)
    out["targets"] = {"warm_hit_over_miss_le": 0.25, "cold_hit_over_miss_le": 0.30}
    kinds = ("warm", "resident_cold")
    checks = {
        "warm_hit_le_25pct_of_miss": out["warm"]["hit_over_miss"] <= 0.25,
        "cold_hit_le_30pct_of_miss": out["resident_cold"]["hit_over_miss"] <= 0.30,
        "misses_report_no_cached_tokens": not any(c for k in kinds for c in out[k]["miss_cached_tokens"]),
        # Every full block of the system prompt (the chat template's tokens around it vary).
        "hits_report_the_system_prompt_cached": all(
            c >= SYSTEM_TOKENS - 48 for k in kinds for c in out[k]["hit_cached_tokens"]
        ),
    }
    out["checks"] = checks
    out["pass"] = all(checks.values())
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    out["duration_s"] = round(time.perf_counter() - t_bench, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
