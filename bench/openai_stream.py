"""One streaming OpenAI client for every server the peer benchmark compares (Ember, llama.cpp).

Every request goes to ``/v1/chat/completions`` with ``stream: true`` on a new connection
(``Connection: close``: llama.cpp's server mishandles keep-alive, and the same treatment for
every server keeps the figures comparable), with ``TCP_NODELAY`` so the client's own Nagle
delay stays out of them. Times are taken by this process: TTFT from sending the request to the
first SSE chunk whose delta has non-empty ``content``; decode from that chunk to the last one.

:func:`measure_server` takes the three steady-state figures of ``bench/peers.py``: warm TTFT,
batch-1 decode rate and the aggregate rate of concurrent streams.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = "What is the capital of France?"
MAX_EVENTS = 100_000  # SSE lines read per stream at most (128-token streams send ~130)


def http_client(timeout: float = 300.0) -> httpx.Client:
    """A client whose sockets set ``TCP_NODELAY``, so the client's own Nagle stays out of the figures."""
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return httpx.Client(
        transport=httpx.HTTPTransport(socket_options=nodelay), timeout=httpx.Timeout(timeout, connect=10.0)
    )


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of a non-empty sequence: the smallest value at
    least ``q`` of the values are at or below (p99 of fewer than 100 values is their maximum;
    rounding ``q * (n - 1)`` instead gave the second largest of 80, under-stating the tail)."""
    if not values or not 0.0 <= q <= 1.0:
        raise ValueError("pct needs a non-empty sequence and q in [0, 1]")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class Target:
    """A server to measure: its base URL, the ``model`` to name, and what every request adds
    (``cache_prompt: false`` for llama.cpp) and sends as headers (an API key)."""

    url: str
    model: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed chat completion as the client saw it (seconds from sending the request)."""

    first_s: float  # first content token (TTFT)
    last_s: float  # last content token
    total_s: float  # [DONE] or the end of the body
    content_chunks: int
    completion_tokens: int  # the server's usage figure, else content_chunks
    prompt_tokens: int | None
    text: str

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second from the first to the last content token (None for one token)."""
        span = self.last_s - self.first_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else None


def _body(target: Target, max_tokens: int, ignore_eos: bool) -> bytes:
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        **target.extra,
    }
    return json.dumps(body).encode()


def sse_chunks(response: httpx.Response, where: str) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI SSE stream up to ``[DONE]`` (at most ``MAX_EVENTS`` lines);
    RuntimeError on an error chunk."""
    for n, line in enumerate(response.iter_lines()):
        if n >= MAX_EVENTS:
            raise RuntimeError(f"{where}: more than {MAX_EVENTS} SSE lines")
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"{where}: the stream failed: {chunk['error']}")
        yield chunk


