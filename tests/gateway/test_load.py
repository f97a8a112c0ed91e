"""Load: 32 concurrent streaming clients over two functions for 60 s, then scale to zero."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from gateway.spawn import ServeProcess
from tests.gateway.conftest import chat_spec, instances, wait_for

pytestmark = pytest.mark.slow

DURATION_S = 60.0
CLIENTS = {"busy": 24, "quiet": 8}  # 32 streaming clients in all


async def client_loop(
    http: httpx.AsyncClient, name: str, seed: int, until: float, out: dict[str, list]
) -> None:
    """Stream requests back to back until ``until``; record each outcome."""
    n = 0
    while time.monotonic() < until:
        body = {
            "model": name,
            "messages": [
                {"role": "user", "content": f"Give me fact number {seed * 1000 + n} about the sea."}
            ],
            "max_tokens": 24,
            "temperature": 0.7,
            "seed": seed * 1000 + n,
            "stream": True,
        }
        n += 1
        t0 = time.monotonic()
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    out["errors"].append(f"{name}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
                    continue
                done = False
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                        out["errors"].append(f"{name}: {line[:300]}")
                if not done:
                    out["errors"].append(f"{name}: stream ended without [DONE]")
                else:
                    out["latency"].append(time.monotonic() - t0)
        except httpx.HTTPError as exc:
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")


async def watch(url: str, until: float, peak: dict[str, int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while time.monotonic() < until:
            functions = (await http.get("/v1/cluster")).json()["functions"]
            for name, f in functions.items():
                live = [i for i in f["instances"] if i["state"] in ("starting", "ready")]
                peak[name] = max(peak.get(name, 0), len(live))
            await asyncio.sleep(0.5)


async def run_load(url: str) -> tuple[dict[str, list], dict[str, int]]:
    out: dict[str, list] = {"errors": [], "latency": []}
    peak: dict[str, int] = {}
    until = time.monotonic() + DURATION_S
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        jobs = [client_loop(http, name, i, until, out) for name, k in CLIENTS.items() for i in range(k)]
        await asyncio.gather(watch(url, until, peak), *jobs)
    return out, peak


def test_32_streaming_clients_two_functions_then_scale_to_zero(tmp_path: Path) -> None:
    serve = ServeProcess(tmp_path / "home", env={"EMBER_ARENA": "1GiB", "EMBER_PREWARM": "2"})
    try:
        with httpx.Client(base_url=serve.url, timeout=120) as http:
            for name in CLIENTS:
                spec = chat_spec(name, keep_alive="3s", max_scale=3, concurrency=8)
                assert http.post("/v1/functions", json=spec).status_code == 201
            out, peak = asyncio.run(run_load(serve.url))
            assert out["errors"] == []
            assert len(out["latency"]) >= len(CLIENTS) * 2  # every client finished requests
            assert peak["busy"] >= 2  # 24 streams at concurrency 8 scaled the busy function out
            for name in CLIENTS:
                wait_for(lambda n=name: instances(http, n) == [], timeout=60)  # type: ignore[misc]
            latencies = sorted(out["latency"])
            print(f"load: {len(latencies)} streams, p50 {latencies[len(latencies) // 2]:.2f} s, peak {peak}")
    finally:
        assert serve.stop() == 0
