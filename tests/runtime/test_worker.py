"""A worker process serving a tiny registered model over HTTP, weights and KV in a real pool."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpu_pool.client import PoolClient
from runtime.registry import RegisteredModel
from runtime.worker_guard import TOKEN_HEADER
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import register_tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    return register_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def served(tiny: RegisteredModel, tmp_path: Path) -> Iterator[tuple[str, PoolProcess, dict[str, str]]]:
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.store_path,))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--name", "tiny", "--model-dir", str(tiny.directory),
         "--pool-socket", pool.socket_path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        ready = json.loads(line)
        yield ready["url"], pool, {TOKEN_HEADER: ready["token"]}  # the worker's credential
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        pool.stop()


def test_chat_completion_plain_and_streaming(served: tuple[str, PoolProcess, dict[str, str]]) -> None:
    url, pool, auth = served
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        plain = http.post("/v1/chat/completions", json=body).json()
        assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] >= 1
        text = plain["choices"][0]["message"]["content"]
        chunks = []
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
        assert chunks[-1] == "[DONE]"
        events = [json.loads(c) for c in chunks[:-1]]
        assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert streamed == text  # greedy: same text either way
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in events[-1]
        completion = http.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0}
        ).json()
        assert completion["object"] == "text_completion"
    with PoolClient(pool.socket_path) as observer:
        assert observer.stats()["pinned_bytes"] > 0  # the worker holds its weights


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "context"),
        ({"prompt": ""}, "empty"),
    ],
)
def test_bad_requests_are_400s(
    served: tuple[str, PoolProcess, dict[str, str]], body: dict[str, object], needle: str
) -> None:
    url, _, auth = served
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
        resp = http.post(path, json=body)
        assert resp.status_code == 400
        assert needle in resp.json()["error"]["message"]
        broken = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"


def test_stream_options_include_usage_as_the_openai_client_reads_it(
    served: tuple[str, PoolProcess, dict[str, str]],
) -> None:
    """``stream_options: {"include_usage": true}``: every chunk has ``usage: null`` and one last
    chunk with no choices carries it (what the official client's users read usage from)."""
    url, _, auth = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", default_headers=auth, max_retries=0)
    messages: Any = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    *content, last = chunks
    assert last.choices == [] and last.usage is not None and plain.usage is not None
    assert last.usage.model_dump(exclude_none=True) == plain.usage.model_dump(exclude_none=True)
    assert all(c.usage is None and len(c.choices) == 1 for c in content)
    assert content[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in content) == plain.choices[0].message.content
    legacy = client.completions.create(
        model="tiny", prompt="abc", max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    *_, end = list(legacy)
    assert end.choices == [] and end.usage is not None and end.usage.prompt_tokens >= 1


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    served: tuple[str, PoolProcess, dict[str, str]],
) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm always sends it): with
    ``include_usage`` every chunk carries the usage so far, and the last one the total."""
    url, _, auth = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", default_headers=auth, max_retries=0)
    messages: Any = [{"role": "user", "content": "hello"}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    *content, last = list(stream)
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in content if c.usage is not None]
    assert len(counts) == len(content) and counts == sorted(counts) and counts[-1] == 6
