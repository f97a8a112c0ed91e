"""Constrained decoding on SmolLM2's tokenizer: every output from random logits parses and
validates against its schema; masks are applied in place; the grammar cache is bounded."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from runtime.structured import (
    SchemaError,
    ToolSpec,
    json_object_spec,
    json_schema_spec,
    tool_call_spec,
)
from runtime.structured.cache import GrammarCache
from runtime.structured.spec import MAX_SCHEMA_DEPTH, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

EOS = 2
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "tools.0.function.parameters",
)


def decode(grammars: GrammarCache, tok: Tokenizer, spec: Any, seed: int, limit: int = 160) -> str:
    """Sample from random logits under ``spec`` until the grammar completes."""
    c = grammars.constraint(spec)
    g = torch.Generator().manual_seed(seed)
    # Ending and closing tokens are favoured, so random walks finish (nesting stays shallow).
    closing = [EOS] + [i for t in ("}", "]", '"', '"}', '"]', "}}") if (i := tok.token_to_id(t)) is not None]
    out: list[int] = []
    for step in range(2 * limit):
        logits = torch.randn(grammars.vocab_size, generator=g)
        # Past ``limit`` the walk is steered hard to closing tokens, so every output completes.
        logits[closing] += 6.0 if step < limit else 60.0
        c.mask_logits(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        assert c.accept(token), c.error
        out.append(token)
        if c.terminated:
            break
    assert c.terminated, "the grammar did not complete within the limit"
    return str(tok.decode([t for t in out if t != EOS], skip_special_tokens=True))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31))
def test_random_logits_give_schema_valid_json(
    grammars: GrammarCache, smollm2_tokenizer: Tokenizer, seed: int
) -> None:
    text = decode(grammars, smollm2_tokenizer, json_schema_spec(PERSON, strict=True), seed)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # one fixed layout


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31))
def test_json_object_mode_gives_an_object(
    grammars: GrammarCache, smollm2_tokenizer: Tokenizer, seed: int
) -> None:
    text = decode(grammars, smollm2_tokenizer, json_object_spec(), seed, limit=300)
    assert isinstance(json.loads(text), dict)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31))
def test_tool_call_arguments_validate_against_parameters(
    grammars: GrammarCache, smollm2_tokenizer: Tokenizer, seed: int
) -> None:
    other = ToolSpec("noop", {"type": "object", "properties": {}, "additionalProperties": False}, "tools.1")
    text = decode(grammars, smollm2_tokenizer, tool_call_spec([WEATHER, other], parallel=False), seed)
    assert text.startswith(TOOL_CALL_OPEN) and text.endswith(TOOL_CALL_CLOSE)
    call = json.loads(text[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])
    tool = {"get_weather": WEATHER, "noop": other}[call["name"]]
    jsonschema.validate(call["arguments"], tool.parameters)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31))
def test_tool_calls_invent_no_arguments_the_parameters_do_not_list(
    grammars: GrammarCache, smollm2_tokenizer: Tokenizer, seed: int
) -> None:
    """A non-strict schema without additionalProperties: a call holds only the listed arguments
    (a model was seen adding made-up ones until max_tokens); it still validates."""
    loose = ToolSpec(
        "lookup",
        {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}},
        "tools.0",
        strict=False,
    )
    text = decode(grammars, smollm2_tokenizer, tool_call_spec([loose], parallel=False), seed)
    arguments = json.loads(text[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])["arguments"]
    assert set(arguments) <= {"q"}
    jsonschema.validate(arguments, loose.parameters)


# What openai.pydantic_function_tool (and LangChain's bind_tools) send for a nested model:
# local $refs into the parameters' own $defs.
SHIP = ToolSpec(
    "ship",
    {
        "$defs": {
            "Addr": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Addr"}, "kg": {"type": "integer"}},
        "required": ["to", "kg"],
        "additionalProperties": False,
    },
    "tools.0.function.parameters",
)


@pytest.mark.parametrize("others", [[], [WEATHER]], ids=["one-tool", "two-tools"])
def test_tool_parameters_with_local_refs(
    grammars: GrammarCache, smollm2_tokenizer: Tokenizer, others: list[ToolSpec]
) -> None:
    spec = tool_call_spec([SHIP, *others], parallel=False)
    for seed in range(3):
        text = decode(grammars, smollm2_tokenizer, spec, seed)
        call = json.loads(text[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])
        tool = {"ship": SHIP, "get_weather": WEATHER}[call["name"]]
        jsonschema.validate(call["arguments"], tool.parameters)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_is_applied_in_place_and_forbids_padding_rows(
    grammars: GrammarCache, dtype: torch.dtype
) -> None:
    c = grammars.constraint(json_schema_spec(PERSON, strict=True))
    batch = torch.zeros(2, grammars.vocab_size + 64, dtype=dtype)  # a model may pad its output rows
    c.mask_logits(batch[1])
    allowed = torch.isfinite(batch[1]).nonzero().flatten().tolist()
    assert allowed == c.allowed().tolist()
    assert 0 < len(allowed) < 100  # only tokens that can open the object
    assert batch[1, grammars.vocab_size :].eq(-math.inf).all()
    assert batch[0].eq(0).all()  # the other sequence's row is untouched


def test_cache_reuses_compiled_grammars_and_is_bounded(smollm2_tokenizer: Tokenizer) -> None:
    cache = GrammarCache(smollm2_tokenizer, {EOS}, capacity=2)
    spec = json_schema_spec(PERSON, strict=True)
    assert cache.compiled(spec) is cache.compiled(spec)
    for n in range(3):
        cache.compiled(
            json_schema_spec({"type": "object", "properties": {f"k{n}": {"type": "integer"}}}, True)
        )
    assert len(cache) == 2
    # Copies are independent: one sequence's progress does not move another's.
    a, b = cache.constraint(spec), cache.constraint(spec)
    assert a.accept(int(a.allowed()[0]))
    assert len(b.allowed()) == len(cache.constraint(spec).allowed())


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "Unimplemented keys"),
        ({"type": "frobnicate"}, "Invalid type"),
        ({"type": "string", "pattern": "(unclosed"}, "regex"),
        ([1, 2], "must be an object"),
    ],
)
def test_unenforceable_strict_schemas_are_typed_errors_naming_the_field(schema: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message) as info:
        json_schema_spec(schema, strict=True)
    assert info.value.param == "response_format.json_schema.schema"


def test_non_strict_schemas_ignore_unimplemented_keywords() -> None:
    assert json_schema_spec({"type": "object", "if": {"type": "object"}}, strict=False).kind == "json_schema"


def test_schema_size_and_depth_are_bounded() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaError, match="deeper"):
        json_schema_spec(deep, strict=True)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(SchemaError, match="bytes"):
        json_schema_spec(wide, strict=True)


def test_tool_parameter_errors_name_the_tool() -> None:
    bad = ToolSpec("f", {"type": "object", "not": {"type": "null"}, "if": {}}, "tools.3.function.parameters")
    with pytest.raises(SchemaError) as info:
        tool_call_spec([bad], parallel=True)
    assert info.value.param == "tools.3.function.parameters"


@pytest.mark.parametrize(
    ("text", "allowed"),
    [
        ("The weather in Paris is sunny today.", True),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
            True,
        ),
        ('  <tool_call>\n{"name": "get_wea', False),  # a call opens the output or is not one
        ('<tool_call>\n{"name": "nope"', False),  # once a call opens, it must name a tool
        ('\n<tool_call>\n{"city": 1}', False),
    ],
)
def test_auto_tool_choice_allows_text_but_holds_calls_to_the_grammar(
    grammars: GrammarCache, smollm2_tokenizer: Tokenizer, text: str, allowed: bool
) -> None:
    c = grammars.constraint(tool_call_spec([WEATHER], parallel=True, allow_text=True))
    ok = True
    for token in smollm2_tokenizer.encode(text, add_special_tokens=False).ids:
        if token not in set(c.allowed().tolist()):
            ok = False
            break
        assert c.accept(token)
    assert ok is allowed
