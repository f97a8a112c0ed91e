"""Issue 13 end to end: the official ``openai`` client (sync, async, streaming) against a real
``ember serve`` running a tiny random-weight Llama: content parts, the developer role, exact
output lengths, ``n`` with a seed, logprobs, ``echo`` and OpenAI's error objects."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.spawn import ServeProcess
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

pytestmark = pytest.mark.slow

NAME = "tiny-openai"
PARTS = [
    {"role": "developer", "content": "answer briefly"},
    {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("openai-model") / "tiny.gguf"
    write_tiny_gguf(path, hf_weights(11))
    return path


@pytest.fixture(scope="module")
def client(server: ServeProcess, gguf: Path) -> Iterator[openai.OpenAI]:
    spec = {
        "apiVersion": "ember.dev/v1",
        "kind": "Function",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"source": f"gguf:{gguf}", "dtype": "float32"},
            "scaling": {"maxScale": 1, "keepAlive": "120s", "concurrency": 8},
        },
    }
    with httpx.Client(base_url=server.url, timeout=120) as http:
        resp = http.post("/v1/functions", json=spec)
        assert resp.status_code == 201, resp.text
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0)


def test_content_parts_developer_role_and_exact_length(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=NAME,
        messages=PARTS,
        max_completion_tokens=7,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert done.usage is not None and done.usage.completion_tokens == 7
    assert done.choices[0].finish_reason == "length"


def test_n_choices_with_a_seed_are_reproducible(client: openai.OpenAI) -> None:
    def ask(n: int, seed: int) -> list[str]:
        done = client.chat.completions.create(
            model=NAME, messages=PARTS, n=n, seed=seed, temperature=1.0, max_tokens=6,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in done.choices] == list(range(n))
        assert done.usage is not None and done.usage.completion_tokens == 6 * n  # usage counts all choices
        return [c.message.content or "" for c in done.choices]

    first = ask(2, 7)
    assert ask(2, 7) == first
    assert ask(1, 8) == first[1:]  # choice i samples with seed + i


def test_chat_logprobs_sync_and_streamed(client: openai.OpenAI) -> None:
    common = {"model": NAME, "messages": PARTS, "temperature": 0, "max_tokens": 5, "logprobs": True,
              "top_logprobs": 3, "extra_body": {"ignore_eos": True}}  # fmt: skip
    done = client.chat.completions.create(**common)  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 5
    # Random weights emit arbitrary bytes: each token's text is its bytes, partial UTF-8 replaced.
    assert all(e.token == bytes(e.bytes or []).decode("utf-8", "replace") for e in entries)
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the top token
    stream = client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = [
        e
        for c in chunks
        for ch in c.choices
        if ch.logprobs and ch.logprobs.content
        for e in ch.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_completions_logprobs_with_echo(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model=NAME, prompt="hello there", max_tokens=3, logprobs=2, echo=True, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.text.startswith("hello there")
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert done.usage is not None
    assert len(lp.tokens) == done.usage.prompt_tokens + 3
    assert lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text


def test_async_client_and_stream(server: ServeProcess, client: openai.OpenAI) -> None:
    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        plain = await aclient.chat.completions.create(model=NAME, messages=PARTS, temperature=0, max_tokens=6)  # type: ignore[arg-type]
        stream = await aclient.chat.completions.create(
            model=NAME,
            messages=PARTS,
            temperature=0,
            max_tokens=6,
            stream=True,  # type: ignore[arg-type]
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await aclient.close()
        return plain.choices[0].message.content or "", text

    plain, streamed = asyncio.run(run())
    assert plain == streamed


def test_errors_are_openai_error_objects(client: openai.OpenAI) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=image)  # type: ignore[arg-type]
    assert caught.value.param == "messages.0.content.0.type"
    assert caught.value.code == "unsupported_parameter" and caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=PARTS, stop=["a", "b", "c", "d", "e"])  # type: ignore[arg-type]
    assert caught.value.param == "stop"
    # Choices that together could never fit the instance's KV quota (8 requests of the tiny
    # model's 256-token context) are refused up front instead of preempting each other forever.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=PARTS, n=16, max_tokens=200)  # type: ignore[arg-type]
    assert caught.value.param == "n" and "KV blocks" in caught.value.message
    fits = client.chat.completions.create(model=NAME, messages=PARTS, n=4, max_tokens=200)  # type: ignore[arg-type]
    assert len(fits.choices) == 4
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-function", messages=PARTS)  # type: ignore[arg-type]
    body = missing.value.body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body)


SDK_HANDLER = """
def handler(event, context):
    done = context.model.chat(
        [{"role": "developer", "content": "x"},
         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        n=2, seed=3, temperature=1.0, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=2,
    )
    text = context.model.complete("hello", max_tokens=2, logprobs=1, echo=True, temperature=0)
    return {
        "texts": [c.text for c in done.choices],
        "tokens": done.completion_tokens,
        "logprobs": [len(c.logprobs) for c in done.choices],
        "tops": [len(e.top_logprobs) for e in done.logprobs],
        "prompt_logprobs": [e.logprob for e in text.prompt_logprobs],
    }
"""


def test_the_sdk_takes_the_same_options(
    server: ServeProcess, gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    module = tmp_path_factory.mktemp("sdk") / "sdk_options.py"
    module.write_text(SDK_HANDLER)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        spec = {
            "apiVersion": "ember.dev/v1",
            "kind": "Function",
            "metadata": {"name": "tiny-sdk"},
            "spec": {
                "model": {"source": f"gguf:{gguf}", "dtype": "float32"},
                "handler": f"{module}:handler",
                "scaling": {"maxScale": 1, "keepAlive": "60s"},
            },
        }
        assert http.post("/v1/functions", json=spec).status_code == 201
        first = http.post("/v1/functions/tiny-sdk/invoke", json={}).json()
        again = http.post("/v1/functions/tiny-sdk/invoke", json={}).json()
    assert first["texts"] == again["texts"] and len(first["texts"]) == 2  # seeded: reproducible
    assert first["tokens"] == 8 and first["logprobs"] == [4, 4] and first["tops"] == [2] * 4
    assert first["prompt_logprobs"][0] is None and all(x <= 0 for x in first["prompt_logprobs"][1:])


def test_streamed_n_choices_and_streamed_echo_match_the_plain_answers(client: openai.OpenAI) -> None:
    chat = {"model": NAME, "messages": PARTS, "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 5,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.chat.completions.create(**chat)  # type: ignore[call-overload]
    texts = ["", ""]
    for chunk in client.chat.completions.create(**chat, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in plain.choices]
    text = {"model": NAME, "prompt": "hello there", "max_tokens": 3, "logprobs": 1, "echo": True,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    done = client.completions.create(**text)  # type: ignore[call-overload]
    chunks = list(client.completions.create(**text, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    tokens = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ]
    assert done.choices[0].logprobs is not None and tokens == done.choices[0].logprobs.tokens
