"""What idle costs the next forward pass on this host, without Ember: a plain torch workload.

A cold request always arrives at an idle machine; a warm request measured back to back never
does. This benchmark shows how much of a difference that alone makes here. One process, no
server: a chain of ``--layers`` bf16 matrix-vector products over ``--dim`` x ``--dim`` weights
(128 MiB at the defaults, memory-bound like a small model's decode step) on ``--threads``
intra-op threads. For each gap in ``--gaps`` it sleeps that long, times one pass (``first``),
then times the pass right after it (``next``), ``--samples`` times; the gap 0 row is the
back-to-back baseline measured in the same run, and ``first_over_back_to_back`` is each gap's
first-pass p50 over the baseline's. Nothing of Ember runs, so a ratio above 1 is the host's
(CPU wake-up, caches and TLB refilled after other work), paid by any request after idle.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--layers", type=int, default=16, help="matrices in the chain (default 16)")
    parser.add_argument("--dim", type=int, default=2048, help="each matrix is dim x dim bf16 (2048)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--samples", type=int, default=10, help="passes per gap (default 10)")
    parser.add_argument("--gaps", default="0,0.05,0.2,0.5,1.0", help="idle seconds before a pass")
    args = parser.parse_args()
    gaps = [float(g) for g in args.gaps.split(",")]
    if args.layers < 1 or args.dim < 1 or args.threads < 1 or args.samples < 1 or min(gaps) < 0:
        parser.error("layers, dim, threads and samples must be >= 1 and gaps >= 0")
    if 0.0 not in gaps:
        gaps.insert(0, 0.0)

    import torch

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(args.dim, args.dim, generator=gen).to(torch.bfloat16) for _ in range(args.layers)]
    x = torch.randn(1, args.dim, generator=gen).to(torch.bfloat16)

    def one_pass() -> float:
        t0 = time.perf_counter()
        y = x
        for w in weights:
            y = torch.nn.functional.linear(y, w)  # (1, dim)
        return (time.perf_counter() - t0) * 1e3

    for _ in range(5):  # first-use costs (oneDNN kernels, page faults) out of the figures
        one_pass()
    rows = {}
    for gap in gaps:
        first, after = [], []
        for _ in range(args.samples):
            time.sleep(gap)
            first.append(one_pass())
            after.append(one_pass())
        rows[gap] = (statistics.median(first), statistics.median(after))
    base = rows[0.0][0]
    out = {
        "bench": "idle_wake",
        "weight_mib": args.layers * args.dim * args.dim * 2 / 2**20,
        "threads": args.threads,
        "samples": args.samples,
        "back_to_back_ms_p50": round(base, 2),
        "by_gap": [
            {
                "gap_s": gap,
                "first_ms_p50": round(first, 2),
                "next_ms_p50": round(after, 2),
                "first_over_back_to_back": round(first / base, 3),
            }
            for gap, (first, after) in rows.items()
        ],
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
