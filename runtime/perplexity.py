"""Perplexity of a model over a text, through the engine's forward pass, as llama.cpp measures it.

``llama-perplexity -c N`` cuts the tokens into chunks of N and scores, in each chunk, the
predictions made from its second half (every prediction sees at least N/2 tokens of context):
token j + 1 given tokens 0..j, for j = N/2 .. N-2. This does the same, so the numbers compare
with llama.cpp's on the same text and window.

:meth:`LlamaModel.forward` returns the logits of each sequence's last new token only, so the
scored positions go in as one-token sequences of one batch that share the chunk's block table
(in groups of :data:`GROUP`): each writes its own K/V slot, then attends to the context before
it, which is exactly causal attention over the chunk, on the engine's decode path. The first
half of a chunk is one ordinary prefill.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from runtime.models.llama import Batch, LlamaModel

GROUP = 64  # one-token sequences per forward (the decode batch sizes the engine runs)
_BLOCK = 16


class Perplexity(NamedTuple):
    value: float  # exp(mean negative log-likelihood)
    tokens: int  # predictions scored
    chunks: int


def perplexity(
    model: LlamaModel,
    ids: list[int],
    window: int,
    max_chunks: int | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> Perplexity:
    """Perplexity of ``ids`` in chunks of ``window`` tokens (at most ``max_chunks`` of them)."""
    if window < 4:
        raise ValueError(f"window must be >= 4 tokens, got {window}")
    chunks = len(ids) // window
    if max_chunks is not None:
        chunks = min(chunks, max_chunks)
    if chunks < 1:
        raise ValueError(f"{len(ids)} tokens do not fill one window of {window}")
    nll, scored = 0.0, 0
    for c in range(chunks):
        chunk_nll, n = _chunk(model, ids[c * window : (c + 1) * window], kv_dtype)
        nll += chunk_nll
        scored += n
    return Perplexity(math.exp(nll / scored), scored, chunks)


def _chunk(model: LlamaModel, ids: list[int], kv_dtype: torch.dtype) -> tuple[float, int]:
    """Negative log-likelihood (sum) of the second half's predictions in one chunk, and their count."""
    n = len(ids)
    first = n // 2
    blocks = -(-n // _BLOCK)
    kv = torch.zeros(blocks, *model.config.kv_block_shape(_BLOCK), dtype=kv_dtype)
    table = torch.arange(blocks)[None, :]  # block b holds slots b*BS..: slot = position
    prefix = torch.arange(first)
    model.forward(Batch(torch.tensor(ids[:first]), prefix, prefix, [first], [first], table), kv)
    nll = 0.0
    for start in range(first, n - 1, GROUP):
        pos = torch.arange(start, min(start + GROUP, n - 1))
        b = len(pos)
        batch = Batch(torch.tensor(ids)[pos], pos, pos, [1] * b, (pos + 1).tolist(), table.repeat(b, 1))
        logp = torch.log_softmax(model.forward(batch, kv), dim=-1)  # (b, vocab)
        targets = torch.tensor(ids)[pos + 1]
        nll -= float(logp[torch.arange(b), targets].sum())
    return nll, n - 1 - first
