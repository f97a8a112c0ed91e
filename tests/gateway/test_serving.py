"""End to end: ember serve, deploy SmolLM2, the official OpenAI client, scale to zero, reuse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.spawn import ServeProcess
from runtime.server_timing import duration_ms
from tests.gateway.conftest import FUNCTIONS, chat_spec, instances, wait_for

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def metric(http: httpx.Client, name: str, function: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf'^{name}{{function="{function}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_openai_client_scale_to_zero_and_cold_start_from_resident_tensors(
    server: ServeProcess, http: httpx.Client
) -> None:
    assert http.post("/v1/functions", json=chat_spec("smollm2-chat", keep_alive="2s")).status_code == 201
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0)
    plain = client.chat.completions.create(
        model="smollm2-chat", messages=QUESTION, temperature=0, max_tokens=16
    )
    answer = plain.choices[0].message.content or ""
    assert "Paris" in answer
    assert plain.usage is not None and plain.usage.completion_tokens >= 1
    assert _cached(plain.usage) == 0  # the first request of this prompt anywhere
    stream = client.chat.completions.create(
        model="smollm2-chat", messages=QUESTION, temperature=0, max_tokens=16, stream=True
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer  # greedy: the same text either way
    assert chunks[-1].usage is not None and chunks[-1].choices[0].finish_reason in ("stop", "length")
    # The same prompt again: its full KV blocks come from the instance's prefix cache.
    cached = _cached(chunks[-1].usage)
    assert 0 < cached < plain.usage.prompt_tokens
    cluster = http.get("/v1/cluster").json()
    model = cluster["functions"]["smollm2-chat"]["model"]
    loaded_before = metric(http, "ember_cold_start_bytes_loaded_total", "smollm2-chat")
    reused_before = metric(http, "ember_cold_start_bytes_reused_total", "smollm2-chat")
    assert loaded_before == model["weight_bytes"]  # the first start loaded the model once

    wait_for(lambda: instances(http, "smollm2-chat") == [], timeout=30)  # keep-alive ran out
    wait_for(lambda: _resident(http, model["id"]) == model["weight_bytes"], timeout=10)

    again = client.chat.completions.create(
        model="smollm2-chat", messages=QUESTION, temperature=0, max_tokens=16
    )
    assert again.choices[0].message.content == answer
    # A new instance: the prefix KV the first one published stayed in the pool after it ended.
    assert _cached(again.usage) == cached
    (instance,) = instances(http, "smollm2-chat")
    assert int(instance["bytes_loaded"]) == 0 and int(instance["bytes_reused"]) == model["weight_bytes"]
    assert metric(http, "ember_cold_start_bytes_loaded_total", "smollm2-chat") == loaded_before
    assert (
        metric(http, "ember_cold_start_bytes_reused_total", "smollm2-chat")
        == reused_before + model["weight_bytes"]
    )
    assert metric(http, "ember_cold_starts_total", "smollm2-chat") == 2


def _cached(usage: Any) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` as the official client parsed it."""
    assert usage is not None and usage.prompt_tokens_details is not None
    return int(usage.prompt_tokens_details.cached_tokens)


def _resident(http: httpx.Client, model_id: str) -> int:
    devices = http.get("/v1/cluster").json()["devices"]
    return sum(int(d["models"].get(model_id, 0)) for d in devices.values())


def test_custom_handler_with_static_init(http: httpx.Client) -> None:
    document = json.loads(json.dumps(chat_spec("summarize")))
    document["spec"]["handler"] = f"{FUNCTIONS / 'summarize' / 'summarize.py'}:handler"
    assert http.post("/v1/functions", json=document).status_code == 201
    text = (
        "The Eiffel Tower, finished in 1889 for a world's fair, is the most visited paid monument in Paris."
    )
    out = http.post("/v1/functions/summarize/invoke", json={"text": text})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["summary"] and body["input_chars"] == len(text) and body["completion_tokens"] >= 1
    # The worker's own service time comes back through the gateway (W3C Server-Timing).
    service_ms = duration_ms(out.headers.get("server-timing"))
    assert service_ms is not None and 0 < service_ms < 60_000
    bad = http.post("/v1/functions/summarize/invoke", json={"txt": "typo"})
    assert bad.status_code == 400 and "text" in bad.json()["error"]["message"]
    logs = http.get("/v1/functions/summarize/logs").text
    assert "summarize: initialising" in logs  # the static initializer ran (once) in the instance


