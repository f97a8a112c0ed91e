"""Constrained decoding: grammars for JSON output and tool calls, applied as a token mask.

A request's output format (``response_format`` ``json_object`` / ``json_schema``, or a tool
call that ``tool_choice`` requires) becomes a :class:`~runtime.structured.spec.GrammarSpec`;
:class:`~runtime.structured.cache.GrammarCache` compiles it against the model's tokenizer
(cached per tokenizer and schema digest) and hands out one
:class:`~runtime.structured.constraint.Constraint` per sequence. Before each sampling step the
engine lets the constraint set every token the grammar forbids to ``-inf`` (in place); after
it, the sampled token advances the matcher, and the sequence finishes when the grammar is
complete. Requests without a format carry no constraint and pay nothing.

Grammar library: **llguidance** (Microsoft's Rust grammar engine, used by vLLM, SGLang and
llama.cpp). Chosen over xgrammar and outlines-core, measured here on SmolLM2's 49k vocabulary
(one CPU core, a 3-field object schema, 39 tokens):

* CPU mask per token: llguidance ~10 us median (its lazy lexer pays ~1.5 ms on the first
  mask of a grammar), xgrammar ~10 us, outlines-core ~60 us (it writes the whole mask from a
  precomputed index);
* compiling a schema: llguidance ~1 ms (no per-vocabulary precomputation), xgrammar ~20 ms,
  outlines-core ~25-40 ms, growing with the schema since its index is built eagerly;
* footprint: llguidance is one abi3 wheel (3 MB) with **no dependencies**; xgrammar requires
  torch, transformers, triton (hundreds of MB of GPU tooling) and apache-tvm-ffi; outlines-core
  has none but only turns schemas into regular expressions (no recursive schemas);
* upkeep: llguidance and xgrammar ship releases monthly; llguidance's JSON-schema coverage
  is the widest, and it reports unimplemented keywords instead of ignoring them, which is
  what ``strict`` needs (non-strict schemas compile leniently: such keywords are ignored).
"""

from __future__ import annotations

from runtime.structured.errors import GrammarError, SchemaError, StructuredError
from runtime.structured.spec import (
    GrammarSpec,
    ToolSpec,
    json_object_spec,
    json_schema_spec,
    tool_call_spec,
)

__all__ = [
    "GrammarError",
    "GrammarSpec",
    "SchemaError",
    "StructuredError",
    "ToolSpec",
    "json_object_spec",
    "json_schema_spec",
    "tool_call_spec",
]
