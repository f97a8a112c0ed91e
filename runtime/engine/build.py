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
    block's size rounded up to the pool's alignment (see ``kv_storage.kv_block_bytes``), so a
    block's pool offset divided by it is its block number."""

    client: Any
    block_bytes: int

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")


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
    from runtime.engine.kv_storage import PoolBlockSource, arena_kv_view, private_kv

    if isinstance(kv, PoolKV):
        blocks = arena_kv_view(
            kv.client.kv_arena(), model.config, config.block_size, kv_dtype, kv.block_bytes
        )
        return Engine(
            model, tokenizer, blocks, PoolBlockSource(kv.client, kv.block_bytes), set(eos_ids), config
        )
    tensor, source = private_kv(model.config, config.block_size, kv_dtype, kv.num_blocks)
    return Engine(model, tokenizer, tensor, source, set(eos_ids), config)
