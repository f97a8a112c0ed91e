"""What output a request must produce, as an llguidance grammar (no tokenizer needed yet).

Schemas are bounded (:data:`MAX_SCHEMA_BYTES`, :data:`MAX_SCHEMA_DEPTH`) and checked here,
before any tokenizer work, so a bad one is a 400 naming the field. JSON is generated in one
fixed layout (``", "`` between items, ``": "`` after keys, no other whitespace): a model
cannot stall a request on endless whitespace, and the output is what ``json.dumps`` writes.

Tool calls use one generic text format, the one Hermes/Qwen-style chat templates use and
that :mod:`runtime.openai_tools` describes to models whose template has no tool support::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several calls, when parallel calls are allowed, separated by one newline).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from runtime.structured.errors import SchemaError

MAX_SCHEMA_BYTES = 64 * 1024  # of the schema as compact JSON
MAX_SCHEMA_DEPTH = 32  # nested objects/arrays of the schema document itself
TOOL_CALL_TAG, TOOL_CALL_END_TAG = "<tool_call>", "</tool_call>"  # a call's block (generic format)
TOOL_CALL_OPEN = TOOL_CALL_TAG + "\n"  # as the grammar emits it
TOOL_CALL_CLOSE = "\n" + TOOL_CALL_END_TAG
# Fixed layout of generated JSON (see the module docstring); strict schemas compile with
# unimplemented keywords as errors, non-strict ones leniently (those keywords are ignored).
_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A grammar in llguidance's serialized form, and its digest (the cache key)."""

    kind: str  # "json_object", "json_schema" or "tool_calls"
    grammar: str
    param: str = "response_format"  # the request field it came from, for errors
    # Grammars compiled (and probed) before this one, so an error names its own field: each
    # tool's parameters, for a tool-call grammar.
    checks: tuple[GrammarSpec, ...] = ()
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "tool_calls"):
            raise ValueError(f"unknown grammar kind {self.kind!r}")
        object.__setattr__(self, "digest", hashlib.sha256(self.grammar.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function a tool call may name, with its JSON-schema ``parameters``."""

    name: str
    parameters: dict[str, Any]
    param: str  # where the parameters came from in the request, for errors
    strict: bool = True  # unimplemented schema keywords: an error (else ignored)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tool needs a name")


def check_schema(schema: Any, param: str) -> str:
    """``schema`` as compact JSON after the size, depth and type checks; :class:`SchemaError`."""
    if not isinstance(schema, dict):
        raise SchemaError(param, "a JSON schema must be an object")
    _check_depth(schema, param)
    text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    if len(text) > MAX_SCHEMA_BYTES:
        raise SchemaError(param, f"the schema has {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are allowed")
    return text


def _check_depth(schema: dict[str, Any], param: str) -> None:
    # Iterative: a deeply nested document must not exhaust Python's stack before it is refused.
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _validated(grammar: str, param: str) -> str:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise SchemaError(param, f"cannot be enforced: {error.strip()[:500]}")
    return grammar


def _schema_grammar(schema: dict[str, Any], strict: bool, param: str) -> str:
    from llguidance import LLMatcher

    check_schema(schema, param)
    try:
        options: Any = {**_LAYOUT, "lenient": not strict}  # llguidance's JsonCompileOptions
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        raise SchemaError(param, str(exc)) from None
    return _validated(grammar, param)


def json_object_spec() -> GrammarSpec:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return GrammarSpec("json_object", _schema_grammar({"type": "object"}, True, "response_format"))


def json_schema_spec(
    schema: dict[str, Any], strict: bool, param: str = "response_format.json_schema.schema"
) -> GrammarSpec:
    """JSON valid against ``schema``; with ``strict`` every keyword must be enforceable."""
    return GrammarSpec("json_schema", _schema_grammar(schema, strict, param), param)


def closed_arguments(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's ``parameters`` as its calls are decoded: an object schema that lists its
    properties and says nothing of others gets ``additionalProperties: false`` at the top.

    JSON Schema allows unlisted properties by default, and a small model held to such a schema
    kept inventing arguments until ``max_tokens`` ran out. Every call decoded this way is still
    valid against the tool's own schema (xgrammar decodes the same way by default)."""
    schema = parameters or {"type": "object"}
    open_ended = "additionalProperties" in schema or "patternProperties" in schema
    if schema.get("type") == "object" and "properties" in schema and not open_ended:
        return {**schema, "additionalProperties": False}
    return schema


# Keywords whose values are JSON data, not subschemas: a "$ref" key inside them is data.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rerooted(node: Any, root: str) -> Any:
    """``node`` with every local ``$ref`` (``#...``) made relative to ``root``, the JSON pointer
    where the schema now sits inside a larger one."""
    if isinstance(node, list):
        return [_rerooted(v, root) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rerooted(value, root)
    return out


def call_schema(tool: ToolSpec, root: str = "#") -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` in the generic format, placed at the JSON
    pointer ``root`` of the grammar's schema.

    A tool's parameters are a schema document of their own: their local ``$ref`` s
    (``#/$defs/Address``, what pydantic and the OpenAI SDK's ``pydantic_function_tool``
    write) point into that document, so they are rewritten to where it now sits
    (``properties/arguments`` of the call).
    """
    arguments = _rerooted(closed_arguments(tool.parameters), f"{root}/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_spec(tools: list[ToolSpec], parallel: bool, allow_text: bool = False) -> GrammarSpec:
    """One tool call (or, with ``parallel``, one or more) of any of ``tools``, in the generic
    format, whose arguments are valid against the named tool's parameters.

    ``allow_text`` (``tool_choice: auto``): free text is allowed too, as long as it does not
    open with a ``<tool_call>`` block, even after whitespace (a regular-expression
    complement); an output that opens with one is held to the call grammar from its first
    token.
    """
    if not tools:
        raise ValueError("tool_call_spec needs at least one tool")
    from llguidance import LLMatcher

    calls = []
    checks = []
    for i, tool in enumerate(tools):
        check_schema(tool.parameters, tool.param)
        # Each tool's parameters are compiled alone first, so an error names that tool.
        alone = _schema_grammar(tool.parameters or {"type": "object"}, tool.strict, tool.param)
        checks.append(GrammarSpec("json_schema", alone, tool.param))
        calls.append(call_schema(tool, "#" if len(tools) == 1 else f"#/anyOf/{i}"))
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    lenient = not all(t.strict for t in tools)
    body = json.dumps({**schema, "x-guidance": {**_LAYOUT, "lenient": lenient}})
    repeat = ' ("\\n" call)*' if parallel else ""
    text = " | TEXT\nTEXT: /(?s:.*)/ & ~/(?s:\\s*<tool_call>.*)/" if allow_text else ""
    lark = (
        f"start: call{repeat}{text}\n"
        f"call: {json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}\n"
        f"body: %json {body}\n"
    )
    grammar = _validated(LLMatcher.grammar_from_lark(lark), "tools")
    return GrammarSpec("tool_calls", grammar, "tools", tuple(checks))
