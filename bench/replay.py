"""Replay a workload trace against a real ``ember serve`` over the OpenAI API (issue 15).

:class:`Replay` starts one ``ember serve`` (its own ``EMBER_HOME``, a CPU pool with the arena
and model-importance policy of the configuration), deploys one function per zoo model through
``POST /v1/functions``, then sends each :class:`bench.workload.Arrival` at its time as a
streamed ``/v1/chat/completions`` request on its own connection, from a thread pool so slow
answers never delay later arrivals (open loop, as production traffic is). Meanwhile a poller
reads ``/v1/cluster`` every :data:`POLL_S` and keeps every instance it sees, with what its
start measured (``bytes_loaded``, ``bytes_reused``, ``start_ms``): instances live at least a
keep-alive (>= 1 s), so none is missed. The result is the raw material of ``bench/trace.py``:
one :class:`RequestResult` per arrival, one :class:`ColdStart` per instance, and the pool's
counters at the end.

The serving home's ``models/`` is a hard-linked copy of the zoo's registrations, so deploys
find their models registered already (registration is idempotent by content hash) and no
configuration pays for it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.openai_stream import http_client, sse_chunks
from bench.workload import Arrival, Trace
from bench.zoo import Zoo, ZooModel, function_spec
from gateway.spawn import ServeProcess
from runtime.device_report import read_stats

POLL_S = 0.1  # /v1/cluster poll period: well under the shortest keep-alive the bench uses
MAX_CONCURRENT = 64  # requests in flight at once from the replayer (more are queued)
REQUEST_TIMEOUT_S = 300.0
# Public-domain words (Alice's Adventures in Wonderland, ch. 1): ~1 token each with the
# SmolLM2 tokenizer, so a prompt of N words is about N prompt tokens plus the chat template.
_TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank and of having "
    "nothing to do once or twice she had peeped into the book her sister was reading but it had "
    "no pictures or conversations in it and what is the use of a book thought Alice without "
    "pictures or conversations"
)


def prompt_text(num_tokens: int, salt: int) -> str:
    """About ``num_tokens`` words of text, starting at a place given by ``salt`` (so two
    requests do not share a long prefix, which would hit the prefix cache)."""
    vocabulary = _TEXT.split(" ")
    start = salt % len(vocabulary)
    words = [vocabulary[(start + i) % len(vocabulary)] for i in range(max(1, num_tokens))]
    return f"Request {salt}: " + " ".join(words)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One arrival as the client saw it (times in seconds; ``ttft_s`` None when it failed)."""

    index: int
    function: str
    scheduled_s: float  # the arrival's time in the trace
    sent_s: float  # when it was actually sent, from the replay's start
    prompt_tokens: int | None  # the server's usage figure
    completion_tokens: int
    ttft_s: float | None
    total_s: float
    error: str | None


@dataclass(frozen=True, slots=True)
class ColdStart:
    """One instance the poller saw: which function, and what its start measured."""

    instance_id: str
    function: str
    first_seen_s: float
    bytes_loaded: int
    bytes_reused: int
    start_ms: float


@dataclass(frozen=True, slots=True)
class ReplayResult:
    requests: tuple[RequestResult, ...]
    cold_starts: tuple[ColdStart, ...]
    wall_s: float
    pool: dict[str, Any]  # the pool's stats at the end (bytes loaded, reused, moved, ...)


