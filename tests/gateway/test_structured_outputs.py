"""End to end through ``ember serve`` with the official OpenAI client: structured outputs
(``chat.completions.parse`` with a pydantic model), tool calling (call -> tool result ->
answer), streamed tool calls, and a 400 naming an unenforceable schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gateway.spawn import ServeProcess
from tests.gateway.conftest import chat_spec

pytestmark = pytest.mark.slow

FUNCTION = "smollm2-structured"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Capital(BaseModel):
    country: str = Field(max_length=24)
    city: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=10000)


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Iterator[openai.OpenAI]:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/functions", json=chat_spec(FUNCTION, keep_alive="60s")).status_code == 201
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0) as c:
        yield c


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=FUNCTION,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=64,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Capital)
    # The same through the client's older ``beta`` namespace, which code written for it still calls.
    beta = client.beta.chat.completions.parse(
        model=FUNCTION,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=64,
    )
    assert beta.choices[0].message.parsed == choice.message.parsed  # greedy: the same answer
    # json_object mode: any object, parsed by the client as JSON.
    raw = client.chat.completions.create(
        model=FUNCTION,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=3,
        max_tokens=200,
    )
    if raw.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(raw.choices[0].message.content or ""), dict)


def test_tool_calling_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=FUNCTION,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMS)
    history: list[Any] = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(
        model=FUNCTION,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=24,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_named_tool_call_streams_as_openai_does(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=FUNCTION,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=64,
        stream=True,
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert (
        calls[0].index == 0 and calls[0].id and calls[0].function and calls[0].function.name == "get_weather"
    )
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
    assert deltas[-1].finish_reason == "tool_calls"
    assert not any(d.delta.content for d in deltas)


def test_an_unenforceable_strict_schema_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=FUNCTION,
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "strict": True,
                    "schema": {"type": "object", "if": {"type": "object"}},
                },
            },
            max_tokens=8,
        )
    assert "response_format.json_schema.schema" in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_answers_text_or_valid_calls(client: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": FUNCTION,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 48,
    }
    if stream:
        deltas = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(d.delta.content or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
        reason = deltas[-1].finish_reason
        by_index: dict[int, str] = {}
        for tc in calls:
            by_index[tc.index] = by_index.get(tc.index, "") + (
                tc.function.arguments or "" if tc.function else ""
            )
        arguments = list(by_index.values())
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, reason = choice.message.content or "", choice.finish_reason
        arguments = [tc.function.arguments for tc in choice.message.tool_calls or [] if tc.type == "function"]
    if arguments:
        assert reason in ("tool_calls", "length")
        for a in arguments:
            jsonschema.validate(json.loads(a), WEATHER_PARAMS)
    else:
        assert text and "<tool_call>" not in text.lstrip()[:11] and reason in ("stop", "length")


SDK_HANDLER = """
async def handler(event, context):
    done = await context.model.achat(
        [{"role": "user", "content": "Name a colour."}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": %s}},
        temperature=0,
        max_tokens=48,
    )
    return {"text": done.text, "finish_reason": done.finish_reason}
"""
COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "maxLength": 7}},
    "required": ["colour", "hex"],
    "additionalProperties": False,
}


def test_sdk_chat_honours_response_format(server: ServeProcess, tmp_path: Path) -> None:
    """context.model.achat(response_format=...) is constrained as the HTTP route is."""
    module = tmp_path / "colour_handler.py"
    module.write_text(SDK_HANDLER % repr(COLOUR))
    document = chat_spec("sdk-structured")
    document["spec"]["handler"] = f"{module}:handler"
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/functions", json=document).status_code == 201
        result = http.post("/v1/functions/sdk-structured/invoke", json={}).json()
    assert result.get("finish_reason") == "stop", result
    jsonschema.validate(json.loads(result["text"]), COLOUR)
