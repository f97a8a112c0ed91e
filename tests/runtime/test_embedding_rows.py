"""A prompt's embedding rows read from the store file while the table loads (TIDAL §5.2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.functional import embedding

from gpu_pool import store
from runtime import quant
from runtime.models.embedding_rows import EMBED, EmbeddingRows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_are_the_tables_rows(tmp_path: Path, dtype: torch.dtype) -> None:
    table = torch.randn(50, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    manifest = store.write(tmp_path / "m", {"model.norm.weight": torch.ones(24, dtype=dtype), EMBED: table})
    rows = EmbeddingRows.of(manifest)
    assert rows is not None
    ids = torch.tensor([3, 0, 49, 3, 17, 17, 3])  # repeats, both ends of the table
    got = rows.rows(ids)
    assert got.dtype == dtype and got.shape == (7, 24)
    assert torch.equal(got, embedding(ids, table))
    assert rows.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 24)
    for bad in ([50], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            rows.rows(torch.tensor(bad))


def test_only_a_plain_two_dimensional_table_is_read_by_rows(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    planes = quant.quantize(torch.randn(64, 32, generator=g), "int8")
    quantized = store.write(tmp_path / "q", {EMBED + suffix: p.contiguous() for suffix, p in planes.items()})
    assert EmbeddingRows.of(quantized) is None
    flat = store.write(tmp_path / "flat", {EMBED: torch.zeros(64)})
    assert EmbeddingRows.of(flat) is None
    other = store.write(tmp_path / "none", {"lm_head.weight": torch.zeros(4, 4)})
    assert EmbeddingRows.of(other) is None


def test_a_short_store_file_is_an_os_error(tmp_path: Path) -> None:
    manifest = store.write(tmp_path / "m", {EMBED: torch.zeros(64, 32)})
    rows = EmbeddingRows.of(manifest)
    assert rows is not None
    with open(rows.file, "r+b") as f:
        f.truncate(rows.offset + 10 * rows.row_bytes)
    assert torch.equal(rows.rows(torch.tensor([9])), torch.zeros(1, 32))
    with pytest.raises(OSError, match="ends before"):
        rows.rows(torch.tensor([40]))


def test_an_unreadable_store_file_falls_back_to_waiting_for_the_table(tmp_path: Path) -> None:
    """A worker that cannot read the entry (moved, or outside what its sandbox allows) loses
    only the head start: the gate says None and counts it, the forward waits for stage 0."""
    import os

    from gpu_pool.readiness import Readiness
    from runtime.models.layer_gate import LayerGate

    manifest = store.write(tmp_path / "m", {"model.norm.weight": torch.ones(4), EMBED: torch.zeros(8, 4)})
    rows = EmbeddingRows.of(manifest)
    assert rows is not None
    os.unlink(rows.file)
    read_fd, write_fd = os.pipe()
    names = [e.name for e in manifest.tensors]
    readiness = Readiness(read_fd, [1, 2])
    gate = LayerGate(readiness, names, 0, embedding=rows)
    try:
        assert gate.embed(torch.tensor([1, 2])) is None
        assert gate.rows_fallbacks == 1 and gate.rows_read == 0
    finally:
        os.close(write_fd)
        readiness.close()
