"""Runtime tests register models from files they write under pytest's temporary directory:
that directory is the model root (``EMBER_MODEL_ROOTS``) for every test here and for the
processes they start."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from runtime.sources import ROOTS_ENV


@pytest.fixture(scope="session", autouse=True)
def model_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = os.path.realpath(tmp_path_factory.getbasetemp())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROOTS_ENV, root)
        yield root


@pytest.fixture
def torch_cuda() -> torch.device:
    """A CUDA device for torch-only code (the model's torch path needs no CuPy)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no usable CUDA device (CPU build, or no device visible)")
    return torch.device("cuda", torch.cuda.current_device())
