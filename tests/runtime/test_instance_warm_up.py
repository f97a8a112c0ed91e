"""A pre-warmed worker's warm-up (runtime.instance.warm_up) runs a prefill of every row count
from 1 to MAX_WARM_ROWS once: a matmul shape includes its rows, and the first of each in a
process cost ~4 ms per linear shape (oneDNN primitive creation) in an activated standby's
first request, whose prompt prefix the pool restored, leaving a few rows to prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime import instance
from runtime.models.llama import LlamaModel
from tests.runtime.tiny_gguf import register_tiny


def test_warm_up_prefills_every_small_row_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows: list[int] = []
    forward = LlamaModel.forward

    def counting(self: LlamaModel, batch: Any, kv_blocks: Any) -> Any:
        rows.append(int(batch.input_ids.numel()))
        return forward(self, batch, kv_blocks)

    monkeypatch.setattr(LlamaModel, "forward", counting)
    instance.warm_up(instance.load_template(register_tiny(tmp_path).directory))
    assert set(range(1, instance.MAX_WARM_ROWS + 1)) <= set(rows)
