"""Which OpenAI request fields a worker accepts (issue 10): none is silently ignored.

Fields Ember does not implement are 400s naming the field unless they carry their "not
used" value; unknown keys are 400s (as OpenAI answers); identifiers and cache hints, which
cannot change a response, are accepted. The HTTP side (a real worker answering these as
400s) is in ``test_worker_guard.py``; ``include_usage`` streaming in ``test_worker.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.openai_api import RequestError, parse_request, sampling_params

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}]}
PROMPT: dict[str, Any] = {"prompt": "hello"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "high"),
        ("reasoning_effort", "none"),
        ("verbosity", "low"),
        ("service_tier", "flex"),
        ("service_tier", "priority"),
        ("store", True),
        ("web_search_options", {}),
        ("moderation", {"input": {"mode": "block"}}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("n", 2),
        ("n", True),  # not the integer 1
        ("logprobs", 0),  # legacy completions: the sampled token's logprob
    ],
)
def test_fields_ember_does_not_implement_are_named(field: str, value: Any) -> None:
    for body, chat in ((CHAT, True), (PROMPT, False)):
        with pytest.raises(RequestError, match=rf"^{field}: Ember does not implement this field$"):
            parse_request({**body, field: value}, chat)


@pytest.mark.parametrize("field", ["tools", "tool_choice", "response_format"])
def test_chat_only_fields_are_400s_on_completions(field: str) -> None:
    """Structured outputs and tools are chat fields (runtime.openai_tools): refused on completions."""
    value = {"tools": [], "tool_choice": "auto", "response_format": {"type": "json_object"}}[field]
    with pytest.raises(RequestError, match=rf"^{field}: unrecognized request field$"):
        parse_request({**PROMPT, field: value}, chat=False)


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 1, "store": False, "logprobs": False, "top_logprobs": 0, "echo": False},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"reasoning_effort": None, "verbosity": None, "audio": None, "tools": [], "logit_bias": {}},
        {"user": "u-1", "safety_identifier": "hash", "metadata": {"team": "a", "run": "7"}},
        {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "1h"}},
        {"parallel_tool_calls": True},
    ],
)
def test_fields_that_cannot_change_the_response_are_accepted(extra: dict[str, Any]) -> None:
    parse_request({**CHAT, **extra}, chat=True)


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"top_k": 40}, "top_k"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"Temperature": 0.5}, "Temperature"),
        ({"prompt": "x"}, "prompt"),  # a completion's field in a chat request
    ],
)
def test_unknown_fields_are_400s_naming_them(extra: dict[str, Any], where: str) -> None:
    with pytest.raises(RequestError, match=rf"^{where}: unrecognized request field$"):
        parse_request({**CHAT, **extra}, chat=True)
    with pytest.raises(RequestError, match="messages: unrecognized"):
        parse_request({**PROMPT, "messages": CHAT["messages"]}, chat=False)


def test_message_keys_are_checked_too() -> None:
    replayed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": [], "name": None}
    request = parse_request({"messages": [replayed, {"role": "user", "content": "again"}]}, chat=True)
    assert request.messages[0].model_dump(exclude_none=True) == {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [],
    }
    named = {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}
    with pytest.raises(RequestError, match=r"^messages\.0\.name: Ember does not implement this field$"):
        parse_request(named, chat=True)
    odd = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "weight": 2}]}
    with pytest.raises(RequestError, match=r"^messages\.1\.weight: unrecognized request field$"):
        parse_request(odd, chat=True)


def test_identifiers_are_bounded() -> None:
    with pytest.raises(RequestError, match=r"^user:"):
        parse_request({**CHAT, "user": "u" * 513}, chat=True)
    with pytest.raises(RequestError, match=r"^user:"):
        parse_request({**CHAT, "user": 7}, chat=True)
    with pytest.raises(RequestError, match=r"^metadata"):
        parse_request({**CHAT, "metadata": {f"k{i}": "v" for i in range(17)}}, chat=True)


def test_stream_options() -> None:
    streamed = {**CHAT, "stream": True}
    assert parse_request({**streamed, "stream_options": {"include_usage": True}}, chat=True).include_usage
    assert not parse_request(streamed, chat=True).include_usage
    assert not parse_request({**streamed, "stream_options": None}, chat=True).include_usage
    plain = parse_request({**PROMPT, "stream": True, "stream_options": {"include_obfuscation": False}}, False)
    assert not plain.include_usage
    with pytest.raises(RequestError, match=r"^stream_options: only allowed when stream is true$"):
        parse_request({**CHAT, "stream_options": {"include_usage": True}}, chat=True)
    with pytest.raises(RequestError, match=r"^stream_options\.include_obfuscation: Ember does not implement"):
        parse_request({**streamed, "stream_options": {"include_obfuscation": True}}, chat=True)
    with pytest.raises(RequestError, match=r"^stream_options\.chunk_size: unrecognized request field$"):
        parse_request({**streamed, "stream_options": {"chunk_size": 4}}, chat=True)
    with pytest.raises(RequestError, match=r"^stream_options\.include_usage:"):
        parse_request({**streamed, "stream_options": {"include_usage": "yes"}}, chat=True)


def test_ignore_eos_reaches_the_sampler() -> None:
    """vLLM's ``ignore_eos`` extension (benchmarks decode a fixed token count with it) was a 400."""
    for body, chat in ((CHAT, True), (PROMPT, False)):
        request = parse_request({**body, "ignore_eos": True, "max_tokens": 8}, chat)
        assert sampling_params(request, prompt_len=4, max_context=64, default_max=32).ignore_eos
        plain = parse_request(body, chat)
        assert not sampling_params(plain, prompt_len=4, max_context=64, default_max=32).ignore_eos
    with pytest.raises(RequestError, match=r"^ignore_eos:"):
        parse_request({**CHAT, "ignore_eos": "yes"}, chat=True)
