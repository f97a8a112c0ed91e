"""Streaming a chat completion whose output may hold tool calls, as OpenAI streams them.

Text outside ``<tool_call>`` blocks streams as ``delta.content`` (a tail that may begin a
block is held back); each complete block that is a call of an offered tool becomes
``delta.tool_calls``: first ``{index, id, type, function: {name, arguments: ""}}``, then the
arguments (one fragment: a call is only known to be one when its block is complete). A stream
that made calls ends with ``finish_reason: tool_calls``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from runtime.engine.engine import StepOutput
from runtime.engine.scheduler import RequestFailed
from runtime.errors import error_body
from runtime.openai_response import sse_event, usage_body
from runtime.openai_tools import StructuredPlan, ToolCall, read_call
from runtime.structured.spec import TOOL_CALL_END_TAG, TOOL_CALL_TAG

OPEN, CLOSE = TOOL_CALL_TAG, TOOL_CALL_END_TAG


class ToolCallSplitter:
    """Feeds on text deltas; yields ``("content", text)`` and ``("call", ToolCall)`` events."""

    def __init__(self, plan: StructuredPlan) -> None:
        self.plan = plan
        self.text = ""
        self.pos = 0  # text before this is handled
        self.pending = ""  # whitespace-only content, emitted once real text follows it
        self.calls = 0

    def _content(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        if not self.pending.strip():
            return []
        out, self.pending = self.pending, ""
        return [("content", out)]

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self.text += delta
        events: list[tuple[str, Any]] = []
        while True:
            start = self.text.find(OPEN, self.pos)
            if start < 0:
                hold = next((k for k in range(len(OPEN) - 1, 0, -1) if self.text.endswith(OPEN[:k])), 0)
                events += self._content(self.text[self.pos : len(self.text) - hold])
                self.pos = len(self.text) - hold
                return events
            end = self.text.find(CLOSE, start)
            if end < 0:
                events += self._content(self.text[self.pos : start])
                self.pos = start
                return events
            block = self.text[start + len(OPEN) : end]
            call = read_call(block.strip(), self.plan.names)
            if call is None or (self.calls and not self.plan.parallel):
                events += self._content(self.text[self.pos : end + len(CLOSE)])
            else:
                if self.text[self.pos : start].strip():
                    events += self._content(self.text[self.pos : start])
                self.pending = ""
                events.append(("call", call))
                self.calls += 1
            self.pos = end + len(CLOSE)

    def finish(self) -> list[tuple[str, Any]]:
        """What is left (an unterminated block is text) once the output is complete."""
        rest = self.text[self.pos :]
        self.pos = len(self.text)
        return self._content(rest) if rest.strip() or not self.calls else []


async def tool_sse_chunks(
    stream: AsyncIterator[StepOutput],
    rid: str,
    model: str,
    prompt_tokens: int,
    plan: StructuredPlan,
    include_usage: bool = False,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """OpenAI ``chat.completion.chunk`` events for a request offered tools, then ``[DONE]``
    (usage as :func:`runtime.openai_api.sse_chunks` reports it)."""
    created = int(time.time())
    n = cached = 0
    splitter = ToolCallSplitter(plan)

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        body["choices"] = choices
        if usage is not None or include_usage:
            body["usage"] = usage
        return sse_event(body)

    def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
        report = continuous_usage or (reason and not include_usage)
        usage = usage_body(prompt_tokens, n, cached) if report else None
        return event([{"index": 0, "delta": delta, "finish_reason": reason}], usage)

    def render(events: list[tuple[str, Any]]) -> list[bytes]:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(chunk({"content": value}))
            else:
                call: ToolCall = value
                index = _index(out_calls, call)
                head = {"index": index, "id": call.id, "type": "function"}
                out.append(chunk({"tool_calls": [head | {"function": {"name": call.name, "arguments": ""}}]}))
                out.append(
                    chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
                )
        return out

    out_calls: list[str] = []
    yield chunk({"role": "assistant", "content": None})
    try:
        async for out in stream:
            n += 1
            cached = out.cached_tokens
            for data in render(splitter.feed(out.text_delta)):
                yield data
            if out.finish_reason is not None:
                for data in render(splitter.finish()):
                    yield data
                reason = out.finish_reason.value
                if out_calls and reason == "stop":
                    reason = "tool_calls"
                yield chunk({}, reason)
    except RequestFailed as exc:
        yield sse_event(error_body(exc.code, str(exc)))
    else:
        if include_usage:
            yield event([], usage_body(prompt_tokens, n, cached))
    yield sse_event("[DONE]")


def _index(seen: list[str], call: ToolCall) -> int:
    """The stream index of ``call`` (its order among the calls streamed so far)."""
    seen.append(call.id)
    return len(seen) - 1