def stream_chat(
    target: Target,
    max_tokens: int,
    ignore_eos: bool = True,
    t0: float | None = None,
    client: httpx.Client | None = None,
) -> Streamed:
    """One streamed request on a new connection; times count from ``t0`` (a ``perf_counter``
    reading, e.g. a process start) or else from sending the request. ``client``: one made
    beforehand with :func:`http_client` (each costs ~17 ms of CPU to make: its TLS context),
    else one is made and closed here."""
    headers = {"content-type": "application/json", "connection": "close", **target.headers}
    body = _body(target, max_tokens, ignore_eos)
    text, chunks, first, last = "", 0, None, 0.0
    usage: dict[str, Any] = {}
    with contextlib.nullcontext(client) if client is not None else http_client() as http:
        start = time.perf_counter() if t0 is None else t0
        with http.stream("POST", target.url + "/v1/chat/completions", content=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{target.url}: HTTP {r.status_code}: {r.text[:500]}")
            for chunk in sse_chunks(r, target.url):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
                if content:
                    last = time.perf_counter() - start
                    first = last if first is None else first
                    chunks += 1
                    text += content
        total = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{target.url}: the stream carried no content")
    prompt = usage.get("prompt_tokens")
    return Streamed(
        first_s=first,
        last_s=last,
        total_s=total,
        content_chunks=chunks,
        completion_tokens=int(usage.get("completion_tokens") or chunks),
        prompt_tokens=int(prompt) if prompt is not None else None,
        text=text,
    )


def decode_rate(target: Target, max_tokens: int) -> float:
    """One streamed batch-1 decode of ``max_tokens`` (``ignore_eos``) on ``target``: its tok/s."""
    rate = stream_chat(target, max_tokens).decode_tok_s
    if rate is None:
        raise RuntimeError(f"{target.url}: a decode run produced fewer than two tokens")
    return rate


def concurrent_streams(target: Target, streams: int, max_tokens: int) -> dict[str, Any]:
    """``streams`` requests of ``max_tokens`` (``ignore_eos``) sent at once; the aggregate rate
    is their completion tokens over the time from the first send to the last end."""
    results: list[Streamed | BaseException] = []
    lock = threading.Lock()
    gate = threading.Barrier(streams + 1)
    sent: list[float] = []
    # Made before the start: 8 clients made at once took ~140 ms of CPU from the server's cores
    # and came out as TTFT and aggregate rate.
    clients = [http_client() for _ in range(streams)]

    def one(client: httpx.Client) -> None:
        gate.wait()
        t0 = time.perf_counter()
        try:
            s: Streamed | BaseException = stream_chat(target, max_tokens, True, t0, client)
        except BaseException as exc:  # reported by the caller
            s = exc
        with lock:
            sent.append(t0)
            results.append(s)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in clients]
    try:
        for t in threads:
            t.start()
        gate.wait()
        t_start = time.perf_counter()
        for t in threads:
            t.join(timeout=600.0)
        wall = time.perf_counter() - t_start
    finally:
        for c in clients:
            c.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors or len(results) != streams:
        raise RuntimeError(f"{len(errors)} of {streams} concurrent streams failed: {errors[:1]}")
    done = [r for r in results if isinstance(r, Streamed)]
    tokens = sum(s.completion_tokens for s in done)
    rates = [r for r in (s.decode_tok_s for s in done) if r is not None]
    return {
        "streams": streams,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),
        "per_stream_decode_tok_s_p50": round(statistics.median(rates), 2) if rates else None,
        "ttft_p50_ms": round(statistics.median(s.first_s for s in done) * 1e3, 1),
    }


@dataclass(frozen=True, slots=True)
class Plan:
    """How many requests each figure takes."""

    warmups: int = 3
    ttft_requests: int = 10
    ttft_max_tokens: int = 8
    decode_runs: int = 3
    decode_tokens: int = 128
    streams: int = 8
    aggregate_runs: int = 2

    def __post_init__(self) -> None:
        if min(self.ttft_requests, self.decode_runs, self.streams, self.aggregate_runs) < 1:
            raise ValueError("every request count must be >= 1")
        if self.warmups < 0 or self.ttft_max_tokens < 1 or self.decode_tokens < 2:
            raise ValueError("warmups >= 0, ttft_max_tokens >= 1, decode_tokens >= 2")


def measure_server(target: Target, plan: Plan) -> dict[str, Any]:
    """Warm TTFT p50, batch-1 decode tok/s (``plan.decode_tokens``, ``ignore_eos``) and the
    aggregate tok/s of ``plan.streams`` concurrent streams, all after ``plan.warmups``."""
    for _ in range(plan.warmups):
        stream_chat(target, plan.ttft_max_tokens)
    warm = [stream_chat(target, plan.ttft_max_tokens) for _ in range(plan.ttft_requests)]
    ttft = [s.first_s * 1e3 for s in warm]
    decode = [stream_chat(target, plan.decode_tokens) for _ in range(plan.decode_runs)]
    rates = [r for r in (s.decode_tok_s for s in decode) if r is not None]
    if not rates:
        raise RuntimeError(f"{target.url}: no decode run produced two tokens")
    aggregate = [
        concurrent_streams(target, plan.streams, plan.decode_tokens) for _ in range(plan.aggregate_runs)
    ]
    agg_rates = [float(a["aggregate_tok_s"]) for a in aggregate]
    return {
        "prompt_tokens": warm[0].prompt_tokens,
        "warm_ttft_p50_ms": round(statistics.median(ttft), 2),
        "warm_ttft_p90_ms": round(pct(ttft, 0.9), 2),
        "warm_ttft_ms": [round(t, 2) for t in ttft],
        "decode_tok_s": round(statistics.median(rates), 2),
        "decode_tok_s_runs": [round(r, 2) for r in rates],
        "decode_completion_tokens": [s.completion_tokens for s in decode],
        "decode_content_chunks": [s.content_chunks for s in decode],
        "aggregate_tok_s": round(statistics.median(agg_rates), 2),
        "aggregate_runs": aggregate,
        "sample_text": warm[0].text,
    }
