"""Request side of structured outputs and tools: validation (400s naming the field), what the
prompt shows, and reading tool calls back out of text, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from runtime.openai_api import ChatRequest, RequestError, parse_request, parse_request_async
from runtime.openai_tool_stream import ToolCallSplitter
from runtime.openai_tools import (
    StructuredPlan,
    chat_messages,
    request_plan,
    split_calls,
    tool_message,
)
from runtime.structured import SchemaError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields: Any) -> ChatRequest:
    request = parse_request({"messages": USER, **fields}, chat=True)
    assert isinstance(request, ChatRequest)
    return request


def plan_of(**fields: Any) -> StructuredPlan | None:
    return request_plan(chat(**fields))


def test_plain_requests_have_no_plan() -> None:
    assert plan_of() is None
    assert plan_of(response_format={"type": "text"}) is None
    assert plan_of(tools=[WEATHER], tool_choice="none") is None


def test_response_formats_become_grammars() -> None:
    p = plan_of(response_format={"type": "json_object"})
    assert p is not None and p.spec is not None and p.spec.kind == "json_object" and not p.calls_tools
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = plan_of(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        }
    )
    assert p is not None and p.spec is not None and p.spec.kind == "json_schema"


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": True, "schema": {"if": {}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "strict": True, "parameters": {"type": "nope"}},
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tools": [WEATHER] * 65}, "tools"),
    ],
)
def test_bad_fields_are_400s_naming_them(fields: dict[str, Any], where: str) -> None:
    with pytest.raises(RequestError, match=f"^{where.replace('.', '[.]')}"):
        parse_request({"messages": USER, **fields}, chat=True)


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_inconsistent_tool_requests_are_schema_errors(fields: dict[str, Any], where: str) -> None:
    with pytest.raises(SchemaError) as info:
        plan_of(**fields)
    assert info.value.param == where


def test_tool_choices_pick_the_grammar() -> None:
    auto = plan_of(tools=[WEATHER])
    assert auto is not None and auto.mode == "auto" and auto.parallel
    assert auto.spec is not None and "TEXT" in auto.spec.grammar  # free text, or held-to-grammar calls
    required = plan_of(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert required is not None and required.spec is not None and not required.parallel
    named = plan_of(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named is not None and named.mode == "named" and named.spec is not None


def test_templates_without_tool_support_get_a_system_message() -> None:
    p = plan_of(tools=[WEATHER])
    history = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    messages, tools = chat_messages(history, p, template_tools=False)
    assert tools is None
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "tool", "content": "18 C"}
    same, tools = chat_messages(history, p, template_tools=True)
    assert same is history and tools == [WEATHER | {"function": {**WEATHER["function"]}}]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_are_split_out_of_text() -> None:
    p = plan_of(tools=[WEATHER])
    assert p is not None
    content, calls = split_calls(f"Let me look.\n{CALL}\n{CALL}", p)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather"] * 2
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert split_calls("<tool_call>\n{broken\n</tool_call>", p) == ("<tool_call>\n{broken\n</tool_call>", [])
    single = plan_of(tools=[WEATHER], parallel_tool_calls=False)
    assert single is not None and len(split_calls(f"{CALL}\n{CALL}", single)[1]) == 1
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": CALL}, "finish_reason": "stop"}]
    }
    choice = tool_message(body, p)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_splitting_matches_whole_splitting(size: int) -> None:
    p = plan_of(tools=[WEATHER])
    assert p is not None
    text = f"Sure <b>ok</b>\n{CALL}\n{CALL}"
    splitter = ToolCallSplitter(p)
    events = []
    for at in range(0, len(text), size):
        events += splitter.feed(text[at : at + size])
    events += splitter.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "call"]
    whole_content, whole_calls = split_calls(text, p)
    assert content.strip() == whole_content and [c.arguments for c in calls] == [
        c.arguments for c in whole_calls
    ]


def test_large_tool_schemas_compile_off_the_event_loop() -> None:
    """Validating the largest allowed tools compiles their schemas (most of a second): the
    worker's event loop, which drives every request's decode steps, keeps running meanwhile."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{j}",
                "parameters": {
                    "type": "object",
                    "properties": {f"k{j}_{i}": {"type": "integer"} for i in range(2000)},
                },
            },
        }
        for j in range(4)
    ]

    async def main() -> tuple[float, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        request = await parse_request_async({"messages": USER, "tools": tools}, chat=True)
        took = time.perf_counter() - t0
        done.set()
        await ticker
        assert isinstance(request, ChatRequest) and request.tools and len(request.tools) == 4
        return took, max(gaps)

    took, gap = asyncio.run(main())
    assert took > 0.1  # the work is real
    assert gap < max(took / 3, 0.05), (took, gap)
