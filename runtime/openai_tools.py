"""OpenAI structured outputs and tool calling on the request side: the request fields
(``response_format``, ``tools``, ``tool_choice``), what the prompt shows the model, which
grammar constrains decoding, and how tool calls are read back out of the generated text.

* ``response_format``: ``text`` (as before), ``json_object`` (any JSON object) and
  ``json_schema`` (``{name, schema, strict}``): decoding is constrained by a grammar
  (:mod:`runtime.structured`) so the content always parses, and validates against the schema.
  ``strict: true`` refuses (400 naming ``response_format.json_schema.schema``) a schema with
  a keyword the grammar engine cannot enforce; otherwise such keywords are ignored.
* ``tools`` (``type: function``; at most :data:`MAX_TOOLS`) are rendered into the prompt: a
  chat template that reads ``tools`` gets them; any other template gets them described in a
  system message, in the generic format below (SmolLM2's template has no tool support).
* ``tool_choice``: ``none`` (tools are not shown and no call is made), ``auto`` (the model
  chooses: free text, or, once its output opens with ``<tool_call>``, decoding is held to
  calls whose arguments are valid; ``<tool_call>`` blocks later in a text answer are read as
  calls when they parse), ``required`` and a named function (decoding is constrained to calls
  whose arguments are valid against the function's ``parameters``).
  ``parallel_tool_calls: false`` allows one call.

Generic tool-call format (Hermes/Qwen style), one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Assistant messages that carry ``tool_calls`` are replayed in that format, and ``tool``
messages keep their role (the template renders them as any other turn).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from runtime.structured import (
    GrammarSpec,
    SchemaError,
    ToolSpec,
    json_object_spec,
    json_schema_spec,
    tool_call_spec,
)
from runtime.structured.spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_TOOLS = 64
MAX_TOOLS_BYTES = 256 * 1024  # all tool definitions together, as JSON
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_EXAMPLE = '{"name": "<function name>", "arguments": {<the arguments as JSON>}}'
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(None, max_length=8192)
    strict: StrictBool | None = None  # declared before schema: its validator reads it
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @field_validator("schema_")
    @classmethod
    def _enforceable(cls, schema: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if schema is not None:
            try:
                json_schema_spec(schema, bool(info.data.get("strict")))
            except SchemaError as exc:
                raise ValueError(exc.reason) from None
        return schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _needs_type(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("only allowed with type json_schema")
        return value

    def spec(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return json_object_spec()
        if self.type == "json_schema":
            if self.json_schema is None:
                raise SchemaError("response_format.json_schema", "required with type json_schema")
            if self.json_schema.schema_ is None:
                return json_object_spec()
            return json_schema_spec(self.json_schema.schema_, bool(self.json_schema.strict))
        return None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(None, max_length=8192)
    strict: StrictBool | None = None  # before parameters: its validator reads it
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _enforceable(cls, params: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if params is not None:
            try:
                json_schema_spec(params, bool(info.data.get("strict")), "parameters")
            except SchemaError as exc:
                raise ValueError(exc.reason) from None
        return params


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class StructuredPlan:
    """What one chat request asks of its output: the grammar (None: free text) and the tools."""

    spec: GrammarSpec | None
    tools: tuple[dict[str, Any], ...]  # OpenAI-shaped definitions shown to the model
    mode: Literal["none", "auto", "required", "named"]
    parallel: bool
    names: frozenset[str]

    @property
    def calls_tools(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.mode != "none" and bool(self.tools)


def plan(
    response_format: ResponseFormat | None,
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
) -> StructuredPlan | None:
    """The plan for a chat request, None when it asks for plain text; :class:`SchemaError`
    names the offending field."""
    fmt = response_format.spec() if response_format is not None else None
    if not tools:
        if tool_choice not in (None, "none"):
            raise SchemaError("tool_choice", "only allowed when tools are given")
        return None if fmt is None else StructuredPlan(fmt, (), "none", False, frozenset())
    defs = tuple(t.model_dump(exclude_none=True) for t in tools)
    if len(json.dumps(defs)) > MAX_TOOLS_BYTES:
        raise SchemaError("tools", f"the tool definitions exceed {MAX_TOOLS_BYTES} bytes")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise SchemaError("tools", "function names must be unique")
    choice = tool_choice or "auto"
    parallel = parallel_tool_calls is not False
    if choice == "none":
        return None if fmt is None else StructuredPlan(fmt, (), "none", False, frozenset())
    if fmt is not None:
        raise SchemaError("response_format", "cannot be combined with tools unless tool_choice is none")
    specs = [
        ToolSpec(
            t.function.name,
            t.function.parameters or {},
            f"tools.{i}.function.parameters",
            bool(t.function.strict),
        )
        for i, t in enumerate(tools)
    ]
    if isinstance(choice, NamedToolChoice):
        chosen = [s for s in specs if s.name == choice.function.name]
        if not chosen:
            raise SchemaError("tool_choice.function.name", f"no tool is named {choice.function.name!r}")
        return StructuredPlan(tool_call_spec(chosen, False), defs, "named", False, frozenset(names))
    if choice == "required":
        return StructuredPlan(tool_call_spec(specs, parallel), defs, "required", parallel, frozenset(names))
    auto = tool_call_spec(specs, parallel, allow_text=True)
    return StructuredPlan(auto, defs, "auto", parallel, frozenset(names))


def request_plan(request: object) -> StructuredPlan | None:
    """The plan of a parsed chat request (None for completions and plain chat)."""
    return plan(
        getattr(request, "response_format", None),
        getattr(request, "tools", None),
        getattr(request, "tool_choice", None),
        getattr(request, "parallel_tool_calls", None),
    )


def describe_tools(tools: tuple[dict[str, Any], ...]) -> str:
    """The system-message text that offers ``tools`` to a model whose template has no tool
    support (the generic format of the module docstring)."""
    lines = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You can call these functions (each given with the JSON schema of its parameters):\n"
        f"{lines}\n"
        "To call a function, answer with only this, one block per call:\n"
        f"{TOOL_CALL_OPEN}{_EXAMPLE}{TOOL_CALL_CLOSE}"
    )


def _replay(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with ``tool_calls`` as text in the generic format."""
    blocks = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = fn.get("arguments")
        # As they came: escaped, one emoji would render as 12 characters (ChatRequest.chars).
        body = json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}")
    text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return {"role": "assistant", "content": text}