def test_cli_verbs(server: ServeProcess, http: httpx.Client) -> None:
    env = dict(os.environ, EMBER_HOME=str(server.home))
    root = Path(__file__).resolve().parents[2]

    def ember(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *args],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "deployed summarize" in ember("deploy", "-f", str(FUNCTIONS / "summarize" / "function.yaml"))
    assert "summarize" in ember("list")
    assert "keepAlive: 30s" in ember("describe", "summarize")  # defaults shown
    out = json.loads(ember("invoke", "summarize", "-d", json.dumps({"text": "Cats sleep most of the day."})))
    assert out["summary"]
    assert "Paris" in ember(
        "invoke", "smollm2-chat", "-p", "What is the capital of France?", "--max-tokens", "16"
    )
    streamed = ember("invoke", "smollm2-chat", "-p", "What is the capital of France?", "--stream")
    assert "Paris" in streamed
    status = ember("status")
    assert "device" in status and "function summarize" in status
    assert ember("logs", "summarize")
    assert "deleted summarize" in ember("delete", "summarize")
    wait_for(lambda: instances(http, "summarize") == [], timeout=30)  # its instances drained
    failed = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "describe", "summarize"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert failed.returncode == 1 and "function_not_found" in failed.stderr


COUNTING_HANDLER = """
import itertools

from runtime.sdk import init

_calls = itertools.count()


@init(static={static})
def setup(context):
    return next(_calls)


async def handler(event, context):
    done = await context.model.acomplete("1, 2, 3,", max_tokens=2, temperature=0)
    left = context.remaining_time()
    return {{"init_result": context.state, "tokens": done.completion_tokens, "left": left}}
"""


@pytest.mark.parametrize("static", [True, False])
def test_static_init_is_cached_dynamic_init_runs_per_request(
    http: httpx.Client, tmp_path: Path, static: bool
) -> None:
    module = tmp_path / f"counting_{static}.py"
    module.write_text(COUNTING_HANDLER.format(static=static))
    name = f"counting-{str(static).lower()}"
    document = chat_spec(name)
    document["spec"]["handler"] = f"{module}:handler"
    assert http.post("/v1/functions", json=document).status_code == 201
    results = [http.post(f"/v1/functions/{name}/invoke", json={}).json() for _ in range(3)]
    assert all(r["tokens"] == 2 and 0 < r["left"] <= 300 for r in results)
    seen = [r["init_result"] for r in results]
    assert seen == ([0, 0, 0] if static else [0, 1, 2])


def test_a_client_that_hangs_up_mid_stream_stops_the_workers_decoding(
    server: ServeProcess, http: httpx.Client
) -> None:
    """1,000 tokens take SmolLM2 ~10 s here; a client that reads a few and hangs up must leave
    the engine with nothing to decode at once, not after those 10 s."""
    from scheduler.redis_server import EmbeddedRedis
    from scheduler.state import ClusterState

    assert http.post("/v1/functions", json=chat_spec("hangup", keep_alive="60s")).status_code == 201
    body = {"model": "hangup", "messages": QUESTION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # then hang up
    (inst,) = instances(http, "hangup")
    state = ClusterState.from_url(EmbeddedRedis(server.home / "redis").url)
    try:
        token = state.r.hget(f"ember:instance:{inst['id']}", "token")
    finally:
        state.close()
    health = httpx.Client(base_url=inst["url"], headers={"x-ember-worker-token": str(token)}, timeout=10)
    with health:
        wait_for(lambda: health.get("/healthz").json()["num_sequences"] == 0, timeout=3.0)
