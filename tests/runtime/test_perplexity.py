"""runtime.perplexity against scoring each prediction with a prefill of its own prefix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.perplexity import perplexity
from tests.runtime.tiny_gguf import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, hf_weights


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    vocab = hf_weights()["model.embed_tokens.weight"].shape[0]
    config = LlamaConfig(
        vocab, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, 1e-5, 1e4, False, False, 512
    )
    return LlamaModel(config, {n: torch.from_numpy(a) for n, a in hf_weights(2).items()})


def prefix_nll(model: LlamaModel, ids: list[int], j: int) -> float:
    """-log p(ids[j + 1] | ids[:j + 1]), by one prefill of the prefix."""
    kv = torch.zeros(16, *model.config.kv_block_shape(16))
    pos = torch.arange(j + 1)
    logits = model.forward(
        Batch(torch.tensor(ids[: j + 1]), pos, pos, [j + 1], [j + 1], torch.arange(16)[None]), kv
    )
    return -float(torch.log_softmax(logits[0], -1)[ids[j + 1]])


def test_batched_scoring_equals_one_prefill_per_prediction(model: LlamaModel) -> None:
    window = 160  # positions 80..158 predict: two forwards of one-token sequences (64 + 15)
    ids = np.random.default_rng(0).integers(3, 250, 2 * window + 7).tolist()
    got = perplexity(model, ids, window, kv_dtype=torch.float32)
    assert (got.chunks, got.tokens) == (2, 2 * (window - 1 - window // 2))
    nll = [prefix_nll(model, ids[c * window : (c + 1) * window], j) for c in range(2) for j in range(80, 159)]
    assert got.value == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert perplexity(model, ids, window, max_chunks=1, kv_dtype=torch.float32).chunks == 1


def test_short_text_or_window_is_refused(model: LlamaModel) -> None:
    with pytest.raises(ValueError, match="one window"):
        perplexity(model, [5] * 10, 16)
    with pytest.raises(ValueError, match="window"):
        perplexity(model, [5] * 10, 2)
