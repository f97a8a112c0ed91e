"""runtime.instance: where a request's prompt is tokenized, and what a pre-warmed worker warms.

A short prompt is rendered and tokenized on the event loop (a thread hop costs more than that
when the engine's threads hold the cores); a long one, many messages or tool calls in a thread,
and a long text is tokenized with the GIL released, so the loop keeps stepping the engine
meanwhile. Everything a template renders counts against the context before tokenizing. A real
pool daemon holds the tiny model's weights."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_pool.client import PoolClient
from runtime.chat import ChatTemplate, ChatTemplateError
from runtime.instance import (
    INLINE_ENCODE_CHARS,
    INLINE_MESSAGES,
    ModelBinding,
    _warm_text,
    bind,
    load_template,
)
from runtime.openai_api import RequestError, parse_request
from runtime.registry import RegisteredModel
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import register_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    return register_tiny(tmp_path_factory.mktemp("prepare"))


@pytest.fixture
def binding(tiny: RegisteredModel, tmp_path: Path) -> Iterator[ModelBinding]:
    pool = PoolProcess(tmp_path / "pool.sock", "8MiB", store=(tiny.directory.parent,))
    try:
        with PoolClient(pool.socket_path) as client:
            bound = bind(load_template(tiny.directory), client, 64)
            try:
                yield bound
            finally:
                bound.engine.close()
    finally:
        pool.stop()


def encoding_threads(
    binding: ModelBinding, monkeypatch: pytest.MonkeyPatch, messages: list[dict[str, Any]]
) -> tuple[int, int]:
    """(the event loop's thread, the thread that tokenized a chat request of ``messages``)."""
    seen: list[int] = []
    encode = binding.encode

    def recording(*args: Any) -> list[int]:
        seen.append(threading.get_ident())
        return encode(*args)

    monkeypatch.setattr(binding, "encode", recording)
    body = {"messages": messages, "max_tokens": 1}

    async def run() -> int:
        # The tiny model's context (256 tokens) holds none of these prompts: tokenized, refused.
        with pytest.raises(RequestError, match="leaves no room"):
            await binding.prepare(parse_request(body, chat=True))
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(seen) == 1
    return loop_thread, seen[0]


def user(chars: int) -> dict[str, Any]:
    return {"role": "user", "content": "a" * chars}


def test_a_short_prompt_is_tokenized_on_the_event_loop(
    binding: ModelBinding, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread, encoded_in = encoding_threads(binding, monkeypatch, [user(INLINE_ENCODE_CHARS)])
    assert encoded_in == loop_thread


@pytest.mark.parametrize(
    "messages",
    [
        [user(INLINE_ENCODE_CHARS + 1)],
        [user(300)] + [{"role": "assistant", "content": ""}, user(0)] * INLINE_MESSAGES,
        [
            user(300),
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"},
        ],
    ],
    ids=["long", "many-messages", "tool-calls"],
)
def test_other_prompts_are_tokenized_in_a_thread(
    binding: ModelBinding, monkeypatch: pytest.MonkeyPatch, messages: list[dict[str, Any]]
) -> None:
    loop_thread, encoded_in = encoding_threads(binding, monkeypatch, messages)
    assert encoded_in != loop_thread


def test_a_long_text_is_tokenized_with_the_gil_released(binding: ModelBinding) -> None:
    """Counted by a pure-Python thread, which runs only while no other thread holds the GIL:
    tokenizing ~0.4 s of text, it must keep running (the tokenizer's encode would stop it)."""
    text = "a b c d 12345 " * 30_000
    ticks: list[float] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        t0 = time.perf_counter()
        ids = binding.encode_text(text)
        t1 = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    assert ids == binding.template.tokenizer.encode(text, add_special_tokens=False).ids
    span = t1 - t0
    during = sum(1 for t in ticks if t0 + span / 4 < t < t1 - span / 4)  # well inside the call
    assert during > 100, f"{during} ticks in the middle half of a {span * 1e3:.0f} ms tokenization"


def test_everything_a_template_renders_counts_against_the_context(
    binding: ModelBinding, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tool-call names and ids count too: a request of long names is refused before tokenizing."""
    calls = [{"id": "i" * 500, "function": {"name": "n" * 256, "arguments": "{}"}} for _ in range(64)]
    body = {"messages": [user(1), {"role": "assistant", "tool_calls": calls}], "max_tokens": 1}
    encoded: list[object] = []
    monkeypatch.setattr(binding, "encode", lambda *args: encoded.append(args))
    with pytest.raises(RequestError, match="far more than fit"):
        asyncio.run(binding.prepare(parse_request(body, chat=True)))
    assert encoded == []


def test_any_failure_of_a_template_is_a_chat_template_error() -> None:
    failing = ChatTemplate("{{ 1 // (messages | length - 1) }}", {})  # one message: division by 0
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        failing.render([{"role": "user", "content": "hi"}])


def test_warming_text_never_stops_a_worker(tiny: RegisteredModel) -> None:
    template = load_template(tiny.directory)
    _warm_text(template)  # the tiny model's own template
    failing = ChatTemplate("{{ 1 // (messages | length - 1) }}", {})  # fails for one message
    _warm_text(dataclasses.replace(template, chat=failing))
    _warm_text(dataclasses.replace(template, chat=ChatTemplate(None, {})))  # none: the plain text
