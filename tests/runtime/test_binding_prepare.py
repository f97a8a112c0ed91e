"""runtime.instance: where a request's prompt is tokenized, and what a pre-warmed worker warms.

A short prompt is tokenized on the event loop (a thread hop costs more than it does when the
engine's threads hold the cores); a long one in a thread, so the loop keeps stepping the engine.
A real pool daemon holds the tiny model's weights."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_pool.client import PoolClient
from runtime.instance import INLINE_ENCODE_CHARS, ModelBinding, _warm_text, bind, load_template
from runtime.openai_api import RequestError, parse_request
from runtime.registry import RegisteredModel, register
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    home = tmp_path_factory.mktemp("prepare-home")
    write_tiny_gguf(home / "tiny.gguf", hf_weights(3))
    return register(str(home / "tiny.gguf"), "float32", home=home)


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


def encoding_threads(binding: ModelBinding, monkeypatch: pytest.MonkeyPatch, chars: int) -> tuple[int, int]:
    """(the event loop's thread, the thread that tokenized a chat prompt of ``chars`` characters)."""
    seen: list[int] = []
    encode = binding.encode

    def recording(*args: Any) -> list[int]:
        seen.append(threading.get_ident())
        return encode(*args)

    monkeypatch.setattr(binding, "encode", recording)
    body = {"messages": [{"role": "user", "content": "a" * chars}], "max_tokens": 1}

    async def run() -> int:
        # The tiny model's context (256 tokens) holds neither prompt: tokenized, then refused.
        with pytest.raises(RequestError, match="leaves no room"):
            await binding.prepare(parse_request(body, chat=True))
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(seen) == 1
    return loop_thread, seen[0]


def test_a_short_prompt_is_tokenized_on_the_event_loop(
    binding: ModelBinding, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread, encoded_in = encoding_threads(binding, monkeypatch, INLINE_ENCODE_CHARS)
    assert encoded_in == loop_thread


def test_a_long_prompt_is_tokenized_in_a_thread(
    binding: ModelBinding, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread, encoded_in = encoding_threads(binding, monkeypatch, INLINE_ENCODE_CHARS + 1)
    assert encoded_in != loop_thread


def test_warming_text_renders_and_tokenizes_with_or_without_a_chat_template(tiny: RegisteredModel) -> None:
    template = load_template(tiny.directory)
    _warm_text(template)  # the tiny model's own template
    template.chat._compiled = None  # a model without one: the plain text is tokenized instead
    _warm_text(template)
