"""The raw engine's batch-1 decode on a registered model: the baseline of the serving path.

``bench.peers`` runs this in a fresh process after each ``ember serve`` has stopped, on the same
``EMBER_HOME`` (its model store), the same chat prompt and the same token count: what the
engine alone does, with nothing else (worker event loop, SSE, gateway, client) on the cores.
The engine is built as an instance's is (:func:`runtime.instance.bind`: weights and KV blocks
from a pool daemon of its own, the model's registered profile), runs a warm-up request, then
``--runs`` decodes of ``--tokens`` tokens with ``ignore_eos``; tok/s excludes the prefill, as
the served figure (first to last content token) does. Prints one JSON line.

``--interactive`` keeps the engine for a caller that alternates it with served runs (so both
see the host in the same state): after its warm-up it prints ``{"event": "ready", ...}``, then
answers each ``run`` line on stdin with one decode's ``{"decode_tok_s": ...}`` line, and exits
at end of input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine import decode_rate
from bench.openai_stream import PROMPT
from gpu_pool.client import PoolClient
from gpu_pool.spawn import running_pool
from runtime.instance import bind, load_template
from runtime.registry import models_dir, register


@dataclass(frozen=True)
class RawEngine:
    """A warmed-up engine: ``decode()`` runs one batch-1 decode and returns its tok/s."""

    decode: Callable[[], float]
    prompt_tokens: int


@contextlib.contextmanager
def raw_engine(home: Path, source: str, dtype: str, tokens: int, arena: str) -> Iterator[RawEngine]:
    """An engine on ``source`` registered as ``dtype`` in ``home``, built as an instance's and
    warmed up, decoding ``tokens`` tokens of the chat prompt per run."""
    reg = register(source, dtype, home=home)  # already registered by the served run: found
    template = load_template(reg.directory)
    prompt = template.tokenizer.encode(
        template.chat.render([{"role": "user", "content": PROMPT}]), add_special_tokens=False
    ).ids
    sock = str(home / "raw-engine-pool.sock")
    with running_pool(sock, arena, store_roots=(models_dir(home),)), PoolClient(sock) as client:
        deadline = time.monotonic() + 120  # the arena's pre-faulting competes for the cores
        while not client.stats()["arena_populated"] and time.monotonic() < deadline:
            time.sleep(0.2)
        engine = bind(template, client, tokens, progressive=False).engine  # as an instance's
        try:
            decode_rate(engine, prompt, 1, min(tokens, 16))  # warm-up
            yield RawEngine(lambda: decode_rate(engine, prompt, 1, tokens), len(prompt))
        finally:
            engine.close()


def measure(home: Path, source: str, dtype: str, tokens: int, runs: int, arena: str) -> dict[str, object]:
    """Batch-1 decode tok/s of the raw engine on ``source`` registered as ``dtype`` in ``home``."""
    with raw_engine(home, source, dtype, tokens, arena) as raw:
        rates = [raw.decode() for _ in range(runs)]
    return {
        "dtype": dtype,
        "prompt_tokens": raw.prompt_tokens,
        "threads": torch.get_num_threads(),
        "decode_tok_s": round(statistics.median(rates), 2),
        "decode_tok_s_runs": [round(r, 2) for r in rates],
    }


def interactive(home: Path, source: str, dtype: str, tokens: int, arena: str) -> None:
    """The ``--interactive`` protocol (see the module docstring) on stdin and stdout."""
    with raw_engine(home, source, dtype, tokens, arena) as raw:
        ready = {"event": "ready", "dtype": dtype, "prompt_tokens": raw.prompt_tokens}
        print(json.dumps({**ready, "threads": torch.get_num_threads()}), flush=True)
        for line in sys.stdin:
            if line.strip() != "run":
                raise SystemExit(f"unknown command {line.strip()[:40]!r}: expected 'run'")
            print(json.dumps({"decode_tok_s": round(raw.decode(), 2)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--home", type=Path, required=True, help="an EMBER_HOME whose store holds the model")
    p.add_argument("--source", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--arena", default="1GiB")
    p.add_argument("--interactive", action="store_true", help="one decode per 'run' line on stdin")
    args = p.parse_args()
    if args.tokens < 2 or args.runs < 1:
        p.error("--tokens must be >= 2 and --runs >= 1")
    if args.interactive:
        interactive(args.home, args.source, args.dtype, args.tokens, args.arena)
        return
    print(json.dumps(measure(args.home, args.source, args.dtype, args.tokens, args.runs, args.arena)))


if __name__ == "__main__":
    main()
