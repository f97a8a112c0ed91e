"""Turns scheduled sequences into a :class:`~runtime.models.llama.Batch`, runs it, samples."""

from __future__ import annotations

import torch

from runtime.engine.sampling import sample
from runtime.engine.sequence import Sequence
from runtime.models.llama import Batch, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_blocks: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self._generators: dict[int, torch.Generator] = {}

    def run(self, seqs: list[Sequence]) -> list[int]:
        """Feed every sequence's uncached tokens; return one sampled token per sequence."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        bs = self.block_size
        width = max(len(s.block_table) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, seq in enumerate(seqs):
            tokens = seq.token_ids
            start = seq.num_cached
            for p in range(start, len(tokens)):
                ids.append(tokens[p])
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            query_lens.append(len(tokens) - start)
            context_lens.append(len(tokens))
            table[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
        batch = Batch(
            torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), query_lens, context_lens, table
        )
        logits = self.model.forward(batch, self.kv_blocks)
        out = []
        for i, seq in enumerate(seqs):
            seq.num_cached = len(seq)
            if seq.constraint is not None:  # only constrained requests pay for a mask
                seq.constraint.mask_logits(logits[i])
            out.append(sample(logits[i], seq.params, seq.output_ids, self._generator(seq)))
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
