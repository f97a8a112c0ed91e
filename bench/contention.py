"""Batch-1 decode through ``ember serve`` while other processes keep the CPUs busy (issue 12).

One ``ember serve`` (SmolLM2 bf16, one instance kept warm) streams 128-token completions
(``ignore_eos``) with the machine otherwise idle, then with ``--busy`` processes spinning
(``while True: pass``, what a noisy neighbour looks like). The node agent notices them in its
periodic CPU samples (:mod:`runtime.cpu_share`, two agreeing samples about a second apart) and
gives the instance fewer intra-op threads: OpenMP threads that outnumber the free cores spin
against each other. The figure is the loaded rate over the unloaded one, same run; target
>= 0.35 (a fair share of 2 cores with 2 busy processes is about 0.5). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.openai_stream import Target, decode_rate, http_client
from bench.peers import SOURCE
from gateway.spawn import ServeProcess

FUNCTION = "contention-bench"
TARGET_RATIO = 0.35
SETTLE_S = 4.0  # the agent's share changes after two agreeing ~1 s samples: wait past both


def decode_rates(target: Target, runs: int, tokens: int) -> list[float]:
    """Batch-1 decode tok/s of ``runs`` streamed requests, one after another."""
    return [decode_rate(target, tokens) for _ in range(runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--busy", type=int, default=2, help="busy processes to start (default 2)")
    parser.add_argument("--runs", type=int, default=5, help="streams per phase (default 5)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (default 128)")
    args = parser.parse_args()
    if min(args.busy, args.runs) < 1 or args.tokens < 2:
        parser.error("--busy and --runs must be >= 1, --tokens >= 2")

    out: dict[str, Any] = {
        "bench": "contention",
        "model": SOURCE,
        "dtype": "bfloat16",
        "cpus": os.cpu_count(),
    }
    out["loadavg_1m_start"] = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="ember-bench-contention-") as home:
        server = ServeProcess(Path(home), env={"EMBER_ARENA": "1GiB", "EMBER_PREWARM": "1"})
        busy: list[subprocess.Popen[bytes]] = []
        try:
            headers = {"authorization": f"Bearer {server.api_key}"} if server.api_key else {}
            spec = {
                "apiVersion": "ember.dev/v1",
                "kind": "Function",
                "metadata": {"name": FUNCTION},
                "spec": {
                    "model": {"source": SOURCE, "dtype": "bfloat16"},
                    "scaling": {"minScale": 1, "maxScale": 1, "keepAlive": "600s", "concurrency": 1},
                },
            }
            with http_client(300.0) as http:
                r = http.post(server.url + "/v1/functions", json=spec, headers=headers)
                if r.status_code != 201:
                    raise RuntimeError(f"deploy failed: HTTP {r.status_code}: {r.text[:400]}")
            target = Target(server.url, FUNCTION, {}, headers)
            decode_rates(target, 2, args.tokens)  # warm-up: the instance, its caches, its threads
            time.sleep(SETTLE_S)
            unloaded = decode_rates(target, args.runs, args.tokens)
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            time.sleep(SETTLE_S)
            loaded = decode_rates(target, args.runs, args.tokens)
            out["loadavg_1m_loaded"] = round(os.getloadavg()[0], 2)
        finally:
            for p in busy:
                p.kill()
                p.wait()
            server.stop()
    ratio = statistics.median(loaded) / statistics.median(unloaded)
    out.update(
        {
            "busy_processes": args.busy,
            "tokens": args.tokens,
            "unloaded_tok_s_p50": round(statistics.median(unloaded), 2),
            "loaded_tok_s_p50": round(statistics.median(loaded), 2),
            "unloaded_tok_s": [round(x, 2) for x in unloaded],
            "loaded_tok_s": [round(x, 2) for x in loaded],
            "ratio": round(ratio, 3),
            "target_ratio": TARGET_RATIO,
            "pass": ratio >= TARGET_RATIO,
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
