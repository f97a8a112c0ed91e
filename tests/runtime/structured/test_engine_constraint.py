"""The engine with per-sequence constraints: a tiny random-weight Llama (random logits), real
tokenizer, real batches. Constrained sequences finish when their grammar completes and always
parse; unconstrained sequences in the same batch are untouched."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from runtime.engine.build import PrivateKV, build_engine
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.engine.sequence import FinishReason
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.registry import RegisteredModel
from runtime.structured import SchemaError, ToolSpec, json_schema_spec, tool_call_spec
from runtime.structured.cache import GrammarCache
from tests.runtime.tiny_gguf import register_tiny

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    return register_tiny(tmp_path_factory.mktemp("tiny"))


def make_engine(reg: RegisteredModel) -> tuple[Engine, GrammarCache]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(reg.store_path).rglob("*.safetensors")):
        weights.update(load_file(str(f)))
    model = LlamaModel(LlamaConfig.from_hf(reg.config), weights)
    tok = Tokenizer.from_file(str(reg.directory / "tokenizer.json"))
    engine = build_engine(model, tok, {2}, PrivateKV(64), torch.float32, EngineConfig(4))
    return engine, GrammarCache(tok, {2})


def test_constrained_and_free_sequences_share_a_batch(tiny: RegisteredModel) -> None:
    engine, grammars = make_engine(tiny)
    free = SamplingParams(max_tokens=10, ignore_eos=True)
    solo = engine.generate([[5, 6, 7]], free)[0].output_ids
    spec = json_schema_spec(SCHEMA, strict=True)
    ids = [
        engine.add_request([5, 6, 7], free),
        *(
            engine.add_request(
                [9, 10 + i], SamplingParams(max_tokens=60, temperature=1.0, seed=i), grammars.constraint(spec)
            )
            for i in range(3)
        ),
    ]
    while engine.has_unfinished():
        engine.step()
    seqs = [engine.seqs[i] for i in ids]
    assert seqs[0].output_ids == solo  # the free sequence did not see the mask
    for seq in seqs[1:]:
        assert seq.finish_reason is FinishReason.STOP
        text = engine.text(seq.seq_id)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammar_cut_short_by_max_tokens_finishes_with_length(tiny: RegisteredModel) -> None:
    engine, grammars = make_engine(tiny)
    c = grammars.constraint(json_schema_spec(SCHEMA, strict=True))
    (seq,) = [engine.seqs[engine.add_request([4, 5], SamplingParams(max_tokens=3), c)]]
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_ids) == 3
    assert '{"ok": '.startswith(engine.text(seq.seq_id)[:7])  # a prefix of the grammar's output


def test_streamed_constrained_text_is_whole(tiny: RegisteredModel) -> None:
    """The token that completes the grammar ends the sequence with all its text (nothing held back)."""
    import asyncio

    engine, grammars = make_engine(tiny)
    only = {
        "type": "object",
        "properties": {"k": {"enum": ["ab"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    spec = json_schema_spec(only, True)

    async def run() -> tuple[str, FinishReason | None]:
        driver = asyncio.create_task(engine.run_forever())
        text, reason = "", None
        try:
            async for out in engine.stream([3, 4], SamplingParams(max_tokens=40), grammars.constraint(spec)):
                text += out.text_delta
                reason = out.finish_reason
        finally:
            driver.cancel()
        return text, reason

    text, reason = asyncio.run(run())
    assert reason is FinishReason.STOP, text
    assert json.loads(text) == {"k": "ab"}


def test_a_grammar_that_dead_ends_fails_only_its_own_request(tiny: RegisteredModel) -> None:
    """A schema whose $refs loop without producing a token passes validation but, once the
    output reaches the loop, leaves the matcher with no allowed token: that request fails,
    the others in its batch go on."""
    engine, grammars = make_engine(tiny)
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = engine.generate([[5, 6, 7]], free)[0].output_ids
    loop = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "required": ["a"],
        "additionalProperties": False,
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
    }
    spec = json_schema_spec(loop, strict=False)
    ids = [
        engine.add_request([5, 6, 7], free),
        engine.add_request([9, 10], SamplingParams(max_tokens=12), grammars.constraint(spec)),
        engine.add_request(
            [9, 11], SamplingParams(max_tokens=6), grammars.constraint(json_schema_spec(SCHEMA, True))
        ),
    ]
    while engine.has_unfinished():
        engine.step()
    free_seq, dead, good = (engine.seqs[i] for i in ids)
    assert free_seq.output_ids == solo and free_seq.finish_reason is FinishReason.LENGTH
    assert dead.finish_reason is FinishReason.ERROR and "grammar" in (dead.error or "")
    assert good.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and good.error is None


def test_a_grammar_that_allows_no_first_token_is_refused_naming_its_field(tiny: RegisteredModel) -> None:
    _, grammars = make_engine(tiny)
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    with pytest.raises(SchemaError) as info:
        grammars.constraint(json_schema_spec(loop, strict=False))
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(SchemaError) as info:
        grammars.constraint(json_schema_spec({"$ref": "#"}, strict=True, param="tools.0.function.parameters"))
    assert info.value.param == "tools.0.function.parameters"
    # Inside a tool-call grammar the loop is reached only after the call's opening tokens:
    # each tool's parameters are probed alone, so the error still names that tool.
    tools = [
        ToolSpec("ok", {"type": "object"}, "tools.0.function.parameters"),
        ToolSpec("loop", {"$ref": "#"}, "tools.1.function.parameters"),
    ]
    with pytest.raises(SchemaError) as info:
        grammars.constraint(tool_call_spec(tools, parallel=False))
    assert info.value.param == "tools.1.function.parameters"
