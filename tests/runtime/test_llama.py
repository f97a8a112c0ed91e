"""Parity of the paged Llama-family forward with transformers on tiny random models."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.models.llama import Batch, LlamaConfig, LlamaModel

BLOCK = 4


def hf_model(kind: str) -> tuple[Any, dict[str, Any]]:
    import transformers

    base: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if kind == "tied":
        base.update(tie_word_embeddings=True, num_key_value_heads=4)
    if kind == "llama3":
        base["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**base)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**base)
        model = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # biases start at zero; make them matter
            p.normal_(0, 0.2)
    model.eval()
    return model, {**cfg.to_dict(), "model_type": "qwen2" if kind == "qwen2" else "llama"}


def ours(model: Any, cfg: dict[str, Any]) -> tuple[LlamaModel, torch.Tensor]:
    config = LlamaConfig.from_hf(cfg)
    weights = dict(model.state_dict())
    model_ = LlamaModel(config, weights)
    kv = torch.zeros(32, *config.kv_block_shape(BLOCK))
    return model_, kv


def make_batch(seqs: list[tuple[list[int], int, list[int]]]) -> Batch:
    """seqs: (new token ids, tokens already cached, block ids)."""
    ids, pos, slots, qlens, ctx = [], [], [], [], []
    width = max(len(b) for _, _, b in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (new, cached, blocks) in enumerate(seqs):
        for j, t in enumerate(new):
            p = cached + j
            ids.append(t)
            pos.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qlens.append(len(new))
        ctx.append(cached + len(new))
        table[i, : len(blocks)] = torch.tensor(blocks)
    return Batch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qlens, ctx, table)


@pytest.mark.parametrize("kind", ["gqa", "tied", "qwen2", "llama3"])
def test_prefill_and_decode_match_transformers(kind: str) -> None:
    ref, cfg = hf_model(kind)
    model, kv = ours(ref, cfg)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 97, (11,), generator=g).tolist()
    b = torch.randint(0, 97, (6,), generator=g).tolist()
    blocks_a, blocks_b = [7, 2, 9, 30, 11], [5, 1, 20]  # scattered physical blocks

    def reference(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([tokens])).logits[0, -1]

    logits = model.forward(make_batch([(a, 0, blocks_a), (b, 0, blocks_b)]), kv)
    torch.testing.assert_close(logits[0], reference(a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], reference(b), atol=1e-4, rtol=1e-4)
    for step in range(6):  # decode both, one token each, crossing block boundaries
        ta, tb = (step * 13) % 97, (step * 29 + 3) % 97
        logits = model.forward(make_batch([([ta], len(a), blocks_a), ([tb], len(b), blocks_b)]), kv)
        a.append(ta)
        b.append(tb)
        torch.testing.assert_close(logits[0], reference(a), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[1], reference(b), atol=1e-4, rtol=1e-4)
    # a chunk of new tokens after a cached context (what recompute or chunked prefill does)
    chunk = [3, 1, 4]
    logits = model.forward(make_batch([(chunk, len(a), blocks_a)]), kv)
    torch.testing.assert_close(logits[0], reference(a + chunk), atol=1e-4, rtol=1e-4)
