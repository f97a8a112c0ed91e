"""Where KV blocks live: a view over the pool arena (on demand) or a private tensor.

Both give the model one tensor of shape (num_blocks, L, 2, BS, H_kv, D) indexed by
physical block number, and a :class:`BaseBlockSource` that hands out those numbers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from runtime.engine.block_manager import BaseBlockSource, RangeBlockSource
from runtime.models.llama import LlamaConfig

log = logging.getLogger("ember.engine")


class PoolBlockSource(BaseBlockSource):
    """KV blocks from the device's pool, block-aligned, so ``offset // block_bytes`` numbers them.

    With a ``prefix_model`` (the registered model's id) and ``layout``, full prompt blocks are
    shared through the pool (``kv_publish`` / ``kv_restore``): they outlive this instance, and a
    later one of the same model restores them instead of recomputing them. ``recompute_s`` is
    what one block's prefill costs, the eviction price the pool weighs them at. A pool that fails
    such a call costs only the sharing: the engine computes the blocks itself."""

    def __init__(
        self,
        client: Any,
        block_bytes: int,
        prefix_model: str | None = None,
        layout: str = "",
        recompute_s: float = 0.0,
    ) -> None:
        self.client = client
        self.block_bytes = block_bytes
        self._pool_ids: dict[int, int] = {}  # physical block number -> pool block id
        self.prefix_model = prefix_model
        self.layout = layout
        self.recompute_s = recompute_s

    @property
    def shares_prefixes(self) -> bool:
        return self.prefix_model is not None

    def restore(self, hashes: list[bytes], block_ids: list[int], first: bool = False) -> int:
        assert self.prefix_model is not None
        ids = [self._pool_ids[b] for b in block_ids]
        return self._prefix_call(
            lambda: self.client.kv_restore(self.prefix_model, self.layout, hashes, ids, first)
        )

    def publish(self, hashes: list[bytes], block_ids: list[int]) -> None:
        assert self.prefix_model is not None
        ids = [self._pool_ids[b] for b in block_ids]
        self._prefix_call(
            lambda: self.client.kv_publish(self.prefix_model, self.layout, hashes, ids, self.recompute_s)
        )

    def _prefix_call(self, call: Any) -> int:
        from gpu_pool.client import RemotePoolError
        from gpu_pool.errors import Forbidden, UnknownOp

        try:
            return int(call())
        except RemotePoolError as exc:
            # A pool from before prefix sharing, or a session without a function's scope (a
            # cluster pod's): stop asking it.
            if exc.kind is UnknownOp or exc.kind is Forbidden:
                log.info("no prefix KV sharing with this pool: %s", exc)
                self.prefix_model = None
            else:
                log.warning("prefix KV sharing with the pool failed: %s", exc)
            return 0

    def acquire(self, num_blocks: int) -> list[int] | None:
        from gpu_pool.client import RemotePoolError
        from gpu_pool.errors import KVQuotaExceeded, OutOfMemory

        try:
            blocks = self.client.kv_alloc(num_blocks, self.block_bytes, aligned=True)
        except RemotePoolError as exc:
            # The arena is full or this instance's KV quota is spent: the scheduler waits or
            # preempts exactly as when its own blocks run out.
            if exc.kind in (OutOfMemory, KVQuotaExceeded):
                return None
            raise
        return self.adopt(blocks)

    def adopt(self, blocks: Any) -> list[int]:
        """The physical block numbers of ``blocks`` (a ``gpu_pool.client.KVBlocks`` of this
        source's size, allocated aligned on its session), now held by this source."""
        if blocks.block_bytes != self.block_bytes:
            raise ValueError(f"blocks of {blocks.block_bytes} bytes for a source of {self.block_bytes}")
        numbers = [offset // self.block_bytes for offset in blocks.offsets]
        self._pool_ids.update(zip(numbers, blocks.block_ids, strict=True))
        return numbers

    def release(self, block_ids: list[int]) -> None:
        if block_ids:
            self.client.kv_free([self._pool_ids.pop(b) for b in block_ids])

    @property
    def num_held(self) -> int:
        return len(self._pool_ids)


def pool_block_bytes(block_bytes: int, alignment: int) -> int:
    """A KV block's size in a pool that places at ``alignment`` bytes (``PoolClient.alignment``):
    the pool rounds every block up to it (512 bytes on CPU pools, for direct reads; a model's
    profile rounds to 256), and an aligned block's number is its offset divided by that size."""
    return -(-block_bytes // alignment) * alignment


def kv_block_bytes(config: LlamaConfig, block_size: int, dtype: torch.dtype, alignment: int = 256) -> int:
    """Bytes of one block rounded up to the pool's alignment."""
    return pool_block_bytes(config.kv_block_bytes(block_size, dtype), alignment)


def arena_kv_view(
    arena: torch.Tensor, config: LlamaConfig, block_size: int, dtype: torch.dtype, block_bytes: int
) -> torch.Tensor:
    """The arena (a 1-D uint8 tensor) as blocks: (num_blocks, L, 2, BS, H_kv, D) of ``dtype``.

    Pass the session's KV memory, ``PoolClient.kv_arena()``: on a CPU pool the arena itself
    is read-only and KV blocks live in a memory file private to the session, at the same
    offsets the pool hands out."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_blocks = arena.numel() // block_bytes
    shape = (num_blocks, *config.kv_block_shape(block_size))
    inner = torch.empty(shape[1:]).stride()
    typed = arena[: num_blocks * block_bytes].view(dtype)
    return typed.as_strided(shape, (block_bytes // itemsize, *inner))


def private_kv(
    config: LlamaConfig, block_size: int, dtype: torch.dtype, num_blocks: int
) -> tuple[torch.Tensor, RangeBlockSource]:
    """A preallocated KV tensor and its block source (the contiguous mode vLLM uses)."""
    return torch.zeros(num_blocks, *config.kv_block_shape(block_size), dtype=dtype), RangeBlockSource(
        num_blocks
    )
