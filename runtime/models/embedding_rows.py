"""A prompt's embedding rows, read from the store file while the table still loads (TIDAL §5.2).

A first prefill needs the embedding rows of its prompt's tokens only (N rows of E), yet the
table is one of a model's largest tensors (SmolLM2: 56.6 of 269 MB; the zoo's 1.1 B model: 201
of 1,235 MB). Loaded first, as the forward's first operator touches it, it holds up every layer
behind it. So registration puts a plain floating-point table last in the access order
(:mod:`runtime.access_order`), and a progressive start reads the rows its prompt needs straight
from the store file (the very bytes the pool is loading: an entry never changes once written),
while layer 0 already loads. The table is first needed whole by a tied LM head at the end of the
prefill (:mod:`runtime.models.layer_gate` waits for it there); an untied model's later forwards
(decode steps) read their rows from the file too until the table is in.
"""

from __future__ import annotations

import os

import torch

from gpu_pool.manifest import Manifest

EMBED = "model.embed_tokens.weight"
PLAIN = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmbeddingRows:
    """Rows of a 2-D plain floating-point tensor at ``offset`` in store file ``file``."""

    def __init__(self, file: str, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.file = file
        self.offset = offset
        self.num_rows, self.width = shape
        self.dtype = dtype
        self.row_bytes = self.width * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def of(cls, manifest: Manifest, name: str = EMBED) -> EmbeddingRows | None:
        """The rows of tensor ``name`` of ``manifest``; None when it is not a plain 2-D
        floating-point table (a quantized table is read whole, as before)."""
        entry = next((e for e in manifest.tensors if e.name == name), None)
        if entry is None or entry.dtype not in PLAIN or len(entry.shape) != 2:
            return None
        if any(e.name.startswith(name + ".") for e in manifest.tensors):  # quantization planes
            return None
        rows, width = entry.shape
        return cls(entry.file, entry.offset, (rows, width), PLAIN[entry.dtype])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, table)`` from the file: (N,) token ids on any device -> (N, E) on
        the CPU. IndexError for an id outside the table, as ``F.embedding`` raises; OSError when
        the file is short."""
        # The rows are gathered on the host: CUDA ids would index the host rows from the device,
        # which torch refuses.
        ids = ids.reshape(-1).to("cpu", torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise IndexError(f"token id out of range [0, {self.num_rows})")
        unique, inverse = torch.unique(ids, return_inverse=True)
        if not unique.numel():
            return torch.empty(0, self.width, dtype=self.dtype)
        buf = bytearray(unique.numel() * self.row_bytes)
        view = memoryview(buf)
        fd = os.open(self.file, os.O_RDONLY)
        try:
            # A few rows of a large table: no readahead around each of them.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for i, token in enumerate(unique.tolist()):
                start, end = i * self.row_bytes, (i + 1) * self.row_bytes
                at = self.offset + token * self.row_bytes
                while start < end:  # preadv may return short counts
                    n = os.preadv(fd, [view[start:end]], at)
                    if n == 0:
                        raise OSError(f"store file {self.file} ends before byte {at}")
                    start, at = start + n, at + n
        finally:
            view.release()
            os.close(fd)
        table = torch.frombuffer(buf, dtype=self.dtype).view(unique.numel(), self.width)  # (U, E)
        return table[inverse]  # (N, E)