class Replay:
    """One configuration: ``ember serve`` with ``env`` on top of the zoo; use as a context."""

    def __init__(self, zoo: Zoo, home: Path, env: Mapping[str, str], keep_alive: str) -> None:
        self.zoo = zoo
        self.home = home
        self.keep_alive = keep_alive
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True)
        # Hard links: the registrations are immutable once renamed into place.
        subprocess.run(["cp", "-al", str(zoo.home / "models"), str(home / "models")], check=True)
        full_env = {"EMBER_MODEL_ROOTS": str(zoo.root), **env}
        self.server = ServeProcess(home, env=full_env)
        self.http = httpx.Client(base_url=self.server.url, timeout=120.0)

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        status = self.server.stop()
        if status != 0 and exc[0] is None:
            tail = self.server.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"ember serve exited with {status}:\n{tail}")

    def deploy(self, models: tuple[ZooModel, ...]) -> None:
        """Deploy one function per model (registration found in the linked store)."""
        for model in models:
            spec = function_spec(model, keep_alive=self.keep_alive)
            r = self.http.post("/v1/functions", json=spec)
            if r.status_code != 201:
                raise RuntimeError(f"deploy of {model.name} failed: HTTP {r.status_code}: {r.text[:500]}")

    def cluster(self) -> dict[str, Any]:
        r = self.http.get("/v1/cluster")
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def wait_ready(self, prewarm: int, timeout_s: float = 300.0) -> None:
        """Until ``prewarm`` pre-warmed workers are ready and none is starting (a fresh
        ``ember serve`` starts them in the background: a trace must not begin against that)."""
        deadline = time.monotonic() + timeout_s
        while True:
            devices = list(self.cluster()["devices"].values())
            if devices and all(
                int(d.get("warm_workers", 0)) >= prewarm and not int(d.get("starting_workers", 0))
                for d in devices
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{prewarm} pre-warmed workers not ready after {timeout_s:.0f} s: {devices}"
                )
            time.sleep(0.2)

    def run(self, trace: Trace, functions: list[str]) -> ReplayResult:
        """Send every arrival of ``trace`` at its time (``functions[a.function]`` names its
        function) and collect what happened; returns once every request ended."""
        seen: dict[str, ColdStart] = {}
        stop = threading.Event()
        t0 = time.perf_counter()

        def poll() -> None:
            with httpx.Client(base_url=self.server.url, timeout=30.0) as client:
                while not stop.is_set():
                    try:
                        functions_now = client.get("/v1/cluster").json()["functions"]
                    except (httpx.HTTPError, ValueError):
                        time.sleep(POLL_S)
                        continue
                    now = time.perf_counter() - t0
                    for name, fn in functions_now.items():
                        for inst in fn["instances"]:
                            if inst["id"] in seen or inst.get("state") != "ready" or "start_ms" not in inst:
                                continue
                            seen[inst["id"]] = ColdStart(
                                inst["id"], name, now, int(inst["bytes_loaded"]),
                                int(inst["bytes_reused"]), float(inst["start_ms"]),
                            )  # fmt: skip
                    stop.wait(POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        futures = []
        try:
            with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
                for index, arrival in enumerate(trace.arrivals):
                    delay = arrival.t_s - (time.perf_counter() - t0)
                    if delay > 0:
                        time.sleep(delay)
                    futures.append(pool.submit(self._one, index, arrival, functions[arrival.function], t0))
                results = [f.result() for f in futures]
            wall = time.perf_counter() - t0
            time.sleep(2 * POLL_S)  # the last instances' records
        finally:  # also on an error: the poller must not outlive the replay (or its server)
            stop.set()
            poller.join()
        # From the pool itself: device reports are up to a second old.
        return ReplayResult(tuple(results), tuple(seen.values()), wall, read_stats(self.server.pool_socket))

    def _one(self, index: int, arrival: Arrival, function: str, t0: float) -> RequestResult:
        sent = time.perf_counter()
        body = {
            "model": function,
            "messages": [{"role": "user", "content": prompt_text(arrival.prompt_tokens, index)}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": arrival.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        ttft: float | None = None
        usage: dict[str, Any] = {}
        chunks = 0
        error: str | None = None
        try:
            with (
                http_client(REQUEST_TIMEOUT_S) as client,
                client.stream(
                    "POST",
                    self.server.url + "/v1/chat/completions",
                    content=json.dumps(body).encode(),
                    headers={"content-type": "application/json"},
                ) as r,
            ):
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                for chunk in sse_chunks(r, function):
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    choices = chunk.get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - sent
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        total = time.perf_counter() - sent
        if error is None and ttft is None:
            error = "the stream carried no content"
        prompt = usage.get("prompt_tokens")
        return RequestResult(
            index, function, arrival.t_s, sent - t0, int(prompt) if prompt is not None else None,
            int(usage.get("completion_tokens") or chunks), ttft if error is None else None, total, error,
        )  # fmt: skip
