"""LangChain's ChatOpenAI against a real ``ember serve``: invoke, stream, structured output, tools.

LangChain is what many applications put between themselves and "an OpenAI-compatible server":
it sends ``max_completion_tokens`` (not ``max_tokens``), ``stream_options`` only when asked for
usage, ``response_format: json_schema`` (strict) for ``with_structured_output`` and replays an
assistant message with ``tool_calls`` plus a ``tool`` message for a tool round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import add_ai_message_chunks
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from gateway.spawn import ServeProcess
from tests.gateway.conftest import chat_spec

pytestmark = pytest.mark.slow

FUNCTION = "lc-chat"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 64  # room for a tool call with its wrapper tokens


class City(BaseModel):
    """A city named in the text."""

    name: str = Field(description="the city's name")
    country: str = Field(description="the country the city is in")


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 degrees Celsius in {city}."


def merge(chunks: list[Any]) -> AIMessageChunk:
    """A stream's chunks added up, as LangChain adds them."""
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    return add_ai_message_chunks(chunks[0], *chunks[1:])


@pytest.fixture(scope="module")
def deployed(server: ServeProcess) -> str:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        answer = http.post("/v1/functions", json=chat_spec(FUNCTION, keep_alive="120s"))
        assert answer.status_code == 201, answer.text
    return FUNCTION


@pytest.fixture
def llm(server: ServeProcess, deployed: str) -> Iterator[ChatOpenAI]:
    yield ChatOpenAI(
        model=deployed,
        base_url=f"{server.url}/v1",
        api_key="unused-on-loopback",
        temperature=0,
        max_tokens=MAX_TOKENS,  # sent as max_completion_tokens
        max_retries=0,
        timeout=120,
    )


def test_invoke_with_system_message(llm: ChatOpenAI) -> None:
    answer = llm.invoke([SystemMessage("Answer in one short sentence."), HumanMessage(QUESTION)])
    assert isinstance(answer, AIMessage) and "Paris" in answer.text
    usage = answer.usage_metadata
    assert usage is not None and 1 <= usage["output_tokens"] <= MAX_TOKENS
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_async_invoke_matches_sync(llm: ChatOpenAI) -> None:
    sync = llm.invoke(QUESTION)
    async_ = asyncio.run(llm.ainvoke(QUESTION))
    assert async_.text == sync.text  # greedy: the same text either way


def test_stream_with_usage(llm: ChatOpenAI) -> None:
    whole = llm.invoke(QUESTION)
    chunks = list(llm.stream(QUESTION, stream_usage=True))
    assert "".join(c.text for c in chunks) == whole.text
    merged = merge(chunks)
    assert merged.usage_metadata is not None and merged.usage_metadata == whole.usage_metadata


def test_with_structured_output_json_schema(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(City, method="json_schema", strict=True, include_raw=True)
    out = structured.invoke("Extract the city: Paris is the capital of France.")
    assert isinstance(out, dict) and out["parsing_error"] is None, out
    city = out["parsed"]
    assert isinstance(city, City) and city.name and city.country
    # Constrained decoding: the raw text itself is the schema's JSON, nothing around it.
    assert City.model_validate_json(out["raw"].text) == city


def test_bind_tools_round_trip(llm: ChatOpenAI) -> None:
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    question = HumanMessage("What is the weather like in Paris right now?")
    call = forced.invoke([question])
    assert isinstance(call, AIMessage) and call.response_metadata["finish_reason"] == "tool_calls"
    assert not call.invalid_tool_calls
    (tool_call,) = call.tool_calls  # parallel_tool_calls defaults to true, but one is asked for
    assert tool_call["name"] == "get_weather" and isinstance(tool_call["args"]["city"], str)
    assert tool_call["id"]
    result = get_weather.invoke(tool_call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == tool_call["id"]
    # The round trip: the assistant's tool call and the tool's answer go back to the model.
    final = llm.bind_tools([get_weather], tool_choice="none").invoke([question, call, result])
    assert isinstance(final, AIMessage) and final.text and not final.tool_calls
    assert final.response_metadata["finish_reason"] in ("stop", "length")


def test_bind_tools_streamed_tool_call(llm: ChatOpenAI) -> None:
    forced = llm.bind_tools([get_weather], tool_choice="required", strict=True)
    merged = merge(list(forced.stream("What is the weather like in Paris right now?")))
    assert merged.response_metadata.get("finish_reason") == "tool_calls"
    # The arguments arrive in pieces, as OpenAI streams them; merged they parse.
    assert not merged.invalid_tool_calls
    assert merged.tool_calls  # required: at least one call (parallel calls allowed)
    for tool_call in merged.tool_calls:
        assert tool_call["name"] == "get_weather" and isinstance(tool_call["args"]["city"], str)
        assert tool_call["id"]
