"""What the node agent grants an instance before its assign: a KV quota and a pool ticket.

The quota follows from the function's concurrency and its model's KV profile and context
(:func:`runtime.kv_quota.instance_kv_quota`); each model's shape is read from its store entry
once, so launches stay off the disk. The ticket is single-use: the agent, the pool's admin,
asks the device's pool for one carrying the quota and the scope the instance's published
prefix KV is shared in (its function's), and the worker opens its session with it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from runtime.agent_config import AgentConfig
from runtime.device_pools import DevicePools

ModelShape = tuple[dict[str, Any], int]  # (the model's CPU KV profile, its context in tokens)


class InstanceGrants:
    """KV quotas and pool tickets for the instances of one node's devices."""

    def __init__(self, config: AgentConfig, pools: DevicePools) -> None:
        self.config = config
        self._pools = pools
        self._shapes: dict[str, ModelShape] = {}  # model dir -> its shape

    async def ticket(self, device: str, kv_quota_bytes: int, prefix_scope: str) -> str:
        """A single-use pool ticket for one instance's session on ``device`` (see module)."""
        return await asyncio.to_thread(self._grant, device, kv_quota_bytes, prefix_scope)

    def kv_quota(self, model_dir: str, concurrency: int) -> int:
        """The KV quota of an instance of ``model_dir`` serving ``concurrency`` requests."""
        from runtime.kv_quota import instance_kv_quota

        profile, context = self.model_shape(model_dir)
        return instance_kv_quota(profile, context, concurrency, self.config.arena_bytes)

    def known_shape(self, model_dir: str) -> ModelShape | None:
        """``model_dir``'s shape if it was read already (no disk access)."""
        return self._shapes.get(model_dir)

    def model_shape(self, model_dir: str) -> ModelShape:
        """The CPU profile and the context of ``model_dir`` (read once per model)."""
        from runtime.registry import load

        shape = self._shapes.get(model_dir)
        if shape is None:
            model = load(Path(model_dir))
            shape = self._shapes[model_dir] = (
                model.profile("cpu"),
                int(model.config["max_position_embeddings"]),
            )
        return shape

    def _grant(self, device: str, kv_quota_bytes: int, prefix_scope: str) -> str:
        from gpu_pool.client import PoolClient

        pool = self._pools.pools[device]
        with PoolClient(pool.socket_path, timeout=5.0, admin_token=pool.admin_token) as client:
            return client.grant(kv_quota_bytes, prefix_scope)
