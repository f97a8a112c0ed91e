"""How many KV bytes one instance may hold in its pool (the pool enforces it per session).

The agent, the pool's admin, grants each instance a ticket carrying this quota; the worker's
pool session presents it. Without a ticket a session holds no KV at all, so a handler that
opens its own pool session cannot take blocks beyond its instance's share.
"""

from __future__ import annotations

from typing import Any


def instance_kv_quota(profile: dict[str, Any], max_context: int, concurrency: int, arena_bytes: int) -> int:
    """KV bytes for ``concurrency`` requests at the model's full context, at most half the arena.

    ``profile``: the model's materialized KV profile (``block_size`` tokens per block,
    ``kv_block_bytes`` per block). Half the arena: one instance (or a handler inside it that
    allocates on purpose) can never starve every other instance of the device; its engine
    waits or preempts when the quota is spent, as when the arena is full.
    """
    if concurrency < 1 or max_context < 1 or arena_bytes < 1:
        raise ValueError("concurrency, max_context and arena_bytes must be >= 1")
    block_size = int(profile["block_size"])
    block_bytes = int(profile["kv_block_bytes"])
    blocks_per_request = -(-max_context // block_size)
    return min(concurrency * blocks_per_request * block_bytes, arena_bytes // 2)
