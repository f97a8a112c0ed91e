"""Perplexity of SmolLM2-135M registered as bf16, int8 and q4, through our engine's forward pass.

The text (tests/runtime/data/alice_chapter1.txt, 2,701 tokens) is Chapter I of Lewis Carroll's
"Alice's Adventures in Wonderland" (1865), public domain, as in Project Gutenberg's eBook #11
with ASCII punctuation. Scored as ``llama-perplexity -c 256`` scores (runtime.perplexity), on the
first CHUNKS windows, which keeps the test well under two minutes on two cores.

The source GGUF is Q4_1, so ``q4`` carries its blocks over and matches bf16 (the same weights,
dequantized per forward instead of at registration) to rounding, and quantizing the bf16
weights again gives those very blocks (every group of a Q4_1 tensor spans codes 0..15): the
bf16 reference is of Q4_1 quality already. ``int8`` requantizes the weights onto its own grid.
How q4 fares on weights off the Q4_1 grid is measured by ``bench/quant.py`` (``q4_off_grid``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gpu_pool import store
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.perplexity import Perplexity, perplexity
from runtime.registry import RegisteredModel, register
from runtime.store_weights import StoreWeights
from tests.runtime.conftest import SMOLLM2

pytestmark = pytest.mark.slow

TEXT = Path(__file__).parent / "data" / "alice_chapter1.txt"
WINDOW, CHUNKS = 256, 3


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RegisteredModel]:
    home = tmp_path_factory.mktemp("home")
    return {dtype: register(SMOLLM2, dtype, home=home) for dtype in ("bfloat16", "int8", "q4")}


def stored(model: RegisteredModel) -> dict[str, torch.Tensor]:
    """The store entry's tensors, mmapped (the bytes the pool maps)."""
    return load_file(str(model.store_path / store.TENSORS_FILE))


@pytest.fixture(scope="module")
def results(registered: dict[str, RegisteredModel]) -> dict[str, Perplexity]:
    config = LlamaConfig.from_hf(registered["bfloat16"].config)
    tok = Tokenizer.from_file(str(registered["bfloat16"].directory / "tokenizer.json"))
    ids = tok.encode(TEXT.read_text()).ids

    def measure(weights: dict[str, torch.Tensor]) -> Perplexity:
        return perplexity(LlamaModel(config, weights), ids, WINDOW, CHUNKS)

    return {dtype: measure(stored(model)) for dtype, model in registered.items()}


def test_bf16_perplexity_is_that_of_a_working_model(results: dict[str, Perplexity]) -> None:
    bf16 = results["bfloat16"]
    assert bf16.chunks == CHUNKS and bf16.tokens == CHUNKS * (WINDOW // 2 - 1)
    assert 5 < bf16.value < 40, bf16


def test_int8_is_within_2_percent_of_bf16(results: dict[str, Perplexity]) -> None:
    assert results["int8"].value <= 1.02 * results["bfloat16"].value, results


def test_q4_is_within_10_percent_of_bf16(results: dict[str, Perplexity]) -> None:
    assert results["q4"].value <= 1.10 * results["bfloat16"].value, results
    # Carried over: the q4 weights dequantize to the bf16 ones exactly; the two run different CPU
    # kernels (q4_1 products in fp32 vs bf16 dot products), so the figures agree to ~0.1 %.
    assert results["q4"].value == pytest.approx(results["bfloat16"].value, rel=1e-2)


def test_q4_of_the_bf16_weights_is_the_gguf_q4_1_blocks(registered: dict[str, RegisteredModel]) -> None:
    """Our 4-bit quantizer, given the bf16 weights, writes the bytes llama.cpp's Q4_1 holds."""
    requantized = StoreWeights("q4")
    for name, tensor in stored(registered["bfloat16"]).items():
        requantized.add(name, tensor)
    carried = stored(registered["q4"])
    assert requantized.tensors.keys() == carried.keys()
    for name, tensor in requantized.tensors.items():
        assert torch.equal(tensor, carried[name]), name
