"""The one place an engine is assembled: model, tokenizer, KV storage, block source, EOS ids.

Instances (:func:`runtime.instance.bind`), pre-warming (:func:`runtime.instance.warm_up`),
``ember generate`` and the engine benchmark all build through :func:`build_engine`, so KV
storage and block numbering are set up one way. The KV comes from one of two places:
:class:`PoolKV` (blocks of the pool's arena, allocated on demand, Tangram's ElasticKV) or
:class:`PrivateKV` (a preallocated private tensor: warm-up and the contiguous baseline).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.engine.engine import Engine, EngineConfig

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

    from runtime.models.llama import LlamaModel


@dataclass(frozen=True)
class PoolKV:
    """KV blocks from the pool on demand, in the session's KV memory (``client.kv_arena()``).

    ``client`` is a connected :class:`gpu_pool.client.PoolClient`; ``block_bytes`` is one
    block's size, which the engine rounds up to the pool's alignment
    (:func:`runtime.engine.kv_storage.pool_block_bytes`), so a block's pool offset divided by it
    is its block number."""

    client: Any
    block_bytes: int
    # The registered model's id: full prompt blocks are then published to the pool and restored
    # from it across instances (None: cached within this instance only).
    prefix_model: str | None = None
    recompute_s: float = 0.0  # seconds one block's prefill takes: its eviction price in the pool

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        if not self.recompute_s >= 0:
            raise ValueError(f"recompute_s must be >= 0, got {self.recompute_s}")


@dataclass(frozen=True)
class PrivateKV:
    """A preallocated, zeroed KV tensor of ``num_blocks`` blocks owned by this process."""

    num_blocks: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


def build_engine(
    model: LlamaModel,
    tokenizer: Tokenizer,
    eos_ids: Iterable[int],
    kv: PoolKV | PrivateKV,
    kv_dtype: torch.dtype,
    config: EngineConfig,
) -> Engine:
    """An :class:`Engine` over ``model`` (whose weights the caller bound) with KV from ``kv``.

    Blocks hold ``config.block_size`` tokens of every layer's K and V in ``kv_dtype``."""
    from runtime.engine.kv_storage import PoolBlockSource, arena_kv_view, pool_block_bytes, private_kv

    if isinstance(kv, PoolKV):
        block_bytes = pool_block_bytes(kv.block_bytes, kv.client.alignment)
        blocks = arena_kv_view(kv.client.kv_arena(), model.config, config.block_size, kv_dtype, block_bytes)
        # KV bytes depend on the model, the dtype and the block geometry: all of it keys a block.
        layout = f"{str(kv_dtype).removeprefix('torch.')}-bs{config.block_size}-{block_bytes}"
        source = PoolBlockSource(kv.client, block_bytes, kv.prefix_model, layout, kv.recompute_s)
        key = f"{kv.prefix_model or ''}:{layout}"
        return Engine(model, tokenizer, blocks, source, set(eos_ids), config, model_key=key)
    tensor, private = private_kv(model.config, config.block_size, kv_dtype, kv.num_blocks)
    return Engine(model, tokenizer, tensor, private, set(eos_ids), config)
