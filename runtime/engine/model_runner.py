"""Turns scheduled sequences into a :class:`~runtime.models.llama.Batch`, runs it, samples."""

from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import NamedTuple

import torch

from runtime.engine.sampling import TokenLogprob, sample, targets_logprobs, token_logprob
from runtime.engine.sequence import Sequence
from runtime.models.llama import Batch, LlamaModel
from runtime.models.lora import LoraBatch

# Prompt positions whose logits are computed at once for prompt log-probabilities: bounds the
# (rows x vocab) float32 temporaries (128 x 49152 x 4 B = 24 MiB for SmolLM2).
LOGIT_CHUNK = 128


class Sampled(NamedTuple):
    """One sequence's new token and, when its request asked, its log-probability."""

    token: int
    logprob: TokenLogprob | None = None
    # Why this sequence could not sample (its constraint failed: token is -1); it fails alone.
    error: str | None = None


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_blocks: torch.Tensor, block_size: int, eos_ids: Collection[int] = ()
    ) -> None:
        self.model = model
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.eos_ids = frozenset(eos_ids)  # masked before min_tokens
        self._generators: dict[int, torch.Generator] = {}
        if model.cpu_kernels is not None:
            # The kernels' weight descriptors and scratch, built here rather than by the first
            # step: 2-8 ms that a standby pays ahead and an instance's first request does not.
            model.cpu_kernels.prepare(kv_blocks)

    def run(self, seqs: list[Sequence]) -> list[Sampled]:
        """Feed every sequence's uncached tokens; return one sampled token per sequence.

        A sequence whose request wants prompt log-probabilities (and has none yet) gets the
        logits of every prompt position, computed from the forward pass's hidden states in
        chunks of :data:`LOGIT_CHUNK` rows; every other batch takes the forward pass's one row
        of logits per sequence, as before.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        rows: list[int] = []  # flat rows whose logits are wanted
        full: list[bool] = []  # per sequence: all its new rows (prompt logprobs) or only the last
        bs = self.block_size
        width = max(len(s.block_table) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, seq in enumerate(seqs):
            tokens = seq.token_ids
            start = seq.num_cached
            # Prefix caching is off for such requests (block_manager): the prompt starts at 0.
            wants = seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None and start == 0
            full.append(wants)
            first = len(ids)
            for p in range(start, len(tokens)):
                ids.append(tokens[p])
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            rows.extend(range(first, len(ids)) if wants else [len(ids) - 1])
            query_lens.append(len(tokens) - start)
            context_lens.append(len(tokens))
            table[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
        batch = Batch(
            torch.tensor(ids),
            torch.tensor(positions),
            torch.tensor(slots),
            query_lens,
            context_lens,
            table,
            torch.tensor(rows) if any(full) else None,
            self._lora(seqs, query_lens),
        )
        result = self.model.forward(batch, self.kv_blocks)
        if batch.logit_rows is not None:  # hidden states: the last rows' logits, prompts' below
            hidden = result
            sizes = (len(s) - s.num_cached if f else 1 for s, f in zip(seqs, full, strict=True))
            ends = list(itertools.accumulate(sizes))
            logits = self.model.lm_logits(hidden[torch.tensor(ends) - 1])
        else:
            logits = result
        out = []
        row = 0
        for i, (seq, wants) in enumerate(zip(seqs, full, strict=True)):
            if wants:
                seq.prompt_logprobs = self._prompt_logprobs(hidden[row : row + len(seq)], seq)
                row += len(seq)
            else:
                row += 1
            last = logits[i]
            seq.num_cached = len(seq)
            params = seq.params
            model_logits = last
            if seq.constraint is not None:  # only constrained requests pay for a mask
                if params.logprobs is not None:  # logprobs report the model's own distribution
                    model_logits = last.clone()
                try:
                    seq.constraint.mask_logits(last)
                except Exception as exc:
                    # A client's grammar that dead-ends (a schema whose $refs loop without a
                    # token) fails its own request, never the others sharing the batch.
                    reason = str(exc).split("\n", 1)[0][:300]  # llguidance appends its whole state
                    out.append(Sampled(-1, None, f"the output grammar failed: {reason}"))
                    continue
            token = sample(last, params, seq.output_ids, self._generator(seq), seq.prompt_ids, self.eos_ids)
            lp = token_logprob(model_logits, token, params.logprobs) if params.logprobs is not None else None
            out.append(Sampled(token, lp))
        return out

    def _lora(self, seqs: list[Sequence], query_lens: list[int]) -> LoraBatch | None:
        """Which rows run with which adapter (None: no sequence has one, the plain path)."""
        if not any(s.adapter for s in seqs):
            return None
        adapters = self.model.adapters
        return LoraBatch.build([adapters[s.adapter] if s.adapter else None for s in seqs], query_lens)

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given those before it (None for the first)."""
        ids, k = seq.prompt_ids, seq.params.prompt_logprobs or 0
        out: list[TokenLogprob | None] = [None]
        for start in range(0, len(ids) - 1, LOGIT_CHUNK):
            stop = min(start + LOGIT_CHUNK, len(ids) - 1)
            out += targets_logprobs(self.model.lm_logits(hidden[start:stop]), ids[start + 1 : stop + 1], k)
        return out

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.greedy:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator()
            if seq.params.seed is not None:
                g.manual_seed(seq.params.seed)
            else:
                g.seed()
            self._generators[seq.seq_id] = g
        return g

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
