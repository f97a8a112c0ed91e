"""bench.raw_engine: the raw engine's decode on a registered model, as bench.peers runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.raw_engine import measure
from runtime.registry import register
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf


def test_measures_decode_on_the_store_of_a_served_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_MODEL_ROOTS", str(tmp_path))
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, hf_weights(3))
    home = tmp_path / "home"
    register(str(source), "bfloat16", home=home)  # what the served run left in the store
    result = measure(home, str(source), "bfloat16", tokens=6, runs=2, arena="64MiB")
    assert result["dtype"] == "bfloat16"
    assert isinstance(result["prompt_tokens"], int) and result["prompt_tokens"] > 0
    runs = result["decode_tok_s_runs"]
    assert isinstance(runs, list) and len(runs) == 2 and all(r > 0 for r in runs)
