"""Function spec bounds: every numeric field has an upper bound, YAML is bounded in depth and nodes."""

from __future__ import annotations

import time

import pytest

from scheduler.spec import MAX_YAML_NODES, SpecError, parse_function, parse_function_yaml


def spec(**body: object) -> dict[str, object]:
    return {
        "apiVersion": "ember.dev/v1",
        "kind": "Function",
        "metadata": {"name": "bounded"},
        "spec": {"model": {"source": "gguf:/m.gguf"}, **body},
    }


@pytest.mark.parametrize(
    ("body", "field", "limit"),
    [
        ({"scaling": {"maxScale": 257}}, "spec.scaling.maxScale", 256),
        ({"scaling": {"minScale": 257, "maxScale": 256}}, "spec.scaling.minScale", 256),
        ({"scaling": {"concurrency": 1025}}, "spec.scaling.concurrency", 1024),
        ({"maxTokens": 131073}, "spec.maxTokens", 131072),
        ({"maxTokens": 10**30}, "spec.maxTokens", 131072),
    ],
)
def test_numeric_fields_have_upper_bounds(body: dict[str, object], field: str, limit: int) -> None:
    with pytest.raises(SpecError) as info:
        parse_function(spec(**body))
    assert field in str(info.value) and str(limit) in str(info.value)


def test_the_bounds_themselves_are_accepted() -> None:
    f = parse_function(
        spec(scaling={"minScale": 256, "maxScale": 256, "concurrency": 1024}, maxTokens=131072)
    )
    assert f.spec.scaling.max_scale == 256 and f.spec.max_tokens == 131072


def test_long_strings_are_rejected_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"spec\.model\.source"):
        parse_function(spec(model={"source": "gguf:/" + "m" * 5000}))
    with pytest.raises(SpecError, match=r"spec\.handler"):
        parse_function(spec(handler="/h/" + "x" * 5000 + ".py:handle"))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # flow nesting: PyYAML's composer would recurse 100k deep
        "a:\n" + "".join(" " * i + "- \n" for i in range(1, 300)),  # block nesting
        "k: {" * 5000,
    ],
)
def test_deep_yaml_is_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError, match="nested deeper than"):
        parse_function_yaml(text)


def test_alias_bombs_are_a_spec_error_in_bounded_time() -> None:
    bomb = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
    )  # 9**9 (387 million) strings once expanded
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=f"more than {MAX_YAML_NODES} nodes"):
        parse_function_yaml(bomb)
    assert time.perf_counter() - t0 < 1.0


def test_many_nodes_are_a_spec_error() -> None:
    with pytest.raises(SpecError, match=f"more than {MAX_YAML_NODES} nodes"):
        parse_function_yaml("a: [" + "1, " * (MAX_YAML_NODES + 10) + "]")
