"""Measuring in turns: Ember and another process, one run each, again and again, seconds apart.

This host's speed drifts by 10-25 % from minute to minute (memory bandwidth shared with other
machines): figures of two servers measured minutes apart differ by that much whatever the
servers do. :mod:`bench.peers` therefore also measures in turns: a warm Ember function and
the other process (the raw engine, :mod:`bench.raw_engine` ``--interactive``; llama.cpp's
server) each run once, then again, ``turns`` times, and each pair gives one ratio; the p50 of
the pairs is the figure. Between pairs the machine rests ``OTHER_SETTLE_S`` (below).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from bench.openai_stream import Plan, Target, concurrent_streams, decode_rate, stream_chat

REPO = Path(__file__).resolve().parents[1]
# After another process's turn: the agent samples the machine's CPU use about once a second and
# moves an instance's thread count after two samples that agree (runtime.cpu_share). A busy turn
# of the raw engine or llama-server takes the served instance down to one thread and, ~2 s later,
# back up (seen in serve.log with 3 s here): Ember's next turn waits for both.
OTHER_SETTLE_S = 6.0


def take_turns(turns: int, ember: Callable[[], float], other: Callable[[], float]) -> dict[str, Any]:
    """``turns`` times: one figure of Ember's, one of the other process's, then
    ``OTHER_SETTLE_S``; each pair's ratio Ember / other and their p50."""
    ours, theirs = [], []
    for _ in range(turns):
        ours.append(ember())
        theirs.append(other())
        time.sleep(OTHER_SETTLE_S)
    ratios = [e / o for e, o in zip(ours, theirs, strict=True)]
    return {
        "ember": [round(r, 2) for r in ours],
        "other": [round(r, 2) for r in theirs],
        "ratios": [round(r, 3) for r in ratios],
        "ratio_p50": round(statistics.median(ratios), 3),
    }


def decode_tok_s(target: Target, plan: Plan) -> float:
    """One streamed batch-1 decode of ``plan.decode_tokens`` on ``target``: its tok/s."""
    return decode_rate(target, plan.decode_tokens)


def aggregate_tok_s(target: Target, plan: Plan) -> float:
    """``plan.streams`` concurrent streams of ``plan.decode_tokens`` on ``target``: their tok/s."""
    return float(concurrent_streams(target, plan.streams, plan.decode_tokens)["aggregate_tok_s"])


def peer_turns(
    ember: Target, peer: AbstractContextManager[Target], name: str, plan: Plan, turns: int
) -> dict[str, Any]:
    """Batch-1 decode, then the aggregate of ``plan.streams`` streams, of ``ember`` (warm) and
    of the server ``peer`` runs (``name``: what it serves) taking turns."""
    with peer as llama:
        for _ in range(plan.warmups):
            stream_chat(llama, plan.ttft_max_tokens)
        time.sleep(OTHER_SETTLE_S)
        return {
            "peer": name,
            "decode_tok_s": take_turns(
                turns, lambda: decode_tok_s(ember, plan), lambda: decode_tok_s(llama, plan)
            ),
            "aggregate_tok_s": take_turns(
                turns, lambda: aggregate_tok_s(ember, plan), lambda: aggregate_tok_s(llama, plan)
            ),
        }


def serving_overhead(
    target: Target, home: Path, source: str, dtype: str, plan: Plan, arena: str, turns: int
) -> dict[str, Any]:
    """Batch-1 decodes of ``target`` (warm) and of the raw engine on ``source`` as ``dtype`` in
    ``home``'s store taking turns: ``serving_overhead_pct`` is the p50 of raw / served - 1."""
    cmd = [sys.executable, "-m", "bench.raw_engine", "--interactive", "--home", str(home), "--source", source]
    cmd += ["--dtype", dtype, "--tokens", str(plan.decode_tokens), "--arena", arena]
    # stderr to a file: a pipe nobody reads while the turns run could fill and stall the engine
    with (
        tempfile.TemporaryFile("w+") as log,
        subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        ) as raw,
    ):
        assert raw.stdin is not None and raw.stdout is not None
        stdin, stdout = raw.stdin, raw.stdout

        def reply() -> dict[str, Any]:
            line = stdout.readline()
            if not line:
                log.seek(0)
                raise RuntimeError(f"bench.raw_engine {dtype} ended: {log.read()[-2000:]}")
            answer: dict[str, Any] = json.loads(line)
            return answer

        def raw_decode() -> float:
            stdin.write("run\n")
            stdin.flush()
            return float(reply()["decode_tok_s"])

        try:
            ready = reply()
            time.sleep(OTHER_SETTLE_S)  # its start-up kept a core busy, as a turn does
            pairs = take_turns(turns, lambda: decode_tok_s(target, plan), raw_decode)
        finally:
            stdin.close()
            try:
                raw.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raw.kill()
    overheads = [(raw / served - 1) * 100 for served, raw in zip(pairs["ember"], pairs["other"], strict=True)]
    return {
        "raw_engine": {
            "dtype": dtype,
            "threads": ready["threads"],
            "prompt_tokens": ready["prompt_tokens"],
            "decode_tok_s": round(statistics.median(pairs["other"]), 2),
            "decode_tok_s_runs": pairs["other"],
        },
        "served_decode_tok_s_paired": pairs["ember"],
        "serving_overhead_pct": round(statistics.median(overheads), 1),
        "serving_overhead_pct_pairs": [round(o, 1) for o in overheads],
    }
