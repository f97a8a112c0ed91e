"""The weight access order traced at registration (TIDAL): the forward's own order, but a plain
embedding table last (a progressive start reads its prompt's rows from the store file)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_pool import store
from runtime.access_order import ordered, trace_access_order
from runtime.registry import register
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

LAYER_ORDER = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def _config(layers: int) -> dict[str, object]:
    return {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 128,
    }


def _forward_order(layers: int) -> list[str]:
    names = []
    for i in range(layers):
        names += [f"model.layers.{i}.{n}" for n in LAYER_ORDER]
    return [*names, "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"]


def _shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,), "lm_head.weight": (64, 32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,)}
        shapes |= {p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.o_proj.weight": (32, 32)}
        shapes |= {p + "self_attn.k_proj.weight": (16, 32), p + "self_attn.v_proj.weight": (16, 32)}
        shapes |= {p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32)}
        shapes |= {p + "mlp.down_proj.weight": (32, 64)}
    return shapes


def test_recorded_order_is_the_forward_order_whatever_the_table_order() -> None:
    layers = 12  # layer 10 sorts before layer 2 by name: the trace must not follow names
    g = torch.Generator().manual_seed(0)
    shapes = _shapes(layers)
    names = sorted(shapes)
    random.Random(1).shuffle(names)
    table = {n: torch.randn(shapes[n], generator=g) for n in names}
    assert trace_access_order(_config(layers), table) == _forward_order(layers)


def test_quantized_planes_follow_their_weight() -> None:
    from runtime import quant

    g = torch.Generator().manual_seed(0)
    table = {n: t for n, t in ((n, torch.randn(s, generator=g)) for n, s in [
        ("model.embed_tokens.weight", (64, 32)), ("model.norm.weight", (32,)), ("lm_head.weight", (64, 32)),
    ])}  # fmt: skip
    p = "model.layers.0."
    table |= {
        p + "input_layernorm.weight": torch.ones(32),
        p + "post_attention_layernorm.weight": torch.ones(32),
    }
    for name, shape in [("self_attn.q_proj.weight", (32, 32)), ("self_attn.k_proj.weight", (16, 32)),
                        ("self_attn.v_proj.weight", (16, 32)), ("self_attn.o_proj.weight", (32, 32)),
                        ("mlp.gate_proj.weight", (64, 32)), ("mlp.up_proj.weight", (64, 32)),
                        ("mlp.down_proj.weight", (32, 64))]:  # fmt: skip
        for suffix, plane in quant.quantize(torch.randn(shape, generator=g), "int8").items():
            table[p + name + suffix] = plane.contiguous()
    order = trace_access_order(_config(1), dict(reversed(table.items())))
    assert sorted(order) == sorted(table)
    for name in LAYER_ORDER[1:]:
        if "proj" in name:
            assert order.index(p + name + ".scales") == order.index(p + name) + 1, name
    assert order[-2:] == ["lm_head.weight", "model.embed_tokens.weight"]


def test_a_quantized_embedding_table_stays_where_the_forward_reads_it() -> None:
    """Its rows cannot be read from the file as they are (runtime.models.embedding_rows):
    moved last, the first prefill would wait for the whole model."""
    from runtime import quant

    g = torch.Generator().manual_seed(0)
    table = {name: torch.randn(shape, generator=g) for name, shape in _shapes(1).items()}
    embed = table.pop("model.embed_tokens.weight")
    for suffix, plane in quant.quantize(embed, "int8").items():
        table["model.embed_tokens.weight" + suffix] = plane.contiguous()
    order = trace_access_order(_config(1), table)
    assert order[0] == "model.embed_tokens.weight" and sorted(order) == sorted(table)


def test_ordered_needs_every_name_once() -> None:
    with pytest.raises(ValueError, match="every tensor"):
        ordered({"a": torch.zeros(1), "b": torch.zeros(1)}, ["a", "a"])


def test_registration_stores_the_traced_order(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    weights = hf_weights(layers=11)
    write_tiny_gguf(path, weights)
    model = register(str(path), "float32", home=tmp_path / "home")
    manifest = model.manifest()
    names = [e.name for e in manifest.tensors]
    expected = _forward_order(11)
    if "lm_head.weight" not in weights:  # tied: the head is the embedding
        expected.remove("lm_head.weight")
    assert names == expected
    offsets = [e.offset for e in manifest.tensors]
    assert offsets == sorted(offsets)  # the file's bytes lie in access order too
    assert store.verify(manifest) == []
    assert store.read_metadata(model.store_path)["access_order"]["traced"] is True
    assert model.record["access_order"] == "traced"
