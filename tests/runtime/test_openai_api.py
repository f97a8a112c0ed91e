"""Which OpenAI request fields a worker accepts (issue 10): none is silently ignored.

Fields Ember does not implement are 400s naming the field unless they carry their "not
used" value; unknown keys are 400s (as OpenAI answers); identifiers and cache hints, which
cannot change a response, are accepted. The HTTP side (a real worker answering these as
400s) is in ``test_worker_guard.py``; ``include_usage`` streaming in ``test_worker.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.openai_api import ChatRequest, RequestError, choice_params, parse_request, sampling_params

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
        ("best_of", 2),
        ("suffix", "tail"),
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
        {"n": 1, "store": False, "best_of": 1, "suffix": ""},
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
        ({"Temperature": 0.5}, "Temperature"),
        ({"echo": True}, "echo"),  # a completions field in a chat request
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
    assert request.messages[0].for_template() == {"role": "assistant", "content": "hi"}
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


# ----- issue 13: content parts, roles, sampling and output fields --------------------------


def test_content_parts_and_every_role_render_through_the_template() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    request = parse_request({"messages": messages}, chat=True)
    assert isinstance(request, ChatRequest)
    rendered = request.template_messages()
    assert rendered[1] == {"role": "user", "content": "a\nb"}
    assert rendered[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert rendered[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    ("message", "where"),
    [
        ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
         r"^messages\.0\.content\.1\.type: Ember does not implement content parts of type 'image_url'"),
        ({"role": "user", "content": None}, r"^messages\.0\.content: Field required"),
        ({"role": "user"}, r"^messages\.0\.content: Field required"),
        ({"role": "tool", "content": "x"}, r"^messages\.0\.tool_call_id: Field required"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, r"^messages\.0: Value error, a tool message"),
        ({"role": "user", "content": [{"type": "text"}]}, r"^messages\.0\.content\.0\.text: Field required"),
        ({"role": "user", "content": [{"type": "text", "text": "x"}] * 257},
         r"^messages\.0\.content: more than"),
        ({"role": "critic", "content": "x"}, r"^messages\.0\.role"),
    ],
)  # fmt: skip
def test_bad_messages_are_400s_naming_the_place(message: dict[str, Any], where: str) -> None:
    with pytest.raises(RequestError, match=where) as caught:
        parse_request({"messages": [message]}, chat=True)
    assert caught.value.param is not None and caught.value.param.startswith("messages.0")


def test_part_type_error_carries_param_and_code() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}
    with pytest.raises(RequestError) as caught:
        parse_request(body, chat=True)
    assert (caught.value.param, caught.value.code) == ("messages.0.content.0.type", "unsupported_parameter")


def test_sampling_fields_reach_the_sampler() -> None:
    body = {
        **CHAT,
        "n": 3,
        "seed": 2**64 - 2,
        "stop": ["a", "b", "c", "d"],
        "logit_bias": {"5": -100, "7": 2.5},
        "top_k": 40,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "max_completion_tokens": 5,
    }
    request = parse_request(body, chat=True)
    params = sampling_params(request, prompt_len=4, max_context=64, default_max=32, vocab_size=10)
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (40, 0.1, 1.2, 2)
    assert params.logit_bias == ((5, -100.0), (7, 2.5))
    assert (params.logprobs, params.prompt_logprobs, params.max_tokens) == (3, None, 5)
    assert request.n == 3 and params.stop == ("a", "b", "c", "d")
    # Choice i samples with seed + i, wrapping within what torch.Generator takes.
    assert [choice_params(params, i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert sampling_params(parse_request({**CHAT, "top_k": -1}, True), 4, 64, 32).top_k == 0


def test_completion_logprobs_and_echo() -> None:
    request = parse_request({**PROMPT, "logprobs": 2, "echo": True}, chat=False)
    params = sampling_params(request, prompt_len=4, max_context=64, default_max=32)
    assert (params.logprobs, params.prompt_logprobs) == (2, 2)
    plain = sampling_params(parse_request({**PROMPT, "echo": True}, False), 4, 64, 32)
    assert (plain.logprobs, plain.prompt_logprobs) == (None, None)  # echo alone needs no logits
    assert choice_params(params, 1).prompt_logprobs is None  # the prompt's are computed once


@pytest.mark.parametrize(
    ("extra", "chat", "where"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, True, r"^stop:"),
        ({"stop": [""]}, True, r"^stop"),
        ({"n": 0}, True, r"^n:"),
        ({"n": 17}, True, r"^n:"),
        ({"n": True}, True, r"^n:"),
        ({"logprobs": 6}, False, r"^logprobs:"),
        ({"logprobs": 1}, True, r"^logprobs:"),  # chat's is a boolean
        ({"top_logprobs": 21, "logprobs": True}, True, r"^top_logprobs:"),
        ({"top_logprobs": 2}, True, r"^top_logprobs: only allowed when logprobs is true$"),
        ({"logit_bias": {"5": 101}}, True, r"^logit_bias\.5:"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, True, r"^logit_bias:"),
        ({"min_p": 1.5}, True, r"^min_p:"),
        ({"repetition_penalty": 0}, True, r"^repetition_penalty:"),
        ({"top_k": -2}, True, r"^top_k:"),
        ({"min_tokens": -1}, True, r"^min_tokens:"),
    ],
)
def test_bad_sampling_fields_are_400s(extra: dict[str, Any], chat: bool, where: str) -> None:
    with pytest.raises(RequestError, match=where):
        parse_request({**(CHAT if chat else PROMPT), **extra}, chat)


@pytest.mark.parametrize("key", ["10", "-1", "x", "1e3", "٣", "99999999999"])
def test_logit_bias_ids_are_checked_against_the_vocabulary(key: str) -> None:
    request = parse_request({**CHAT, "logit_bias": {key: 1}}, chat=True)
    with pytest.raises(RequestError, match=r"^logit_bias: .* is not a token id of this model") as caught:
        sampling_params(request, prompt_len=4, max_context=64, default_max=32, vocab_size=10)
    assert caught.value.param == "logit_bias"


def test_min_tokens_beyond_max_tokens_is_a_400() -> None:
    request = parse_request({**CHAT, "min_tokens": 9, "max_tokens": 8}, chat=True)
    with pytest.raises(RequestError, match=r"^min_tokens:"):
        sampling_params(request, prompt_len=4, max_context=64, default_max=32)