def chat_messages(
    messages: list[dict[str, Any]], plan: StructuredPlan | None, template_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument to render a request with; ``template_tools``:
    the chat template renders tools itself."""
    offered = plan is not None and plan.calls_tools
    if template_tools:
        return messages, list(plan.tools) if plan is not None and offered else None
    out = [_replay(m) if m.get("role") == "assistant" and m.get("tool_calls") else m for m in messages]
    out = [
        {k: v for k, v in m.items() if k in ("role", "content")} | {"content": m.get("content") or ""}
        for m in out
    ]
    if plan is not None and offered:
        text = describe_tools(plan.tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out |= {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out


def read_call(block: str, names: frozenset[str]) -> ToolCall | None:
    """The call in one ``<tool_call>`` block's body, None when it is not a call of a tool."""
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(data["name"]), json.dumps(arguments))


def split_calls(text: str, plan: StructuredPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output: text outside the blocks is the content (None
    when only calls remain); blocks that are not calls of an offered tool stay text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        call = read_call(match.group(1), plan.names)
        if call is None or (calls and not plan.parallel):
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else text, calls


def tool_message(body: dict[str, Any], plan: StructuredPlan) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body with its calls as ``tool_calls`` when the
    output made any (``finish_reason: tool_calls``, or ``length`` when max_tokens ended it)."""
    for choice in body["choices"]:  # n choices: each read for its own calls
        content, calls = split_calls(choice["message"]["content"] or "", plan)
        if calls:  # complete calls are returned even when max_tokens cut a later one short
            message = {"role": "assistant", "content": content, "tool_calls": [c.body() for c in calls]}
            choice["message"] = message
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
    return body
